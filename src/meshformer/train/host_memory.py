"""Keep the host memory a CPU training step frees inside the process, instead of page-faulting it back every step.

A step frees and re-allocates the same activation, gradient and logits buffers every time. glibc's malloc hands
large blocks back to the kernel: blocks above its mmap threshold are unmapped on free, and the heap's top is
trimmed once more than its trim threshold lies free there. The next step touches that memory again, and every
4 KiB page costs a fault and a zero-fill. On the benchmark model (bench/bench_vs_hf.py, bf16) that was 48,000-
75,000 faults a step; alternating the two settings step by step in one process: 0.842 s against 0.788 s (-6%),
fp32 2.369 against 2.332 s (docs/benchmarks.md).

What changes, and why no more:
- the heap's top is never trimmed (`M_TRIM_THRESHOLD` = SIZE_MAX: mallopt's int -1 becomes glibc's size_t), so
  freed memory stays resident and is reused. The heap stops shrinking between steps but grows no further than a
  step's peak needs (the benchmark model's peak RSS: 1.21-1.26 GB with and without);
- the mmap threshold is fixed at 32 MiB, glibc's own ceiling for it (its dynamic threshold climbs there once
  such blocks are freed): larger blocks come from the retained top when it has room, else they are mapped as
  before, never by growing the heap;
- `M_TOP_PAD` (256 MiB) grows the heap in larger steps, so a step's blocks above the threshold (its logits and
  their gradients) find room in the top instead of being mapped afresh; untouched pad costs no memory.
Mapping everything from the heap (`M_MMAP_MAX` = 0) also removed the faults, but it is not safe on glibc 2.36:
torch allocates with 64-byte `posix_memalign`, which asks for 96 bytes more than a freed block of the same size
holds, so a block freed behind a small live allocation is never reused and the heap grows every step (64 MiB blocks
freed behind 4 KiB ones: RSS 796 -> 3,996 MiB over 50 rounds; these settings stay flat, the test checks it).
This is what torch's CPU tuning guide gets from preloading jemalloc or tcmalloc, without another allocator or a
relaunch. C libraries other than glibc are left alone.
"""

from __future__ import annotations

import ctypes
import functools

# <malloc.h>
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit

RETAINED = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, -1), (M_TOP_PAD, 256 << 20))
# What a process that never tuned malloc runs with, near enough: glibc's dynamic mmap threshold climbs to the
# largest mapped block freed (at most 32 MiB), its trim threshold to twice that, and the pad stays 128 KiB. A
# benchmark sets it for the side that stands for such a process (bench/bench_vs_hf.py's Hugging Face side);
# switched in one process between steps, it gave 57,000-64,000 faults a bf16 step, untuned processes 48,000-75,000.
GLIBC_SETTLED = (
    (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
    (M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_MAX),
    (M_TOP_PAD, 128 << 10),
)


def glibc():
    """The process's C library when it is glibc, else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it; musl and macOS give mallopt other meanings
        return libc
    except (OSError, AttributeError):
        return None


def set_malloc(settings: tuple[tuple[int, int], ...]) -> bool:
    """Apply (mallopt parameter, value) pairs; False where the C library is not glibc or refused one."""
    libc = glibc()
    return libc is not None and all(libc.mallopt(param, value) == 1 for param, value in settings)


@functools.cache
def retain_freed_host_memory() -> bool:
    """Tune glibc's malloc for this process (once); False where the C library is not glibc or refused a setting."""
    return set_malloc(RETAINED)
