"""Activation swap: what decoder layers save for backward goes to pinned host memory during forward and comes
back, a few layers ahead, during backward (MindSpore Transformers' `swap_config`, a fourth memory lever beside
micro batch, recompute and parallel degrees; GPU runs).

Each swapped layer's forward runs under autograd's saved-tensor hooks. A saved tensor that is an activation
(it has an autograd history, directly or through the tensor it views) of at least `MIN_BYTES` is copied to a
pinned host buffer on a side stream; the device copy is released as soon as that copy finishes (record_stream
keeps the allocator from reusing it earlier). Weights, their views and buffers stay where they are: they are
resident anyway. In backward, the first tensor unpacked from a layer's forward starts bringing back the tensors
of the `prefetch` layers that ran before it, on a second stream, so their copies overlap this layer's backward;
a tensor not prefetched in time is copied on demand. A CPU run has nothing to offload: the hooks pass tensors
through untouched.

`apply_swap` installs it with forward pre/post hooks rather than a wrapper module, so parameter names, recompute
and FSDP wrappers are unchanged. A fully recomputed layer saves nothing through these hooks (the checkpoint keeps
its input itself), so swap is refused there (config/validate.py); selective recompute's kept matmul outputs are
the checkpoint's too, so with both only the rest of what the layer saves moves.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from meshformer.backends.torch_private import is_checkpoint_wrapped, view_base
from meshformer.errors import UserError

MIN_BYTES = 1 << 20  # smaller tensors are not worth a copy


class _Swapped:
    """One saved tensor living in host memory (and, once prefetched, again on the device)."""

    __slots__ = ("host", "device", "offloaded", "back", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, offloaded):
        self.host, self.device, self.offloaded = host, device, offloaded
        self.back: torch.Tensor | None = None
        self.ready = None


class _Group:
    """The swapped tensors of one forward call of one layer (one micro-batch)."""

    __slots__ = ("seq", "items", "fetched", "__weakref__")

    def __init__(self, seq: int):
        self.seq, self.items, self.fetched = seq, [], False


class ActivationSwap:
    """Offload/prefetch state shared by the swapped layers of one model part."""

    def __init__(self, prefetch: int = 1, min_bytes: int = MIN_BYTES):
        self.prefetch, self.min_bytes = prefetch, min_bytes
        self._groups: list[weakref.ref] = []  # in forward order
        self._seq = 0
        self._streams = None
        self.offloaded_bytes = 0  # total bytes sent to the host (for measurement)

    def _side_streams(self, device: torch.device):
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams

    def new_group(self) -> _Group:
        self._seq += 1
        g = _Group(self._seq)
        self._groups = [r for r in self._groups if r() is not None] + [weakref.ref(g)]
        return g

    def pack(self, group: _Group, t: torch.Tensor):
        base = view_base(t)
        if t.device.type != "cuda" or base.grad_fn is None or t.numel() * t.element_size() < self.min_bytes:
            return t
        d2h, _ = self._side_streams(t.device)
        d2h.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(d2h):
            host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(d2h)
        t.record_stream(d2h)  # the device copy may be freed once autograd drops it, not reused before the copy
        item = _Swapped(host, t.device, done)
        group.items.append(item)
        self.offloaded_bytes += host.numel() * host.element_size()
        return (group, item)

    def unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        group, item = packed
        if not group.fetched:
            group.fetched = True
            self._prefetch_before(group)
        stream = torch.cuda.current_stream(item.device)
        if item.back is not None:
            stream.wait_event(item.ready)
            out, item.back = item.back, None
            return out
        stream.wait_event(item.offloaded)
        return item.host.to(item.device, non_blocking=True)

    def _prefetch_before(self, group: _Group) -> None:
        """Start bringing back the groups of the `prefetch` forward calls that ran just before `group`."""
        earlier = [g for r in self._groups if (g := r()) is not None and g.seq < group.seq and not g.fetched]
        for g in earlier[-self.prefetch :]:
            g.fetched = True
            if not g.items:
                continue
            compute = torch.cuda.current_stream(g.items[0].device)
            _, h2d = self._side_streams(g.items[0].device)
            # Allocated from the compute stream's pool (a side stream's blocks could not be reused by compute and
            # would grow reserved memory), filled on the side stream once compute is done with that memory.
            backs = [torch.empty(item.host.size(), dtype=item.host.dtype, device=item.device) for item in g.items]
            h2d.wait_stream(compute)
            with torch.cuda.stream(h2d):
                for item, back in zip(g.items, backs):
                    h2d.wait_event(item.offloaded)
                    back.copy_(item.host, non_blocking=True)
                    back.record_stream(h2d)
                    item.back, item.ready = back, torch.cuda.Event()
                    item.ready.record(h2d)

    def install(self, layer: nn.Module) -> None:
        """Run `layer`'s forward under the swap hooks (pre/post forward hooks; the module is unchanged)."""
        state = {}

        def pre(module, args):
            group = self.new_group()
            ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(group, t), self.unpack)
            ctx.__enter__()
            state.setdefault("stack", []).append(ctx)

        def post(module, args, output):
            state["stack"].pop().__exit__(None, None, None)

        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post, always_call=True)


def swapped_layers(swap_config, layer_ids: list[int]) -> tuple[set[int], int]:
    """(global indices of the layers among `layer_ids` that swap, layers prefetched ahead) of `swap_config`."""
    sc = swap_config
    if not sc.swap:
        return set(), sc.default_prefetch
    if not sc.layer_swap:
        return set(layer_ids), sc.default_prefetch
    chosen, prefetch = set(), sc.default_prefetch
    for entry in sc.layer_swap:
        layers = entry.get("layers", True)
        ids = set(layer_ids) if layers is True else {int(i) for i in (layers or [])} & set(layer_ids)
        if ids:
            prefetch = max(prefetch, int(entry.get("backward_prefetch", sc.default_prefetch)))
        chosen |= ids
    return chosen, prefetch


def apply_swap(model: nn.Module, swap_config) -> int:
    """Install activation swap on this part's chosen decoder layers; returns how many swap."""
    layers = model.layers
    chosen, prefetch = swapped_layers(swap_config, [int(k) for k in layers.keys()])
    if not chosen:
        return 0
    swap = ActivationSwap(prefetch)
    for key in layers.keys():
        if int(key) in chosen:
            if is_checkpoint_wrapped(layers[key]):
                raise UserError(
                    f"swap_config: layer {key} is also recomputed (recompute_config), and a recomputed layer saves "
                    "nothing its checkpoint does not keep itself: swap other layers (layer_swap) or recompute fewer"
                )
            swap.install(layers[key])
    model.activation_swap = swap
    return len(chosen)
