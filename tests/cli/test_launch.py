"""Launching: layout errors in one line before any process group, torchrun with the wrong process count or a bad
layout, selfcheck, the pipeline split's names, the real `meshformer train` under torchrun against the single
process, and a dead rank named fast."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DIST, FP32_RTOL, ROOT, TORCHRUN, rel, torchrun_env

sys.path.insert(0, str(DIST))
import harness  # noqa: E402

# ---- layout errors: one line, before any process group work -------------------------------------------------


def test_bad_products_list_valid_alternatives():
    from meshformer.errors import UserError
    from meshformer.parallel import init_parallel

    cfg = harness.make_cfg({"parallel_config.data_parallel": 2, "parallel_config.model_parallel": 2})
    with pytest.raises(UserError, match=r"2x2x1 = 4 but 8 processes.*dp8xmp1xpp1") as e:
        init_parallel(cfg, world_size=8)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="model_parallel=3.*valid model_parallel degrees"):
        harness.make_cfg({"parallel_config.model_parallel": 3})


def test_tied_embeddings_with_pipeline_is_rejected_before_process_group():
    import torch.distributed as dist

    from meshformer.errors import UserError
    from meshformer.parallel import init_parallel

    cfg = harness.make_cfg(
        {
            "model.model_config.tie_word_embeddings": True,
            "parallel_config.pipeline_stage": 2,
            "parallel_config.micro_batch_num": 2,
        }
    )
    with pytest.raises(UserError, match="tie_word_embeddings.*pipeline_stage=2.*tie_word_embeddings: false"):
        init_parallel(cfg, world_size=2)
    assert not dist.is_initialized()


def test_launch_rejects_wrong_process_count_without_starting(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("parallel_config:\n  data_parallel: 2\n  model_parallel: 2\n")
    t = time.time()
    p = subprocess.run(
        [sys.executable, "-m", "meshformer", "launch", "--nproc", "2", str(cfg)],
        capture_output=True,
        text=True,
        env=torchrun_env(),
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "but 2 processes were started" in lines[0] and "dp2xmp1xpp1" in lines[0], p.stderr
    assert time.time() - t < 60
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshformer",
            "launch",
            "--nproc",
            "4",
            "--print-command",
            str(cfg),
            "--runner_config.stop_step",
            "3",
        ],
        capture_output=True,
        text=True,
        env=torchrun_env(),
        timeout=120,
    )
    assert p.returncode == 0 and "torch.distributed.run --nproc-per-node 4 --standalone -m meshformer train" in p.stdout


def test_torchrun_with_bad_layout_exits_2_on_every_rank(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("parallel_config:\n  data_parallel: 4\n")
    p = subprocess.run(
        # the agent checks its workers every 3 s: the first rank's exit must not kill the second before it
        # reaches the same check (a busy machine once made that race)
        [
            *TORCHRUN,
            "--standalone",
            "--monitor-interval",
            "3",
            "--nproc-per-node",
            "2",
            "-m",
            "meshformer",
            "train",
            str(cfg),
        ],
        capture_output=True,
        text=True,
        env=torchrun_env(),
        timeout=180,
        cwd=tmp_path,
    )
    assert p.returncode != 0
    # Only init_parallel knows the world size: it must fail there, before creating the process group.
    assert (
        p.stderr.count(
            "meshformer: error: parallel_config: data_parallel x model_parallel x pipeline_stage "
            "= 4x1x1 = 4 but 2 processes were started"
        )
        == 2
    ), p.stderr[-3000:]


# ---- selfcheck -----------------------------------------------------------------------------------------------


def test_selfcheck_reports_ranks_mesh_and_collectives(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "parallel_config:\n  data_parallel: 1\n  pipeline_stage: 2\n  micro_batch_num: 2\n"
        "model:\n  model_config:\n    num_layers: 2\n    hidden_size: 64\n    num_heads: 4\n"
    )
    p = subprocess.run(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "meshformer",
            "selfcheck",
            str(cfg),
            "--timeout",
            "30",
        ],
        capture_output=True,
        text=True,
        env=torchrun_env(),
        timeout=180,
    )
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    for r in range(2):
        assert f"[rank {r}] selfcheck passed" in p.stdout
        assert f"rank {r}/2 backend=gloo" in p.stdout and f"pp={r} dp=0 tp=0" in p.stdout
    for check in ("all_reduce: ok sum=3", "all_gather: ok ranks=[0, 1]", "send/recv: ok"):
        assert p.stdout.count(check) == 2, p.stdout


# ---- the pipeline split itself -------------------------------------------------------------------------------


def test_pipeline_split_keeps_global_names_and_offsets():
    from meshformer.models.init import build_model
    from meshformer.parallel.pipeline import split_pipeline, stage_ids

    cfg = harness.make_cfg(
        {
            "parallel_config.pipeline_stage": 2,
            "parallel_config.micro_batch_num": 2,
            "model.model_config.offset": [1, -1],
        }
    )
    model = build_model(cfg.model.model_config)
    ((s0, first),) = split_pipeline(model, cfg, 0)
    ((s1, last),) = split_pipeline(model, cfg, 1)
    assert (s0, s1) == (0, 1) and list(first.layers) == ["0", "1", "2"] and list(last.layers) == ["3"]
    assert first.embed_tokens is not None and first.lm_head is None and first.norm is None
    assert last.embed_tokens is None and last.lm_head is not None
    names = {n for part in (first, last) for n, _ in part.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
    v = harness.make_cfg(
        {
            "parallel_config.pipeline_stage": 2,
            "parallel_config.micro_batch_num": 2,
            "parallel_config.pipeline_schedule": "zbv_zero_bubble",
        }
    )
    assert stage_ids(v, 0) == [0, 3] and stage_ids(v, 1) == [1, 2]


# ---- the real CLI: `meshformer train` metrics.jsonl under torchrun equals the single process -------------------


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _compare_metrics(got: list[dict], ref: list[dict], keys=("loss", "grad_norm", "eval_loss")) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        for key in keys:
            if key in r:
                assert rel(g[key], r[key]) <= FP32_RTOL, (key, g, r)


ONE_PROCESS = (sys.executable, "-m", "meshformer", "train")


def _meshformer_ok(tmp_path: Path, overrides: list[str], via=ONE_PROCESS, timeout=300) -> subprocess.CompletedProcess:
    """`<via> <the empty config> <overrides>` as a user runs it (one process, `meshformer launch` or torchrun);
    it must succeed."""
    cmd = [*via, str(_empty_yaml(tmp_path)), *overrides]
    p = subprocess.run(cmd, capture_output=True, text=True, env=torchrun_env(), timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def test_cli_train_under_torchrun_matches_single_process(tiny_dataset, tmp_path):
    """`meshformer train` metrics under pp2 (launch) and FSDP x TP (torchrun) equal one process; the FSDP x TP
    checkpoint then resumes in one process and continues exactly like the uninterrupted single-process run."""
    from conftest import tiny_overrides

    common = {
        "do_eval": "true",
        "eval_config.eval_iters": 2,
        "eval_config.eval_interval": 5,
        "train_dataset.batch_size": 2,
        "lr_schedule.total_steps": 8,
        "runner_config.stop_step": 5,
        "model.model_config.num_layers": 4,
    }
    single = tiny_overrides(
        tiny_dataset,
        tmp_path / "one",
        {**common, "runner_config.gradient_accumulation_steps": 4, "runner_config.stop_step": 8},
    )
    _meshformer_ok(tmp_path, single)
    ref = _metrics(tmp_path / "one")
    assert len(ref) == 8 and "eval_loss" in ref[4] and "eval_loss" in ref[7]

    # pp2, interleaved 1F1B (two stages per rank, so two optimizers per rank in the checkpoint), 4 micro-batches,
    # through `meshformer launch`.
    pp = tiny_overrides(
        tiny_dataset,
        tmp_path / "pp",
        {
            **common,
            "parallel_config.pipeline_stage": 2,
            "parallel_config.micro_batch_num": 4,
            "parallel_config.pipeline_schedule": "interleaved_1f1b",
            "parallel_config.pp_interleave_num": 2,
        },
    )
    _meshformer_ok(tmp_path, pp, via=(sys.executable, "-m", "meshformer", "launch", "--nproc", "2"))
    _compare_metrics(_metrics(tmp_path / "pp"), ref[:5])
    assert (tmp_path / "pp" / "checkpoint" / "step_00000005" / "trainer_state.json").is_file()

    # FSDP x TP with sequence parallel and accumulation, 4 processes, plain torchrun.
    ft = tiny_overrides(
        tiny_dataset,
        tmp_path / "ft",
        {
            **common,
            "parallel_config.data_parallel": 2,
            "parallel_config.model_parallel": 2,
            "parallel_config.optimizer_shard": "true",
            "parallel_config.use_seq_parallel": "true",
            "runner_config.gradient_accumulation_steps": 2,
        },
    )
    _meshformer_ok(
        tmp_path, ft, via=(*TORCHRUN, "--standalone", "--nproc-per-node", "4", "-m", "meshformer", "train"), timeout=400
    )
    _compare_metrics(_metrics(tmp_path / "ft"), ref[:5])

    # Resume the 4-process FSDP x TP checkpoint (step 5) in one process: DCP reshards weights and optimizer.
    resumed = tiny_overrides(
        tiny_dataset,
        tmp_path / "ft",
        {
            **common,
            "runner_config.gradient_accumulation_steps": 4,
            "runner_config.stop_step": 8,
            "resume_training": "true",
        },
    )
    p = _meshformer_ok(tmp_path, resumed)
    assert "resumed from" in p.stdout and "step_00000005" in p.stdout
    _compare_metrics(_metrics(tmp_path / "ft"), ref)


def _empty_yaml(tmp_path: Path) -> Path:
    f = tmp_path / "run.yaml"
    f.write_text("run_mode: train\n")
    return f


def test_dead_rank_fails_fast_and_is_named(tmp_path):
    t = time.time()
    p = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(DIST / "dead_rank.py")],
        capture_output=True,
        text=True,
        env=torchrun_env(),
        timeout=120,
        cwd=ROOT,
    )
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "rank 0 was not stopped" not in out
    root = out.split("Root Cause", 1)[-1]
    assert "rank      : 1" in root and "exitcode  : 3" in root, out[-3000:]
    assert time.time() - t < 90
