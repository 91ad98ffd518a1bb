#!/usr/bin/env bash
# The trainer's GPU paths in one short run (a lent GPU): compile auto (on), fused AdamW, expandable segments, the
# step-time breakdown, the profile window with CUDA activity and the allocator history, TensorBoard, the journal.
# Usage: OUT=dir bash bench/gpu_trainer_check.sh   (makes runs/demo_data from the shipped text when it is missing)
# The step-time breakdown reads CUDA events there (observe/timing.py): its phases should add up to the step time.
set -u
OUT=${OUT:-runs/gpu_trainer_check}
export PYTHONPATH=src PYTHONUNBUFFERED=1
if [ ! -d runs/demo_data ]; then
  python3 -m meshformer tokenizer train --input data/shakespeare/*.txt --vocab-size 2048 --output runs/demo_tokenizer \
    --overwrite >/dev/null && python3 -m meshformer preprocess --input data/shakespeare/*.txt \
    --tokenizer runs/demo_tokenizer --output runs/demo_data --overwrite >/dev/null || exit 1
fi
timeout 240 python3 -m meshformer train configs/demo_shakespeare.yaml --runner_config.stop_step 12 \
  --output_dir "$OUT/run" --model.model_config.compute_dtype bfloat16 --tensorboard.tensorboard_dir "$OUT/tb" \
  --profile 4:5 --monitor_config.progress_bar plain --do_eval false \
  --callbacks "[{type: MFLossMonitor, per_print_times: 4}, {type: CheckpointMonitor, save_checkpoint_steps: 100}]" \
  2>&1 | grep -v "^W1129\|^\s*$" | tail -40
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
recs = [json.loads(l) for l in (out / "run" / "metrics.jsonl").read_text().splitlines()]
for r in recs:
    parts = sum(r[k] for k in ("time_data_s", "time_fwd_bwd_s", "time_optim_s", "time_other_s"))
    print(r["step"], "step %.4f s parts %.4f fwd_bwd %.4f optim %.4f data %.5f other %.5f comm %s peak %.2f MiB" % (
        r["step_time_s"], parts, r["time_fwd_bwd_s"], r["time_optim_s"], r["time_data_s"], r["time_other_s"],
        r.get("time_comm_s"), r["peak_mem_bytes"] / 2**20))
print("profile:", sorted(p.name for p in (out / "run" / "profile").iterdir()))
print("tensorboard files:", [p.name for p in (out / "tb").iterdir()])
print("journal:", (out / "journal.jsonl").read_text()[:300])
PY
