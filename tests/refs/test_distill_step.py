"""The distillation step (train/distill_step.py, the trainer's `distill_config`) against TRL 1.16: a transformers-made
tiny Llama student, a wider Mistral teacher (another family, the same vocabulary), a few instruction conversations,
full-batch steps (so the order cannot differ), the same AdamW, schedule and clipping. meshformer's per-step loss
equals `trl.experimental.gkd.GKDTrainer`'s with lmbda 0 (off-policy: the dataset's completions, as meshformer
trains on) within 1e-5 relative (fp32), for forward KL, reverse KL and the JSD.

TRL 1.16's `DistillationTrainer` is on-policy only (it generates every completion with the student), so its
off-policy sibling GKD is the reference for a training run; its loss is the same generalized JSD
(tests/refs/test_distill_loss.py checks both on logits). GKD reads the same token rows meshformer trains on (a
collator hands it meshformer's own batch), so only the arithmetic is compared, not two tokenizations. TRL has no
alpha: the mix with the cross-entropy is checked against a direct computation from transformers' logits of both
models on the first step."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_HF_LLAMA, full_batch_overrides, rel, save_hf_model, tiny_overrides, trl_full_batch_args
from meshformer.cli.train_cmd import run_training  # load_checkpoint / the teacher: Hugging Face directories
from meshformer.config import load_config

trl = pytest.importorskip("trl")

CONVERSATIONS = [
    ("The king said", "to be or not"),
    ("What light", "through yonder window breaks"),
    ("O Romeo,", "wherefore art thou"),
    ("Good night, sweet", "prince"),
    ("Now is the winter", "of our discontent"),
    ("All the world", "is a stage"),
]
STEPS, LR = 3, 2e-3
TEACHER = {**TINY_HF_LLAMA, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4}


def _sharper_head(model) -> None:
    model.lm_head.weight.mul_(8)  # peaked next-token distributions, as a trained teacher's


@pytest.fixture(scope="module")
def setup(tiny_dataset, tmp_path_factory):
    """root with the student (`hf`), the teacher (`teacher`, Mistral) and the conversations (`data`)."""
    from meshformer.cli.main import main

    root = tmp_path_factory.mktemp("distill")
    tok = tiny_dataset.parent / "tok"
    save_hf_model(root / "hf", tok, TINY_HF_LLAMA)
    save_hf_model(root / "teacher", tok, TEACHER, "Mistral", before_save=_sharper_head)
    src = root / "chat.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]} for u, a in CONVERSATIONS
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    argv = ["preprocess", "--input", str(src), "--tokenizer", str(tok), "--output", str(root / "data")]
    assert main([*argv, "--val-fraction", "0"]) == 0
    return root


def _overrides(root, name: str, distill: dict) -> list[str]:
    extra = {
        "load_checkpoint": str(root / "hf"),
        **full_batch_overrides(len(CONVERSATIONS), STEPS, LR),
        "distill_config.teacher": str(root / "teacher"),
        **{f"distill_config.{k}": v for k, v in distill.items()},
    }
    return tiny_overrides(root / "data", root / name, extra)


def ours(root, name: str, distill: dict) -> list[dict]:
    """metrics.jsonl of a meshformer run: full batch, STEPS steps, constant learning rate, clipping at 1."""
    run_training(load_config(None, _overrides(root, name, distill)))
    return [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]


def our_rows(root):
    """The full batch meshformer trains on: (inputs, labels), as the trainer builds it from the dataset."""
    from meshformer.data.dataset import batch_inputs
    from meshformer.data.registry import open_dataset_for

    cfg = load_config(None, _overrides(root, "rows", {}))
    ds = open_dataset_for(cfg.train_dataset.data_loader, "train", cfg.model.model_config.seq_length, "train_dataset")
    samples = [ds.sample(i) for i in range(len(CONVERSATIONS))]
    inputs, labels, _ = batch_inputs(samples, 512, -100, "train_dataset")
    return inputs, labels


def trl_losses(root, name: str, beta: float) -> list[float]:
    """GKDTrainer's per-step losses (lmbda 0, as computed, unrounded) on the same models and token rows, fp32."""
    import datasets
    import torch
    import transformers
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    inputs, labels = our_rows(root)
    # GKD shifts itself (logits[:, :-1] against labels[:, 1:]): the full rows, and meshformer's labels one to the right
    ids = torch.cat([inputs, labels[:, -1:].clamp(min=0)], dim=1)
    trl_labels = torch.cat([torch.full_like(labels[:, :1], -100), labels], dim=1)

    def collate(rows):
        index = torch.tensor([r["i"] for r in rows])
        return {"input_ids": ids[index], "attention_mask": torch.ones_like(ids[index]), "labels": trl_labels[index]}

    torch.manual_seed(0)
    student = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    teacher = transformers.AutoModelForCausalLM.from_pretrained(root / "teacher", dtype=torch.float32)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(root / "hf"))
    full = trl_full_batch_args(root / name, len(CONVERSATIONS), STEPS, LR)
    args = GKDConfig(**full, lmbda=0.0, beta=beta, temperature=1.0)
    losses: list[float] = []

    class Recording(GKDTrainer):
        def compute_loss(self, *a, **kw):
            out = super().compute_loss(*a, **kw)
            losses.append((out[0] if isinstance(out, tuple) else out).item())
            return out

    data = datasets.Dataset.from_list([{"i": i} for i in range(len(CONVERSATIONS))])
    run = Recording(
        model=student, teacher_model=teacher, args=args, train_dataset=data, processing_class=tok,
        data_collator=collate,
    )  # fmt: skip
    run.train()
    return losses


# our loss -> GKD's beta (0 forward KL, 1 reverse KL, else the JSD's)
CASES = {"forward_kl": ({"loss": "forward_kl"}, 0.0), "reverse_kl": ({"loss": "reverse_kl"}, 1.0),
         "jsd": ({"loss": "jsd", "beta": 0.3}, 0.3)}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_distill_steps_equal_trl_gkd(setup, case):
    distill, beta = CASES[case]
    got = ours(setup, f"ours-{case}", distill)
    want = trl_losses(setup, f"trl-{case}", beta)
    assert len(got) == STEPS and len(want) == STEPS
    for step, (mine, loss) in enumerate(zip(got, want), start=1):
        assert rel(mine["loss"], loss) < 1e-5, (step, mine["loss"], loss)
        assert rel(mine["distill/divergence"], loss) < 1e-5, (step, mine["distill/divergence"], loss)
    assert got[0]["loss"] > 0.1  # a divergence well above rounding
    assert got[-1]["loss"] < got[0]["loss"]  # it learned: the comparison covers updated weights


def test_alpha_mix_with_temperature_and_top_k_equals_transformers_logits(setup):
    """TRL defines neither alpha nor top_k: the first step's loss and both metrics against a direct computation from
    transformers' logits of both models on the same rows (the teacher's top k indices gathered, both models'
    tempered log-softmax over those k, the KL written out, plus the untempered cross-entropy)."""
    import torch
    import torch.nn.functional as F
    import transformers

    alpha, temperature, k = 0.4, 2.0, 20
    got = ours(setup, "ours-mix", {"alpha": alpha, "temperature": temperature, "top_k": k})[0]
    inputs, labels = our_rows(setup)
    models = [
        transformers.AutoModelForCausalLM.from_pretrained(setup / d, dtype=torch.float32) for d in ("hf", "teacher")
    ]
    with torch.no_grad():
        zs, zt = (m(input_ids=inputs).logits for m in models)
    counted = labels != -100
    top = zt.topk(k, dim=-1).indices
    log_ps = F.log_softmax(zs.gather(-1, top) / temperature, dim=-1)
    log_pt = F.log_softmax(zt.gather(-1, top) / temperature, dim=-1)
    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1)[counted].mean()
    ce = F.cross_entropy(zs[counted], labels[counted])
    assert rel(got["distill/divergence"], float(kl)) < 1e-5, (got, float(kl))
    assert rel(got["distill/ce"], float(ce)) < 1e-5, (got, float(ce))
    assert rel(got["loss"], float(alpha * kl + (1 - alpha) * ce)) < 1e-5, got
