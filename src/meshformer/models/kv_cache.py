"""The KV cache of incremental decoding, with ring buffers for sliding-window layers (any family's attention with
the `update` / `key_positions` protocol below; latent attention keeps its own, models/deepseek/mla.py)."""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys/values for incremental decoding; one per model, one slot per layer.

    A layer with a sliding window shorter than max_len (`windows[layer]`) keeps only its last `window` keys and
    values, in a ring buffer (slot p % window holds position p): decoding past the window takes O(window) memory
    there. `update` returns the keys kept (in slot order) followed by the new ones, `key_positions` their positions,
    from which the attention makes its mask."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv: int,
        max_len: int,
        hd: int,
        dtype: torch.dtype,
        device,
        windows: list[int | None] | None = None,
    ):
        windows = windows or [None] * n_layers
        self.max_len = max_len  # tokens the cache may hold in all (`document_layout` sizes its per-token records)
        self.ring = [w if w is not None and w < max_len else None for w in windows]  # ring size, None: full
        sizes = [max_len if w is None else w for w in self.ring]
        self.k = [torch.zeros(batch, n_kv, size, hd, dtype=dtype, device=device) for size in sizes]
        self.v = [torch.zeros(batch, n_kv, size, hd, dtype=dtype, device=device) for size in sizes]
        self.pos = 0  # tokens already stored
        # Per-row document index and rotary position of every stored token, kept once documents are used
        # (a left-padded batch of prompts): later tokens continue each row's last document.
        self.documents: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def update(self, idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer idx's new keys and values [b, kv, new, hd]; the keys and values they attend over."""
        size = self.ring[idx]
        if size is None:
            end = self.pos + k.shape[2]
            self.k[idx][:, :, self.pos : end] = k
            self.v[idx][:, :, self.pos : end] = v
            return self.k[idx][:, :, :end], self.v[idx][:, :, :end]
        kept = min(self.pos, size)  # the new tokens may see these: copied before the ring overwrites them
        keys = torch.cat([self.k[idx][:, :, :kept], k], 2) if kept else k
        values = torch.cat([self.v[idx][:, :, :kept], v], 2) if kept else v
        slots = torch.arange(self.pos, self.pos + k.shape[2], device=k.device)[-size:] % size
        self.k[idx][:, :, slots] = k[:, :, -size:]
        self.v[idx][:, :, slots] = v[:, :, -size:]
        return keys, values

    def key_positions(self, idx: int, new: int, device) -> torch.Tensor:
        """Positions [keys] of what `update` returns for `new` tokens at self.pos: slot j of a full ring holds the
        latest position p < pos with p % size == j."""
        size = self.ring[idx]
        if size is None:
            return torch.arange(self.pos + new, device=device)
        slots = torch.arange(min(self.pos, size), device=device)
        kept = self.pos - 1 - (self.pos - 1 - slots) % size
        return torch.cat([kept, torch.arange(self.pos, self.pos + new, device=device)])
