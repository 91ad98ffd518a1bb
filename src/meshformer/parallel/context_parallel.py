"""Context parallelism: every row's sequence split over the "cp" ranks, attention by all-gathered keys and values.

Load balance: a row of S tokens is cut into 2·cp chunks and cp rank r holds chunks r and 2·cp−1−r (Megatron's and
Llama 3's layout). Under a causal mask the queries of chunk i attend to i + 1 chunks of keys, so every rank's pair
costs (r + 1) + (2·cp − r) = 2·cp + 1 chunk-pairs: the same on each.

Attention (the Llama 3 form, `colossalai_cp` in MindSpore's names): each layer all-gathers K and V over the cp
group (an autograd all-gather: its backward reduce-scatters their gradients back) and attends from the local
queries with an explicit mask: a key may be seen when its global position is at most the query's, within the
attention's sliding window when it has one (the window is of global positions, so it reaches across chunks and
ranks) and, for packed rows, when both lie in the same document; learned sinks join the softmax as on one
process. The gathered keys stay in the ranks' order (the mask names their global positions), so no reordering copy
is made; the attention call is checkpointed and builds its [local x seq] mask from
the position vectors (`KeyLayout`), so no quadratic tensor outlives a layer. It runs on any device and backend
(gloo included), where torch's `context_parallel` ring attention has no rule for the CPU attention kernel; the ring
(GPU flash/efficient SDPA, no document masks) is not wired yet, and `note` says which path runs and why.
Which attention modules take part, and through which of their attributes, is their family's to say
(`ModelFamily.cp_attention`): the model's files hold no parallel code, only the seams cp fills. Latent attention
(DeepSeek-V2/V3) gathers what it caches instead of K and V: each token's compressed latent and rotary key (576
numbers for DeepSeek-V3, against 128 heads x (192 + 128) expanded), through its `gather` seam, and every rank
expands the whole row's keys and values before the same masked attention (`attend_gathered`); the rotary key is
rotated at its global position before the gather.

Everything else follows the sequence from outside the model: the step hands the model and the loss this rank's
tokens and labels (`local_sequence`, train/step.py), so the token count and the loss reduce over "loss"
(dp x cp) as they do over dp; rotary positions and the mask are the global ones of the local tokens (a pre-hook on
each part's root, a pipeline stage's too, computes them from the whole row's documents and passes the model's
explicit `positions` / `mask`);
FSDP shards over "fsdp" (dp_shard x cp) and averages gradients over dp x cp (parallel/data_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from meshformer.errors import UserError
from meshformer.models.attention import document_positions, sdpa, window_band
from meshformer.parallel.env import ParallelEnv


def chunk_positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens cp rank `rank` holds: chunks rank and 2·cp−1−rank of 2·cp equal chunks."""
    if seq % (2 * cp):
        raise UserError(
            f"a row of {seq} tokens does not split into 2 x context_parallel = {2 * cp} equal chunks: make "
            f"model.model_config.seq_length a multiple of {2 * cp}, or choose another parallel_config.context_parallel"
        )
    size = seq // (2 * cp)
    first, second = rank * size, (2 * cp - 1 - rank) * size
    return torch.cat([torch.arange(first, first + size), torch.arange(second, second + size)])


def allowed(
    queries: torch.Tensor,
    keys: torch.Tensor,
    q_docs: torch.Tensor | None = None,
    k_docs: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Mask [b or 1, 1, q, k], True where the query at global position queries[i] may see the key at keys[j]: at or
    before it, within its sliding window if the attention has one (`window_band` of the global positions, so the
    window spans the cp chunks) and, for packed rows (the queries' and keys' documents [b, q] and [b, k]), in the
    same document."""
    causal = window_band(queries, keys, window)
    if q_docs is None:
        return causal[None, None]  # one row's mask, broadcast over the batch
    return ((q_docs[:, :, None] == k_docs[:, None, :]) & causal)[:, None]


@dataclass(frozen=True)
class KeyLayout:
    """What the mask of one forward is made of, kept instead of the [local x seq] mask itself (quadratic in the
    sequence): the local queries' and the gathered keys' global positions and, for packed rows, documents."""

    queries: torch.Tensor
    keys: torch.Tensor
    q_docs: torch.Tensor | None = None
    k_docs: torch.Tensor | None = None


def key_layout(
    queries: torch.Tensor, keys: torch.Tensor, documents: torch.Tensor | None
) -> tuple[torch.Tensor, KeyLayout]:
    """(rotary positions [b or 1, q], KeyLayout) of the tokens at global positions `queries` attending to the keys at
    global positions `keys`; `documents` [b, seq]: the whole rows' (packed), positions restarting at each document
    (models/attention.py document_positions)."""
    if documents is None:
        return queries[None], KeyLayout(queries, keys)
    q_docs, k_docs = documents.index_select(1, queries), documents.index_select(1, keys)
    return document_positions(documents).index_select(1, queries), KeyLayout(queries, keys, q_docs, k_docs)


def cp_layout(
    queries: torch.Tensor, keys: torch.Tensor, documents: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary positions, the dense mask [b or 1, 1, q, k]) of `key_layout`: what one rank's attention applies."""
    positions, lay = key_layout(queries, keys, documents)
    return positions, allowed(lay.queries, lay.keys, lay.q_docs, lay.k_docs)


def masked_attention(q, k, v, queries, keys, q_docs, k_docs, scale, window=None, sinks=None):
    """SDPA of the local queries against the gathered keys under `allowed` (the attention's sliding window and sink
    logits included), as the 0 / -inf float mask its kernels take. Run under a checkpoint: the mask (local x seq, the
    only quadratic tensor) and SDPA's own saved state are made again in backward, so a layer keeps q, the gathered k
    and v and the small position vectors."""
    mask = allowed(queries, keys, q_docs, k_docs, window)
    additive = torch.where(mask, torch.zeros((), dtype=q.dtype, device=q.device), torch.finfo(q.dtype).min)
    return sdpa(q, k, v, additive, scale, sinks=sinks)


class ContextParallel:
    """One run's sequence split: which positions this rank holds, the global layout of its tokens, and attention."""

    def __init__(self, env: ParallelEnv):
        self.cp, self.rank = env.dims.cp, env.coords["cp"]
        self.group = env.group("cp")
        self.device = env.device
        self.note = (
            f"context parallel: cp={self.cp}, all-gather K/V attention (latent attention: its latents; SDPA under "
            f"the global causal/document mask, made per layer); "
            f"torch's ring attention is not wired: it has no CPU kernel rule and cannot apply document masks"
        )

    def positions(self, seq: int) -> torch.Tensor:
        """This rank's global positions in a row of `seq` tokens."""
        return chunk_positions(seq, self.cp, self.rank).to(self.device)

    def gathered_positions(self, seq: int) -> torch.Tensor:
        """Global positions of the keys after the all-gather: every rank's positions, in rank order."""
        return torch.cat([chunk_positions(seq, self.cp, r) for r in range(self.cp)]).to(self.device)

    def layout(self, local_len: int, documents: torch.Tensor | None) -> tuple[torch.Tensor, KeyLayout]:
        """`key_layout` of this rank's tokens in rows of local_len x cp tokens."""
        seq = local_len * self.cp
        if documents is not None and documents.shape[1] != seq:
            raise ValueError(f"documents cover {documents.shape[1]} positions, the cp ranks' rows {seq}")
        return key_layout(self.positions(seq), self.gathered_positions(seq), documents)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """`t` [b, heads, local, d] of every cp rank along the sequence, in rank order (an autograd all-gather: its
        backward reduce-scatters the gradient back to each rank's part)."""
        from meshformer.backends.torch_private import all_gather_autograd

        return all_gather_autograd(t.contiguous(), 2, self.group)

    def attend(self, q, k, v, mask=None, scale=None, window: int | None = None, sinks=None) -> torch.Tensor:
        """Local queries [b, h, local, d] against every rank's keys and values (gathered along the sequence);
        `mask`: the root's KeyLayout; `window` and `sinks`: the attention's own (`Attention.attend_options`)."""
        return self.attend_gathered(q, self.gather(k), self.gather(v), mask, scale, window, sinks)

    def attend_gathered(self, q, k, v, mask=None, scale=None, window: int | None = None, sinks=None):
        """Local queries [b, h, local, d] against keys and values already gathered from every rank (latent attention
        gathers its latents and expands them itself); `mask`: the root's KeyLayout; a sliding `window` bands the
        global positions (a query's window reaches into other ranks' chunks), `sinks` [heads] join the softmax. The
        checkpoint keeps q, k and v: contiguous ones, so that a view (latent attention's values, of kv_b_proj's output
        with the keys' part too) does not keep a wider tensor alive."""
        if not isinstance(mask, KeyLayout):
            raise RuntimeError("context-parallel attention needs the root's KeyLayout (apply_context_parallel's hook)")
        lay, k, v = mask, k.contiguous(), v.contiguous()
        return torch.utils.checkpoint.checkpoint(
            masked_attention,
            *(q, k, v, lay.queries, lay.keys, lay.q_docs, lay.k_docs, scale, window, sinks),
            use_reentrant=False,
        )

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        """The root's forward gets this rank's tokens; it is given their global positions and mask (from the whole
        row's `documents`, which the step passes unsplit) instead of the documents."""
        if kwargs.get("cache") is not None or len(args) > 1:
            raise RuntimeError("context parallelism trains and evaluates whole rows: no KV cache")
        documents = kwargs.pop("documents", None)
        if kwargs.get("positions") is None:
            kwargs["positions"], kwargs["mask"] = self.layout(args[0].shape[1], documents)
        return args, kwargs


def apply_context_parallel(model: nn.Module, env: ParallelEnv) -> str | None:
    """Install context parallelism on one model part (the whole model, or a pipeline stage's piece): every attention
    block attends through keys and values gathered from the cp ranks, as its family's `cp_attention` says which of
    the block's attributes take which of cp's functions (grouped-query attention: `attend`; latent attention gathers
    its latents, expanded after), and the part's root computes the global layout of its tokens (its input's
    sequence length is the local one). Returns which path runs."""
    if env.dims.cp == 1:
        return None
    from meshformer.models.registry import family_of

    cp = ContextParallel(env)
    family = family_of(model.config)
    slots = [(m, s) for m in model.modules() for cls, s in family.cp_attention.items() if isinstance(m, cls)]
    if not slots:
        raise UserError(
            f"parallel_config.context_parallel={cp.cp}: {type(model).__name__} has no attention the "
            f"{family.name} family lets context parallelism split: set context_parallel: 1"
        )
    for block, names in slots:
        for attribute, offered in names.items():
            if offered not in CP_FUNCTIONS:
                raise ValueError(f"family {family.name!r}: cp_attention names {offered!r}, not one of {CP_FUNCTIONS}")
            setattr(block, attribute, getattr(cp, offered))
    model.register_forward_pre_hook(cp.pre_hook, with_kwargs=True)
    return cp.note


# The ContextParallel methods a family's `cp_attention` may install on its attention (models/registry.py).
CP_FUNCTIONS = ("attend", "gather", "attend_gathered")


def local_sequence(env: ParallelEnv, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This cp rank's tokens of each [batch, seq] tensor (inputs, labels); unchanged without context parallelism."""
    if env.dims.cp == 1:
        return rows
    cp, rank = env.dims.cp, env.coords["cp"]
    return tuple(t.index_select(1, chunk_positions(t.shape[1], cp, rank).to(t.device)) for t in rows)
