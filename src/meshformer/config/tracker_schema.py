"""The experiment trackers a run reports to (`report_to`, `run_name`, `tracker_config`) and the rule that checks the
names. What each tracker does lives in observe/ (observe/trackers.py and a file per tracker)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from meshformer.config.fields import setting
from meshformer.errors import UserError

# The trackers observe/trackers.py builds, in the order they open; `all` and `none` as in Hugging Face's (and so
# LLaMA-Factory's) `report_to`.
TRACKERS = ("tensorboard", "wandb", "mlflow", "swanlab")
REPORT_TO_WORDS = {"all": TRACKERS, "none": ()}

REPORT_TO_DOC = (
    "Trackers fed every metrics.jsonl row, the config and the run summary: tensorboard, wandb, mlflow, swanlab "
    "(a list, a comma string, all or none; docs/observability.md)."
)
RUN_NAME_DOC = "The trackers' run name (empty: output_dir's folder name)."


@dataclass
class TrackerConfig:
    project: str = setting(
        "",
        "W&B and SwanLab project, MLflow experiment; empty: WANDB_PROJECT, SWANLAB_PROJECT, MLFLOW_EXPERIMENT_NAME, "
        "else meshformer.",
    )
    dir: str = setting(
        "",
        "Trackers' local files (wandb/, mlruns/, swanlog/) go here; empty: WANDB_DIR, MLFLOW_TRACKING_URI, "
        "SWANLAB_LOG_DIR, else output_dir.",
    )
    finish_timeout: float = setting(
        60.0,
        "Seconds the run's end waits for the trackers to write what they hold; one still busy is left behind with a "
        "warning.",
        gt=0,
    )


def report_to_names(value: str | list) -> list[str]:
    """`report_to` as the list of trackers it names, in TRACKERS' order; an unknown name is one line with a guess."""
    items = value.split(",") if isinstance(value, str) else list(value)
    names: list[str] = []
    for item in items:
        word = str(item).strip().lower()
        if not word:
            continue
        if word in REPORT_TO_WORDS:
            names += REPORT_TO_WORDS[word]
        elif word in TRACKERS:
            names.append(word)
        else:
            guess = difflib.get_close_matches(word, [*TRACKERS, *REPORT_TO_WORDS], n=1)
            hint = f"did you mean {guess[0]!r}? " if guess else ""
            raise UserError(
                f"report_to: unknown tracker {str(item)!r}: {hint}choose from {', '.join(TRACKERS)}, all or none"
            )
    return [t for t in TRACKERS if t in names]
