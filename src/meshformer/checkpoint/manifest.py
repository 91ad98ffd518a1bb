"""A checkpoint's manifest: every file with its size and SHA-256, written last, so "complete" is checkable.

A save writes its shards and small files into `step_N.tmp`, then `manifest.json` (through a temporary name and
an atomic replace), then renames the directory. A directory without a manifest, with a file missing, of the
wrong size or with other bytes than the manifest says, is not a checkpoint: resume skips it (saying why) and
`meshformer ckpt verify` names the bad file. Bit rot, a truncated copy or a half-finished rsync all show up here
instead of as a model that silently trains from damaged weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = "meshformer-checkpoint-v1"
_CHUNK = 8 << 20


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path) -> dict:
    """Hash every file under `directory` (but the manifest) and write the manifest atomically; returns it."""
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(MANIFEST + "."):
            files[p.relative_to(directory).as_posix()] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
    manifest = {"format": FORMAT, "files": files}
    tmp = directory / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    return manifest


def read_manifest(directory: Path) -> dict | None:
    try:
        m = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("files"), dict):
        return None
    return m


def verify(directory: Path, full: bool = True) -> str | None:
    """None when the checkpoint is complete and intact, else the reason (naming the file) it is not.

    full=False checks presence and sizes only (cheap: used when listing); full=True also every checksum.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return f"{directory} is not a directory"
    m = read_manifest(directory)
    if m is None:
        what = "malformed" if (directory / MANIFEST).exists() else "missing"
        return f"{MANIFEST} is {what} (an interrupted or foreign save)"
    for rel, info in m["files"].items():
        p = directory / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != info.get("bytes"):
            return f"{rel} has {size} bytes, the manifest says {info.get('bytes')} (truncated or replaced)"
        if full and file_sha256(p) != info.get("sha256"):
            return f"{rel} does not match its checksum (corrupted)"
    return None
