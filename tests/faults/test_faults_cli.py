"""Faults of the command line and launch: a flag argparse refuses, a launch port that is out of range or taken, a
--device this machine lacks and odd values of other flags end with one line naming the flag, exit code 2, no
usage block and no traceback; a reader that closes stdout early (`| head`) ends the command quietly."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from conftest import EMPTY, ROOT, fails, tiny_overrides
from meshformer.cli.main import main


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["generate", "--max-new-tokens", "abc"], ["generate", "--max-new-tokens 'abc'", "whole number"]),
        (["generate", "--checkpoint", "x", "--temperature", "warm"], ["--temperature 'warm'", "a number"]),
        (["launch", "--nproc", "two", EMPTY], ["launch", "--nproc 'two'", "whole number"]),
        (["train", EMPTY, "--sead", "3"], ["train", "--sead", "did you mean --seed?", "--section.field VALUE"]),
        (["train", EMPTY, "--bogus"], ["unknown option --bogus", "meshformer train --help"]),
        (["plan", EMPTY, "--devicse", "2"], ["plan", "did you mean --devices?"]),
        (["generate", "--checkpoint", "x", "--top_p", "0.9"], ["generate", "--top_p", "did you mean --top-p?"]),
        (["generate", "--checkpoint", "x", "--model.hidden_size", "8"], ["--model.hidden_size", "no config fields"]),
        (["eval", "--checkpoint", "x", "--input", "y", "--seqlength", "3"], ["did you mean --seq-length?"]),
        (["data", "samples", EMPTY, "--split", "valid"], ["--split 'valid'", "did you mean validation?"]),
        (["ckpt", "mrege", "x"], ["ckpt", "'mrege'", "did you mean merge?"]),
        (["exprot", "x"], ["'exprot'", "did you mean export?"]),
        (["generate", "--checkpoint"], ["--checkpoint", "expects a value"]),
        (["ckpt", "merge", "x"], ["ckpt merge", "required", "--output"]),
        (["train", EMPTY, "second.yaml"], ["train", "unexpected argument 'second.yaml'"]),
    ],
)
def test_argparse_errors_are_one_line_naming_the_flag(capsys, argv, needles):
    assert "usage:" not in fails(capsys, argv, *needles)


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["ckpt", "merge", "--help"]])
def test_help_still_prints_the_usage_and_exits_0(capsys, argv):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: meshformer")


@pytest.fixture
def started(monkeypatch) -> list:
    """launch's torchrun agent replaced by a recorder: what it would have started (nothing starts)."""
    import meshformer.cli.launch_workers as workers

    calls: list = []
    monkeypatch.setattr(workers, "supervise", lambda args, grace: calls.append(args) or 0)
    return calls


@pytest.mark.parametrize("port", ["99999", "0", "-1"])
def test_launch_refuses_a_port_out_of_range(capsys, started, port):
    fails(capsys, ["launch", "--nproc", "1", EMPTY, "--master-port", port], f"--master-port {port}", "1..65535")
    assert started == []


def test_launch_refuses_a_port_another_process_holds_and_names_a_free_one(capsys, started):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = ["launch", "--nproc", "1", EMPTY, "--master-port", str(port)]
        line = fails(capsys, argv, f"--master-port {port}", "taken", "e.g. --master-port")
    assert started == []
    hint = int(line.split("e.g. --master-port ", 1)[1].split(",")[0])
    assert hint != port and 1 <= hint <= 65535
    # A free port goes through to torchrun's rendezvous on it.
    assert main(["launch", "--nproc", "1", EMPTY, "--master-port", str(hint)]) == 0
    assert len(started) == 1 and f"127.0.0.1:{hint}" in started[0]


def test_launch_refuses_multi_node_flags_and_absurd_process_counts(capsys, started):
    fails(capsys, ["launch", "--nnodes", "2", "--nproc", "1", EMPTY], "--nnodes", "torchrun on each node")
    big = ["--parallel_config.data_parallel", "100000"]
    fails(capsys, ["launch", "--nproc", "100000", EMPTY, *big], "--nproc 100000", "at most")
    assert started == []


@pytest.mark.parametrize("device", ["tpu", "", "cuda:99", "meta"])
def test_generate_refuses_a_device_this_machine_lacks_before_loading(capsys, tmp_path, device):
    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt", "hi", "--device", device]
    fails(capsys, argv, f"--device {device!r}", "give one of cpu")  # tmp_path holds no checkpoint: not loaded


def test_generate_cuda_without_cuda_names_the_devices_here(capsys, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = fails(capsys, ["generate", "--checkpoint", str(tmp_path), "--prompt", "hi", "--device", "cuda"], "'cuda'")
    assert line.rstrip().endswith("give one of cpu")


def test_device_flag_helper_takes_what_this_machine_has():
    import torch

    from meshformer.cli.devices import available_devices, device_from_flag

    assert device_from_flag("cpu") == torch.device("cpu") and "cpu" in available_devices()
    assert device_from_flag(None).type == ("cuda" if torch.cuda.is_available() else "cpu")


def _to_a_closed_pipe(argv: list[str]) -> subprocess.CompletedProcess:
    """Run the CLI with stdout a pipe whose reader has already gone (`| head -c 0`)."""
    read, write = os.pipe()
    os.close(read)
    try:
        cmd = [sys.executable, "-m", "meshformer", *argv]
        return subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    finally:
        os.close(write)


def test_a_reader_that_closes_stdout_early_ends_the_command_quietly(tiny_dataset, tmp_path):
    # 141 is what the shell reports for cat or seq in `... | head`: killed by SIGPIPE (128 + 13).
    samples = ["data", "samples", EMPTY, "--count", "2000", "--json", *tiny_overrides(tiny_dataset, tmp_path)]
    script = 'set -o pipefail; "$@" | head -n 1'
    piped = subprocess.run(
        ["bash", "-c", script, "-", sys.executable, "-m", "meshformer", *samples],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert piped.returncode == 141 and "Traceback" not in piped.stderr, piped.stderr[-3000:]
    assert piped.stdout.count("\n") == 1 and piped.stdout.startswith("{")
    for argv in (samples, ["config", "explain"]):  # (argparse's --help already ignores a closed stdout)
        p = _to_a_closed_pipe(argv)
        assert p.returncode == 141 and "Traceback" not in p.stderr and "Broken" not in p.stderr, (argv, p.stderr)


def test_a_broken_pipe_that_is_not_stdout_keeps_its_traceback(monkeypatch):
    import meshformer.cli.journal_cmd as journal

    def broken(args):
        raise BrokenPipeError("a socket of the command's own")

    monkeypatch.setattr(journal, "run", broken)
    with pytest.raises(BrokenPipeError):
        main(["journal"])


@pytest.mark.parametrize("value", ["inf", "-0.5", "nan"])
def test_generate_refuses_a_temperature_that_is_not_a_finite_number(capsys, tmp_path, value):
    fails(capsys, ["generate", "--checkpoint", str(tmp_path), "--prompt", "hi", "--temperature", value], value)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["generate", "--checkpoint", "", "--prompt", "hi"], "--checkpoint"),
        (["eval", "--checkpoint", "x", "--input", ""], "--input"),
        (["train", ""], "config"),
        (["ckpt", "merge", "x", "--output", "", "--overwrite"], "--output"),
    ],
)
def test_an_empty_path_is_refused_not_read_as_the_current_directory(capsys, argv, flag):
    fails(capsys, argv, f"{flag} is empty")


def test_an_empty_output_writes_nothing_in_the_current_directory(capsys, tmp_path, monkeypatch):
    text = tmp_path / "corpus.txt"
    text.write_text("to be or not to be, that is the question\n" * 50)
    monkeypatch.chdir(tmp_path)
    fails(capsys, ["tokenizer", "train", "--input", str(text), "--vocab-size", "300", "--output", ""], "--output")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["selfcheck", "--timeout", "nan"], ["--timeout nan", "> 0"]),
        (["selfcheck", "--timeout", "-1"], ["--timeout -1.0"]),
        (["selfcheck", "--timeout", "0"], ["--timeout 0.0"]),
        (["config", "check", EMPTY, "--world-size", "0"], ["--world-size 0", "at least 1"]),
        (["config", "check", EMPTY, "--world-size", "-4"], ["--world-size -4", "at least 1"]),
    ],
)
def test_other_flags_refuse_values_that_cannot_work(capsys, argv, needles):
    fails(capsys, argv, *needles)


def test_plot_refuses_an_image_too_large_to_draw_before_drawing(capsys, tmp_path):
    png = str(tmp_path / "p.png")
    fails(capsys, ["plot", str(tmp_path), "--output", png, "--height", "999999999"], "--height 999999999", "10000")
    assert not (tmp_path / "p.png").exists()
