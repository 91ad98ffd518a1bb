"""A checkpoint's manifest: every file with its size and SHA-256, written last, so "complete" is checkable.

A save writes its shards and small files into `step_N.tmp`, then `manifest.json` (through a temporary name and
an atomic replace), then renames the directory. A directory without a manifest, with a file missing, of the
wrong size or with other bytes than the manifest says, is not a checkpoint: resume skips it (saying why) and
`meshformer ckpt verify` names the bad file. Bit rot, a truncated copy or a half-finished rsync all show up here
instead of as a model that silently trains from damaged weights. A manifest is only as good as its writer, so the
shards are also checked for what they are (checkpoint/contents.py), and no entry may point outside the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from meshformer.checkpoint.contents import dcp_problem, outside, read_header

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

    full=False checks presence and sizes only (cheap: used when listing); full=True also every checksum. Both
    refuse an entry that leaves the directory (`../x`, an absolute path, a symlink out: never opened), a
    shard DCP would read that the manifest does not list, and a shard that is not what it claims to be
    (checkpoint/contents.py: its safetensors header, offsets and DCP shard map; no tensor data is read).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return f"{directory} {'is not a directory' if directory.exists() else 'does not exist'}"
    m = read_manifest(directory)
    if m is None:
        what = "malformed" if (directory / MANIFEST).exists() else "missing"
        return f"{MANIFEST} is {what} (an interrupted or foreign save)"
    for rel, info in m["files"].items():  # every entry first: a hostile one is refused before any file is read
        why = outside(directory, rel)
        if why is not None:
            return f"{MANIFEST} entry {why}"
        if not isinstance(info, dict):
            return f"{MANIFEST} entry {rel!r} has no size and checksum"
    for rel, info in m["files"].items():
        p = directory / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != info.get("bytes"):
            return f"{rel} has {size} bytes, the manifest says {info.get('bytes')} (truncated or replaced)"
        if full and file_sha256(p) != info.get("sha256"):
            return f"{rel} does not match its checksum (corrupted)"
    return content_problem(directory, set(m["files"]))


def content_problem(directory: Path, listed: set[str]) -> str | None:
    """Why the files of a checkpoint whose manifest holds are still not a checkpoint (a forged manifest, a shard
    dropped in beside the listed ones, no weights, no valid step), or None."""
    if not any(rel.startswith("model/") and rel.endswith(".safetensors") for rel in listed):
        return "model/ holds no weights (no .safetensors shard in the manifest)"
    why = trainer_state_problem(directory)
    if why is not None:
        return why
    for sub in ("model", "optim"):
        d = directory / sub
        if not d.is_dir():
            continue
        shards = sorted(p for p in d.iterdir() if p.name.endswith(".safetensors"))  # what DCP's reader takes
        foreign = [p for p in shards if p.relative_to(directory).as_posix() not in listed]
        if foreign:
            return f"{foreign[0].relative_to(directory).as_posix()} is not in the manifest (a foreign file)"
        why = dcp_problem(shards, directory)
        if why is not None:
            return why
    for rel in sorted(listed):
        if rel.endswith(".safetensors") and rel.split("/")[0] not in ("model", "optim"):
            got = read_header(directory / rel)
            if isinstance(got, str):
                return f"{rel} {got}"
    return None


def trainer_state_problem(directory: Path) -> str | None:
    """What is wrong with trainer_state.json (every save writes one: its step is where a resume starts), or None."""
    try:
        state = json.loads((directory / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        return f"trainer_state.json is missing or unreadable ({getattr(e, 'strerror', None) or e})"
    if not isinstance(state, dict):
        return f"trainer_state.json is not a JSON object (a {type(state).__name__})"
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"trainer_state.json has no valid step (got {step!r})"
    return None
