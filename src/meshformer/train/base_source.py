"""A model from outside that a run's `load_checkpoint` may name (a Hugging Face directory), as the trainer asks
for it. The trainer knows no format: its caller hands it the sources it accepts (the CLI: interop/base_model.py),
as it hands it the preflight checks; without them `load_checkpoint` names a meshformer checkpoint or run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class BaseModelSource(Protocol):
    label: str  # how a message names one, before its path: "the Hugging Face model"

    def claims(self, path: Path) -> bool:
        """Whether `path` is a model in this format."""
        ...

    def model_fields(self, path: Path) -> dict:
        """Its `model.model_config` fields, for the config loader (run_mode finetune takes the shape from them)."""
        ...

    def weights(self, path: Path, expected: dict[str, tuple[int, ...]], field: str) -> dict[str, torch.Tensor]:
        """Its tensors under meshformer's names, exactly the model `expected` ({name: shape}) describes, or a
        one-line error naming the config `field` that named it."""
        ...

    def base_name(self, path: Path) -> str:
        """What a PEFT adapter trained from it names as its base (trainer_state.json's BASE_KEY)."""
        ...


def source_of(path: Path, sources: Sequence[BaseModelSource]) -> BaseModelSource | None:
    """The source that claims `path`, or None (a meshformer checkpoint or run directory)."""
    return next((s for s in sources if s.claims(path)), None)
