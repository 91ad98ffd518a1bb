export PYTHONPATH=src PYTHONUNBUFFERED=1
B="python3 bench/gpu_train.py --json $OUT/gpu_train.jsonl --warmup 2 --steps 4"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 120 $B --preset 1b --seq 2048 --batch 4 --modes none,full,selective 2>&1 | grep -v '^{' | sed 's/| 1b |/| 1b explicit-expandable |/'
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 90 $B --preset 8b --layers 8 --seq 8192 --batch 2 --modes selective 2>&1 | grep -v '^{' | sed 's/| 8b |/| 8b explicit-expandable |/'
timeout 60 $B --preset 1b --seq 2048 --batch 4 --modes full 2>&1 | grep -v '^{' | sed 's/| 1b |/| 1b default |/'
