"""Training checkpoints: sharded DCP saves in safetensors form, written (`saver.py`), found, verified and loaded
(`store.py`, `manifest.py`, `contents.py`), inspected (`tools.py`). The formats users bring and take are
interop/'s."""

from meshformer.checkpoint.store import list_checkpoints, resolve_checkpoint

__all__ = ["list_checkpoints", "resolve_checkpoint"]
