"""`meshformer eval --tasks` scores what lm-evaluation-harness's own `hf` model scores on the same model.

A tiny random Llama that transformers builds and saves (with the byte-level tokenizer of `tiny_dataset`), imported
as a meshformer checkpoint. Three local tasks, YAMLs over JSONL files written here (no hub): a multiple-choice
task (loglikelihood, one few-shot example: the first document, since lm-eval's random few-shot draws depend on
which documents a rank holds), a perplexity task (rolling loglikelihood over texts longer than the
model's positions, so several windows) and a generation task (stop sequences, batched, left-padded prompts).
Every sample's answers (log-likelihoods to 1e-5, greedy flags, generated text) and every metric must equal the
`hf` model's on the Hugging Face directory; two processes under torchrun must give what one gives. During
training, eval_config.tasks under data parallel and FSDP (two processes) must log what one process logs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HF_SMALL, ROOT, TORCHRUN, fails, save_hf_model, torchrun_env
from meshformer.cli.main import main

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

TASKS = "tiny_mc,tiny_ppl,tiny_gen"
QUESTIONS = [
    ("The king of Denmark is", [" Hamlet", " Claudius", " a ghost"], 1),
    ("To be or not to", [" be", " sleep", " dream of kings"], 0),
    ("Speak, for I am bound to", [" hear", " go", " weep"], 0),
    ("Good night, sweet", [" prince", " lady", " night and day"], 0),
    ("Something is rotten in the state of", [" Denmark", " Rome"], 0),
]
PROMPTS = [
    ("Who is there? Nay, answer me:", "stand"),
    ("Long live the", "king"),
    ("O, that this too too solid flesh would", "melt"),
    ("Frailty, thy name is", "woman"),
    ("The play's the thing", "wherein"),
]
# Each task: its name, then its YAML past the data source (a JSONL file of the same name beside it).
SOURCE = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}/{name}.jsonl\ntest_split: test\n"
TASK_YAML = {
    "tiny_mc": """fewshot_split: test
num_fewshot: 1
fewshot_config:
  sampler: first_n
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "tiny_ppl": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
should_decontaminate: false
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "tiny_gen": """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["e", "\\n"]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The three task YAMLs and their JSONL files."""
    tasks = tmp_path_factory.mktemp("tasks")
    write_jsonl(tasks / "tiny_mc.jsonl", [dict(question=q, choices=c, answer=a) for q, c, a in QUESTIONS])
    plays = " ".join(p.read_text(encoding="utf-8")[:4000] for p in sorted((ROOT / "data" / "shakespeare").iterdir()))
    write_jsonl(tasks / "tiny_ppl.jsonl", [{"text": plays[i * 700 : i * 700 + 600]} for i in range(3)])
    write_jsonl(tasks / "tiny_gen.jsonl", [dict(prompt=p, answer=a) for p, a in PROMPTS])
    for name, body in TASK_YAML.items():
        (tasks / f"{name}.yaml").write_text(f"task: {name}\n" + SOURCE.format(data=tasks, name=name) + body)
    return tasks


@pytest.fixture(scope="module")
def bench(tiny_dataset, task_dir, tmp_path_factory):
    """(the Hugging Face directory, its meshformer import, the task folder)."""
    root = tmp_path_factory.mktemp("lmeval")
    config = {**HF_SMALL, "num_key_value_heads": 2, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    config["max_position_embeddings"] = 64  # the perplexity texts need several windows
    save_hf_model(root / "hf", tiny_dataset.parent / "tok", config)
    assert main(["import", str(root / "hf"), "--output", str(root / "ckpt")]) == 0
    return root / "hf", root / "ckpt", task_dir


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def reference(bench):
    """lm-eval's `hf` model on the Hugging Face directory: its results, samples included."""
    from lm_eval.tasks import TaskManager

    hf, _, tasks = bench
    return lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(hf), "dtype": "float32", "device": "cpu"},
        tasks=TASKS.split(","),
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=2,
        log_samples=True,
    )


def ours(bench, out: Path, *extra: str) -> tuple[dict, dict]:
    """(the results JSON, {task: [samples]}) `meshformer eval --tasks` wrote under out."""
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {}
    for f in out.rglob("samples_*.jsonl"):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        samples[f.name.split("_20")[0].removeprefix("samples_")] = sorted(rows, key=lambda r: r["doc_id"])
    return results, samples


def answers(rows: list[dict]) -> list:
    """Each sample's raw answers as plain lists, in document order: per request, its first answer (under several
    processes lm-eval evens out the ranks' request counts by running a rank's last request again, and files the
    repeat's answer beside the first)."""
    return json.loads(json.dumps([[a[:1] for a in r["resps"]] for r in sorted(rows, key=lambda r: r["doc_id"])]))


def assert_same_answers(got: list, want: list) -> None:
    """Log-likelihoods to 1e-5 (relative), greedy flags and texts exactly (lm-eval's samples file holds each
    answer's parts as text)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, float):
            assert float(g) == pytest.approx(w, rel=1e-5, abs=1e-5)
        elif isinstance(w, list):
            assert_same_answers(g, w)
        else:
            assert str(g) == str(w)


def assert_same_metrics(got: dict, want: dict) -> None:
    for task in TASKS.split(","):
        g, w = got["results"][task], want["results"][task]
        keys = [k for k in w if "," in k and "_stderr" not in k]
        assert keys and sorted(keys) == sorted(k for k in g if "," in k and "_stderr" not in k)
        for k in keys:
            assert g[k] == pytest.approx(w[k], rel=1e-5), (task, k)


def test_eval_tasks_matches_lm_evals_hf_model(bench, reference, tmp_path, capsys):
    _, ckpt, tasks = bench
    argv = ["eval", "--checkpoint", str(ckpt), "--tasks", TASKS, "--include-path", str(tasks)]
    argv += ["--batch-size", "2", "--output", str(tmp_path / "out"), "--log-samples", "--device", "cpu"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "tiny_mc" in table and "acc" in table and "word_perplexity" in table
    results, samples = ours(bench, tmp_path / "out")
    assert_same_metrics(results, reference)
    assert results["n-shot"]["tiny_mc"] == 1
    for task in TASKS.split(","):
        want = answers(reference["samples"][task])
        assert_same_answers(answers(samples[task]), want)
    # Each sample's resps: [[answer]] (one request, one repeat).
    gens = [r[0][0] for r in answers(reference["samples"]["tiny_gen"])]
    assert any(gens) and all("e" not in g for g in gens)  # the stop sequence cut some replies
    rolling = [r[0][0] for r in answers(reference["samples"]["tiny_ppl"])]
    assert all(r < -300 for r in rolling)  # ~150 tokens a text: several windows of the model's 64 positions


def test_two_processes_give_what_one_gives(bench, reference, tmp_path):
    _, ckpt, tasks = bench
    argv = ["-m", "meshformer", "eval", "--checkpoint", str(ckpt), "--tasks", TASKS, "--include-path", str(tasks)]
    argv += ["--batch-size", "2", "--output", str(tmp_path / "out"), "--log-samples", "--device", "cpu"]
    run = subprocess.run(
        [*TORCHRUN, "--nproc-per-node", "2", *argv],
        env=torchrun_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results, samples = ours(bench, tmp_path / "out")
    assert_same_metrics(results, reference)
    for task in TASKS.split(","):
        assert_same_answers(answers(samples[task]), answers(reference["samples"][task]))


def test_bad_input_is_one_line_exit_2(bench, tmp_path, capsys, monkeypatch):
    _, ckpt, tasks = bench
    base = ["eval", "--checkpoint", str(ckpt)]
    fails(capsys, [*base, "--tasks", "tiny_mcq", "--include-path", str(tasks)], "'tiny_mcq'", "closest: tiny_mc")
    fails(capsys, [*base, "--tasks", "hellaswagg"], "'hellaswagg' is not an lm-eval task", "hellaswag")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    fails(capsys, [*base, "--tasks", "broken", "--include-path", str(bad)], "broken.yaml does not parse")
    fails(capsys, [*base, "--tasks", "tiny_mc", "--include-path", str(tasks), "--limit", "0"], "--limit 0")
    fails(capsys, [*base, "--tasks", "tiny_mc", "--include-path", str(tmp_path / "nowhere")], "no such file")
    fails(capsys, [*base, "--tasks", "tiny_mc", "--include-path", str(tasks / "tiny_mc.yaml")], "give the folder")
    (tmp_path / "long").mkdir()
    long = tmp_path / "long" / "long.yaml"  # asks for more new tokens than the model has positions
    long.write_text(f"task: tiny_long\n{SOURCE.format(data=tasks, name='tiny_gen')}{TASK_YAML['tiny_gen']}")
    long.write_text(long.read_text().replace("max_gen_toks: 10", "max_gen_toks: 64"))
    # Found in the task's YAML before lm-eval builds the task (and prints its notes on it): one line.
    fails(capsys, [*base, "--tasks", "tiny_long", "--include-path", str(long.parent)], "max_gen_toks 64", "below 64")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed: importing it raises ImportError
    fails(capsys, [*base, "--tasks", "tiny_mc"], "not installed", "pip install 'meshformer[eval]'")


def test_tasks_during_training_score_the_model_its_checkpoint_holds(tiny_dataset, task_dir, tmp_path, capsys):
    """eval_config.tasks every eval_interval: eval/<task>/<metric> beside eval_loss in metrics.jsonl and
    TensorBoard; the last step's figures are what `meshformer eval --tasks` gives on the checkpoint saved there."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from conftest import tiny_overrides
    from meshformer.config import load_config
    from meshformer.train.trainer import run_training

    out, tb = tmp_path / "run", tmp_path / "tb"
    extra = {
        "runner_config.stop_step": 4,
        "eval_config.eval_interval": 2,
        "eval_config.tasks": "[tiny_mc, tiny_ppl]",
        "eval_config.include_path": str(task_dir),
        "eval_config.batch_size": 2,
        "tensorboard.tensorboard_dir": str(tb),
    }
    run_training(load_config(None, tiny_overrides(tiny_dataset, out, extra)))
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "eval/tiny_ppl/word_perplexity" in r]
    assert [r["step"] for r in evals] == [2, 4] and all("eval_loss" in r for r in evals)
    keys = sorted(k for k in evals[-1] if k.startswith("eval/"))
    assert keys == [
        "eval/tiny_mc/acc",
        "eval/tiny_mc/acc_norm",
        "eval/tiny_ppl/bits_per_byte",
        "eval/tiny_ppl/byte_perplexity",
        "eval/tiny_ppl/word_perplexity",
    ]
    assert evals[0]["eval/tiny_ppl/word_perplexity"] != evals[1]["eval/tiny_ppl/word_perplexity"]  # it trained
    events = EventAccumulator(str(tb))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("eval/tiny_ppl/bits_per_byte")]
    assert logged == [(r["step"], pytest.approx(r["eval/tiny_ppl/bits_per_byte"], rel=1e-6)) for r in evals]

    argv = ["eval", "--checkpoint", str(out), "--tasks", "tiny_mc,tiny_ppl", "--include-path", str(task_dir)]
    assert main([*argv, "--batch-size", "2", "--output", str(tmp_path / "cli"), "--device", "cpu"]) == 0
    results = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())["results"]
    for key in keys:
        _, task, metric = key.split("/")
        assert results[task][f"{metric},none"] == pytest.approx(evals[-1][key], rel=1e-5), key


def test_training_refuses_tasks_it_cannot_run(tiny_dataset, task_dir, tmp_path, capsys):
    from conftest import EMPTY, tiny_overrides
    from meshformer.config import load_config
    from meshformer.config.validate import validate_run
    from meshformer.errors import UserError

    tasks = {"eval_config.tasks": "[tiny_mcq]", "eval_config.include_path": str(task_dir)}
    argv = ["train", EMPTY, *tiny_overrides(tiny_dataset, tmp_path / "a", tasks)]
    fails(capsys, argv, "eval_config.tasks", "'tiny_mcq'", "closest: tiny_mc")
    fails(capsys, [*argv, "--eval_config.tasks", "[tiny_mc]", "--eval_config.limit", "0"], "eval_config.limit")
    for degree in ("pipeline_stage", "model_parallel", "context_parallel"):
        split = {
            **tasks,
            "eval_config.tasks": "[tiny_mc]",
            f"parallel_config.{degree}": 2,
            "parallel_config.micro_batch_num": 2,
        }
        cfg = load_config(None, tiny_overrides(tiny_dataset, tmp_path / "b", split))
        with pytest.raises(UserError, match=f"eval_config.tasks with parallel_config.{degree}=2: .* whole model"):
            validate_run(cfg, 2)
    dp_few = {**tasks, "eval_config.tasks": "[tiny_mc]", "eval_config.limit": 1, "parallel_config.data_parallel": 2}
    with pytest.raises(UserError, match="eval_config.limit 1 is below parallel_config.data_parallel=2"):
        validate_run(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "d", dp_few)), 2)
    for layout in TWO_PROCESS_LAYOUTS.values():  # what the two-process parity test runs passes the checks
        validate_run(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "c", {**tasks, **layout})), 2)


# ---- eval_config.tasks under two processes: the same task metrics as one process at the same steps -------------
TRAINING_TASKS = {
    "runner_config.stop_step": 2,
    "eval_config.eval_interval": 1,
    "eval_config.tasks": "[tiny_mc, tiny_ppl, tiny_gen]",
    "eval_config.batch_size": 2,
}
# Two ranks reading 4 rows each make the one process's step of 8 rows in two accumulated micro-batches.
TWO_PROCESS_LAYOUTS = {
    "dp2": {"parallel_config.data_parallel": 2},
    "fsdp2": {"parallel_config.data_parallel": 2, "parallel_config.optimizer_shard": "true"},
}


def task_records(out: Path) -> list[dict]:
    """Each evaluation's step and eval/<task>/<metric> figures from metrics.jsonl."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if k == "step" or k.startswith("eval/")} for r in recs if "eval/tiny_mc/acc" in r
    ]


@pytest.fixture(scope="module")
def one_process_tasks(tiny_dataset, task_dir, tmp_path_factory) -> list[dict]:
    from conftest import tiny_overrides
    from meshformer.config import load_config
    from meshformer.train.trainer import run_training

    out = tmp_path_factory.mktemp("tasks_one") / "run"
    extra = {
        **TRAINING_TASKS,
        "eval_config.include_path": str(task_dir),
        "runner_config.gradient_accumulation_steps": 2,
    }
    run_training(load_config(None, tiny_overrides(tiny_dataset, out, extra)))
    return task_records(out)


@pytest.mark.parametrize("layout", TWO_PROCESS_LAYOUTS)
def test_tasks_under_two_processes_log_what_one_process_logs(
    tiny_dataset, task_dir, one_process_tasks, layout, tmp_path
):
    """Data parallel and FSDP ranks split the documents (FSDP's forwards are collectives: every rank runs as many,
    generation included) and log the one process's task metrics at each evaluation."""
    from conftest import EMPTY, tiny_overrides

    extra = {**TRAINING_TASKS, "eval_config.include_path": str(task_dir), **TWO_PROCESS_LAYOUTS[layout]}
    argv = [*TORCHRUN, "--nproc-per-node", "2", "-m", "meshformer", "train", EMPTY]
    env = {**torchrun_env(), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [*argv, *tiny_overrides(tiny_dataset, tmp_path, extra)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    got = task_records(tmp_path)
    assert [r["step"] for r in got] == [r["step"] for r in one_process_tasks] == [1, 2]
    assert got[0]["eval/tiny_ppl/word_perplexity"] != got[1]["eval/tiny_ppl/word_perplexity"]  # it trained
    for mine, want in zip(got, one_process_tasks):
        assert sorted(mine) == sorted(want) and "eval/tiny_gen/exact_match" in mine
        for key, value in want.items():
            assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-8), (layout, key)
