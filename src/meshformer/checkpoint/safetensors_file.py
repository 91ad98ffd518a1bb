"""Every safetensors file meshformer writes (outside DCP's checkpoint shards) goes through `save_safetensors`.

safetensors 0.8's `save_file` creates its file with mode 0600 whatever the umask, so an export meant for others
(a Hugging Face directory, `ckpt merge`, MindSpore's safetensors form) was unreadable to them while the `.ckpt`,
`.gguf` and JSON files beside it were 0644. Here the file gets the mode any other new file gets: 0666 less the
umask.
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """This process's umask, read without changing it (Linux's /proc: setting it, even back at once, would race
    with threads creating files meanwhile); elsewhere by setting and restoring it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors.torch.save_file, then the file's mode as the umask gives any new file (0644 under 022)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())
