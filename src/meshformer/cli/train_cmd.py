"""Train from a YAML config. Any field can be overridden with --section.field VALUE, e.g.
--parallel_config.data_parallel 2 --model.model_config.num_layers 2.

`meshformer train CONFIG [--section.field VALUE ...]` (also under torchrun: `torchrun ... -m meshformer train`)."""

from __future__ import annotations

from meshformer.cli.commands import add_command


def add_parser(sub) -> None:
    p = add_command(sub, "train", "train (pre-train or fine-tune) from a YAML config", __doc__)
    p.add_argument("config", help="YAML config file (MindSpore Transformers field names)")
    p.add_argument(
        "--profile",
        metavar="START:END",
        default=None,
        help="record a torch.profiler trace of steps START..END into {output_dir}/profile (sets profile, "
        "profile_start_step, profile_stop_step)",
    )
    p.set_defaults(func=run, accepts_overrides=True)


def run(args) -> int:
    from meshformer.train.preemption import StopBeforeTraining, die_with_parent

    die_with_parent()  # under torchrun: a killed launcher takes its workers with it
    with StopBeforeTraining():  # before torch is imported: a stop signal during set-up ends the command, exit 0
        from meshformer.config.load import load_config

        notices: list[str] = []
        overrides = list(args.overrides)
        if args.profile is not None:
            overrides = [*profile_overrides(args.profile), *overrides]
        cfg = load_config(args.config, overrides, notices=notices)
        run_training(cfg, notices)
    return 0


def run_training(cfg, notices: list[str] | None = None, hooks=()) -> dict:
    """train/trainer.py's run_training as `meshformer train` runs it: first the trackers report_to names must be
    installed (observe/trackers.py) and the memory floor met (planner/fits.py: a size typo fails before anything is
    allocated), and load_checkpoint may name a Hugging Face directory (interop/base_model.py), for the fine-tune's
    shape and the weights."""
    from meshformer.interop.base_model import BASE_MODEL_SOURCES
    from meshformer.observe.trackers import check_trackers_installed
    from meshformer.planner.fits import check_run_fits
    from meshformer.train import trainer

    preflight = [check_trackers_installed, check_run_fits]
    return trainer.run_training(cfg, notices, hooks, preflight=preflight, sources=BASE_MODEL_SOURCES)


def profile_overrides(window: str) -> list[str]:
    from meshformer.errors import UserError

    start, sep, end = window.partition(":")
    if not (sep and start.isdigit() and end.isdigit() and 1 <= int(start) <= int(end)):
        raise UserError(f"--profile {window!r}: give START:END, two step numbers with 1 <= START <= END (e.g. 5:7)")
    return ["--profile", "true", "--profile_start_step", start, "--profile_stop_step", end]
