"""The formats users bring and take: Hugging Face directories, GGUF files and MindSpore checkpoints imported and
exported (`convert.py`), `--verify` against transformers (`parity.py`), a checkpoint loaded into one process for
generate and eval (`inference.py`), `ckpt merge` (`merge.py`), and a Hugging Face directory as a run's
`load_checkpoint` (`base_model.py`: handed to the trainer, which imports nothing of this package)."""

from __future__ import annotations

__all__ = ["load_for_inference"]


def __getattr__(name: str):
    """`load_for_inference` on first use: importing a light module here (base_model.py) does not load torch."""
    if name == "load_for_inference":
        from meshformer.interop.inference import load_for_inference

        return load_for_inference
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
