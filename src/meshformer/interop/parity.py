"""`--verify`: the same tokens through meshformer and `transformers`, compared logit by logit.

Reports the largest absolute logit difference over a fixed English paragraph and the perplexity each model gives
it; a difference above the tolerance fails the command with exit 1. The tolerance (meshformer/tolerance.py, which
the commands' --help quotes) is TOLERANCE in fp32, or RELATIVE_TOLERANCE of the largest logit when that is
larger: in a deep model fp32 rounding alone moves large logits by more than 1e-4 (SmolLM2-135M, 30 layers,
logits up to 30: transformers' own sdpa and eager attention differ by 6e-5, meshformer and transformers by 1.1e-4,
perplexities equal to 4 digits).

The largest logit is not the scale of that rounding, though: it grows with depth and with the size of the
activations, which a logit can hide by cancellation. On deep models with spread-out weights (tiny random
DeepSeek-V2/V3 models: latent attention, MoE) the fixed rule refuses correct conversions, and transformers' own
eager and sdpa attention differ from each other by about as much: transformers would fail the rule against itself.
The difference is rounding, not the conversion (it shrinks in fp64). So where the fixed rule is exceeded, the
reference runs once more with its other attention implementation, and REFERENCE_NOISE_FACTOR times its own
difference is the tolerance when larger (4: a margin over the largest ratio between the two differences seen;
docs/benchmarks.md, "Figures behind the code's constants"). A wrong conversion (a swapped tensor, a wrong rotary
layout) moves logits by 1e-2 and more, far beyond either.
`transformers` is an optional extra: without it the check says so and is skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from meshformer.errors import RunFailed
from meshformer.tolerance import REFERENCE_NOISE_FACTOR, RELATIVE_TOLERANCE, TOLERANCE

# A fixed, plain paragraph (public domain: the opening of Jane Austen's "Pride and Prejudice").
PARAGRAPH = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters."
)


@dataclass
class Parity:
    max_abs_diff: float
    max_abs_logit: float
    ppl_meshformer: float
    ppl_transformers: float
    tokens: int
    reference_noise: float = 0.0  # transformers' eager vs sdpa logits (measured only above the fixed rule)

    @property
    def tolerance(self) -> float:
        fixed = max(TOLERANCE, RELATIVE_TOLERANCE * self.max_abs_logit)
        return max(fixed, REFERENCE_NOISE_FACTOR * self.reference_noise)

    def describe(self) -> str:
        noise = (
            f", {REFERENCE_NOISE_FACTOR:g} x transformers' own eager-vs-sdpa difference {self.reference_noise:.2e}"
            if self.reference_noise
            else ""
        )
        return (
            f"parity with transformers on {self.tokens} tokens: max |logit difference| {self.max_abs_diff:.2e} "
            f"(tolerance {self.tolerance:.2g}{noise}); perplexity meshformer {self.ppl_meshformer:.4f}, "
            f"transformers {self.ppl_transformers:.4f}"
        )


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return math.exp(F.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).item())


def load_transformers(hf_dir: Path, gguf_file: str | None = None):
    """The transformers model of a Hugging Face directory (or a GGUF file in it) in fp32, or None without it."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per call is noise in a command's output
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, **kw).eval()


@torch.no_grad()
def compare(model, reference, tokenizer, max_tokens: int = 256) -> Parity:
    """Logits of `model` and `reference` on PARAGRAPH; without a tokenizer (a run trained on pre-tokenized data),
    on `max_tokens` ids drawn with a fixed seed: the weights are compared just as well."""
    if tokenizer is not None:
        ids = torch.tensor([tokenizer.encode(PARAGRAPH).ids[:max_tokens]])
    else:
        vocab = reference.config.vocab_size
        ids = torch.randint(vocab, (1, max_tokens), generator=torch.Generator().manual_seed(0))
    ours = model(ids).float()
    theirs = reference(ids).logits.float()
    diff, scale = float((ours - theirs).abs().max()), float(theirs.abs().max())
    result = Parity(diff, scale, perplexity(ours, ids), perplexity(theirs, ids), ids.shape[1])
    if not diff <= result.tolerance:  # only then is transformers' own rounding worth a second forward
        result.reference_noise = reference_noise(reference, ids, theirs)
    return result


def reference_noise(reference, ids: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |logit difference| between `theirs` and the reference's logits with its other attention implementation
    (eager <-> sdpa): the fp32 rounding of the model itself on these tokens; 0 where it has no other."""
    current = getattr(reference.config, "_attn_implementation", None)
    other = {"sdpa": "eager", "eager": "sdpa"}.get(current)
    if other is None or not hasattr(reference, "set_attn_implementation"):
        return 0.0
    try:
        reference.set_attn_implementation(other)
    except (ValueError, ImportError):  # a model without that implementation
        return 0.0
    try:
        return float((reference(ids).logits.float() - theirs).abs().max())
    finally:
        reference.set_attn_implementation(current)


def verify(model, tokenizer, hf_dir: Path, gguf_file: str | None = None, log=print) -> Parity | None:
    """Compare and report; raise RunFailed (exit 1) above the tolerance. None when transformers is missing."""
    reference = load_transformers(hf_dir, gguf_file)
    if reference is None:
        log("--verify skipped: transformers is not installed (pip install transformers)")
        return None
    result = compare(model, reference, tokenizer)
    log(result.describe())
    if not result.max_abs_diff <= result.tolerance:
        raise RunFailed(
            f"the converted model differs from transformers' by {result.max_abs_diff:.2e} in the logits "
            f"(tolerance {result.tolerance:.2g}): the conversion is wrong; please report it with the model's "
            f"config.json"
        )
    return result
