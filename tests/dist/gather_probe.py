"""How often the FSDP units of a model gather their weights, step by step: for tests/parity/test_distill_layouts.py,
which holds a frozen teacher (train/frozen_model.py) to one gather of its root per step, not one per micro-batch.

A unit gathers when its forward starts while its own parameters are sharded: FSDP2 swaps the module's parameters
between the sharded DTensors and the gathered plain tensors (all-gathered under FSDP, copied under replicate), and
gathers in a forward pre-hook. The probe's pre-hook runs before FSDP's (both prepended, the probe's later) and
looks at one parameter the unit gathers itself (not one of a nested unit's). Data parallelism without tensor
parallelism only: there a gathered parameter is a plain tensor.
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def _own_parameter(unit) -> str | None:
    """The name of a parameter `unit` gathers itself (None: it has none of its own)."""
    nested = tuple(f"{name}." for name, m in unit.named_modules() if name and isinstance(m, FSDPModule))
    return next((name for name, _ in unit.named_parameters() if not name.startswith(nested)), None)


class GatherProbe:
    """Counts each FSDP unit's gathers of `parts` (ModelParts) until `step_record` reads and resets them."""

    def __init__(self, parts):
        self.units = {}  # "root" (a part's top module) or the unit's module name -> (module, its parameter's name)
        for i, part in enumerate(parts.parts):
            for name, module in part.named_modules():
                own = _own_parameter(module) if isinstance(module, FSDPModule) else None
                if own is not None:
                    label = name or "root"
                    label = label if len(parts.parts) == 1 else f"{i}.{label}"
                    self.units[label] = (module, own)
        self.gathers = dict.fromkeys(self.units, 0)
        for label, (module, _) in self.units.items():
            module.register_forward_pre_hook(self._counter(label), prepend=True)

    def _sharded(self, label: str) -> bool:
        module, own = self.units[label]
        return isinstance(module.get_parameter(own), DTensor)

    def _counter(self, label: str):
        def count(module, args) -> None:
            self.gathers[label] += self._sharded(label)

        return count

    def step_record(self) -> dict:
        """{"gathers": each unit's gathers since the last record, "freed": every unit sharded again now}."""
        record = {"gathers": dict(self.gathers), "freed": all(self._sharded(label) for label in self.units)}
        self.gathers = dict.fromkeys(self.units, 0)
        return record
