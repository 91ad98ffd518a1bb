#!/usr/bin/env bash
# The GPU checks a lent one-GPU machine runs in one call (docs/benchmarks.md records what they printed):
# the GPU-only tests, the bf16 matmul ceiling, then bench/gpu_train.py on Llama 3.2 1B and Llama 3.1 8B shapes.
# Usage: OUT=dir bash bench/gpu_check.sh   (python3 with torch; PY overrides it)
set -u
PY=${PY:-python3}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
J="$OUT/gpu_train.jsonl"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
timeout 120 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/unit/test_swap.py 2>&1 | tail -5
[ "${MATMUL:-1}" = 1 ] && timeout 60 $PY - <<'EOF'
import torch
a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(3):
    a @ b
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(20):
    a @ b
e.record(); torch.cuda.synchronize()
print(f"bf16 8192^3 matmul: {2 * 8192**3 * 20 / (s.elapsed_time(e) / 1e3) / 1e12:.0f} TFLOP/s")
EOF
$PY - <<'EOF'
import torch, time
x = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)  # 512 MiB
h = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
for name, dst, src in (("device->host", h, x), ("host->device", x, h)):
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    print(f"pinned {name}: {5 * x.numel() * 2 / (time.perf_counter() - t) / 1e9:.1f} GB/s")
EOF
B="$PY bench/gpu_train.py --json $J --warmup 2 --steps 5"
# meshformer sets expandable_segments:True; this first run without it gives the ratio on one machine
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False timeout 100 $B --preset 1b --seq 2048 --batch 4 --modes none,full \
  2>&1 | grep -v '^{' | sed 's/| none |/| none fixed-segments |/;s/| full |/| full fixed-segments |/'
timeout 240 $B --preset 1b --seq 2048 --batch 4 --modes none,full,selective,swap,compiled_selective 2>&1 | grep -v '^{'
timeout 120 $B --preset 8b --layers 8 --seq 8192 --batch 2 --modes selective,compiled_selective 2>&1 | grep -v '^{'
exit 0
