"""A command's --device flag checked against the devices this machine has, so that `--device cuda` without CUDA or
`--device tpu` is one line naming what is available here instead of torch's error from deep in model loading."""

from __future__ import annotations

from meshformer.errors import UserError


def available_devices() -> list[str]:
    """The devices torch can run on here: cpu, then cuda:0 ... cuda:N-1, then mps where there is one."""
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return found


def device_from_flag(value: str | None, flag: str = "--device"):
    """The torch.device a --device value names (None: cuda when available, else cpu); anything this machine does
    not have (an unknown type, CUDA without a GPU, cuda:3 with two GPUs, an empty string) is a UserError."""
    import torch

    if value is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    here = available_devices()
    try:
        device = torch.device(value.strip())
    except (RuntimeError, ValueError):  # "tpu", "", "cuda:x"
        device = None
    if device is not None and (
        str(device) in {*here, "cpu:0"} or (device.index is None and f"{device.type}:0" in here)
    ):
        return device
    raise UserError(f"{flag} {value!r}: not a device of this machine: give one of {', '.join(here)}")
