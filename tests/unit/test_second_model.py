"""The planner's second model (planner/second_model.py) against hand-computed byte counts: a preference run's
reference (`copy`: the policy's weights again; `adapter`, `precomputed`, `none`: nothing on the device;
`precomputed`: 16 bytes a pair on disk), the doubled rows of a pair, and a distillation teacher's weights and logits;
then `doctor` and `plan` saying which reference makes a run fit."""

from __future__ import annotations

import json

from conftest import ROOT
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.parallel.dims import ParallelDims
from meshformer.planner.accelerators import ACCELERATORS
from meshformer.planner.doctor import reference_findings
from meshformer.planner.plan import make_plan

H, LAYERS, FFN, VOCAB, SEQ = 64, 2, 128, 128, 32
TINY = {
    "model.model_config.hidden_size": H, "model.model_config.num_layers": LAYERS, "model.model_config.num_heads": 4,
    "model.model_config.n_kv_heads": 4, "model.model_config.intermediate_size": FFN,
    "model.model_config.vocab_size": VOCAB, "model.model_config.seq_length": SEQ,
}  # fmt: skip


def _llama_params(h: int, layers: int, ffn: int, vocab: int) -> int:
    """Untied Llama with full-width k/v: embedding, per layer q/k/v/o + gate/up/down + two norms, final norm, head."""
    return vocab * h + layers * (4 * h * h + 3 * h * ffn + 2 * h) + h + vocab * h


def _plan(extra: dict, micro_batch: int = 2, device_memory: float | None = None):
    argv = [x for k, v in {**TINY, **extra}.items() for x in (f"--{k}", str(v))]
    cfg = load_config(None, argv)
    dims = ParallelDims.from_config(cfg, 1)
    return make_plan(cfg, dims, ACCELERATORS["H100"], micro_batch, 1, device_memory=device_memory)


DPO = {"preference_config.method": "dpo"}


def test_reference_copy_is_the_policys_weights_again_and_the_others_are_free():
    weights = _llama_params(H, LAYERS, FFN, VOCAB) * 4  # float32
    plans = {ref: _plan({**DPO, "preference_config.reference": ref}) for ref in ("copy", "precomputed")}
    plans["none"] = _plan({"preference_config.method": "simpo"})
    copy = plans["copy"].stages[0]
    assert copy.second.kind == "reference: copy" and copy.second.weights_bytes == weights == copy.memory.params_bytes
    for ref in ("precomputed", "none"):
        s = plans[ref].stages[0]
        assert s.second.weights_bytes == 0 and s.second.logits_bytes == 0
        assert copy.allocated_bytes - s.allocated_bytes == weights, ref  # the only difference
    lora = {"model.model_config.pet_config.pet_type": "lora"}
    adapter = _plan({**DPO, **lora, "preference_config.reference": "adapter"}).stages[0]
    lora_copy = _plan({**DPO, **lora, "preference_config.reference": "copy"}).stages[0]
    assert adapter.second.weights_bytes == 0
    assert lora_copy.allocated_bytes - adapter.allocated_bytes == lora_copy.memory.params_bytes


def test_a_pair_is_two_rows_of_the_micro_batch():
    """batch_size counts pairs (KTO: examples): a DPO micro-batch of 2 pairs is planned as 4 SFT rows, its logits
    twice 2 rows'; a KTO example is its own row and its KL row."""
    dpo = _plan({**DPO, "preference_config.reference": "precomputed"}, micro_batch=2).stages[0]
    sft4 = _plan({}, micro_batch=4).stages[0]
    sft2 = _plan({}, micro_batch=2).stages[0]
    assert dpo.memory.activations_bytes == sft4.memory.activations_bytes > sft2.memory.activations_bytes
    assert dpo.logits_bytes == sft4.logits_bytes == 4 * SEQ * VOCAB * 4  # rows x seq x vocab x float32
    kto = _plan({"preference_config.method": "kto", "preference_config.loss_type": "kto"}, micro_batch=2).stages[0]
    assert kto.logits_bytes == sft4.logits_bytes  # a KTO example is two rows too: its own and its KL sequence


def test_precomputed_reference_costs_eight_bytes_a_pair_on_disk(tmp_path):
    d = tmp_path / "pairs"
    d.mkdir()
    meta = {"format": "meshformer-preference-v1", "kind": "pairs", "splits": {"train": {"samples": 1000}}}
    (d / "meta.json").write_text(json.dumps(meta))
    s = _plan({**DPO, "preference_config.reference": "precomputed", "train_dataset.data_loader.dataset_dir": d})
    assert s.stages[0].second.disk_bytes == 1000 * 2 * 8
    assert _plan({**DPO, "preference_config.reference": "precomputed"}).stages[0].second.disk_bytes is None


def test_a_teacher_adds_its_weights_and_its_logits(tmp_path):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    th, tl, tf = 96, 3, 160
    (teacher / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": th,
        "num_hidden_layers": tl, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": tf,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    }))  # fmt: skip
    plain = _plan({}, micro_batch=2).stages[0]
    s = _plan({"distill_config.teacher": teacher, "distill_config.loss": "jsd"}, micro_batch=2).stages[0]
    assert s.second.kind == "teacher"
    assert s.second.weights_bytes == _llama_params(th, tl, tf, VOCAB) * 4
    tokens = 2 * SEQ
    assert s.second.logits_bytes == tokens * VOCAB * 4  # its output for the loss, float32
    # its forward's peak: the head's (logits and the final norm's output) or an MLP's three T x ffn tensors
    assert s.second.forward_bytes == max(tokens * (VOCAB + th) * 4, 3 * tokens * tf * 4)
    # beside the student's working memory: its logits with the divergence's float32 temporaries (the jsd's tempered
    # logits, log-probabilities, mixture and terms: about seven tokens x vocab tensors), more than its forward here
    temporaries = (s.second.beside_bytes - s.second.logits_bytes) / (tokens * VOCAB * 4)
    assert 6.5 < temporaries < 7 and s.second.beside_bytes > s.second.forward_bytes
    assert s.logits_bytes == plain.logits_bytes + s.second.beside_bytes
    saved = s.memory.activations_bytes - plain.memory.activations_bytes  # the jsd's saved tensors, not one log-softmax
    assert saved > 0
    assert s.allocated_bytes - plain.allocated_bytes == s.second.weights_bytes + s.second.beside_bytes + saved
    # tensor parallelism splits the teacher as the student: its logits by vocabulary, its weights about in half
    argv = [x for k, v in {**TINY, "distill_config.teacher": teacher, "parallel_config.model_parallel": 2}.items()
            for x in (f"--{k}", str(v))]  # fmt: skip
    cfg = load_config(None, argv)
    tp2 = make_plan(cfg, ParallelDims.from_config(cfg, 2), ACCELERATORS["H100"], 2, 1).stages[0].second
    assert tp2.logits_bytes == s.second.logits_bytes // 2
    assert s.second.weights_bytes / 2 < tp2.weights_bytes < 0.51 * s.second.weights_bytes  # norms replicated
    # pipeline parallelism: the teacher's stages run first, so its logits of all 4 micro-batches (float32, with the
    # labels) wait on the last stage; the first stage holds its share of the teacher's weights and no logits
    argv = [x for k, v in {**TINY, "distill_config.teacher": teacher, "parallel_config.pipeline_stage": 2,
                           "parallel_config.micro_batch_num": 4}.items() for x in (f"--{k}", str(v))]  # fmt: skip
    cfg = load_config(None, argv)
    first, last = make_plan(cfg, ParallelDims.from_config(cfg, 2), ACCELERATORS["H100"], 2, 4).stages
    assert first.second.logits_bytes == 0 and first.second.weights_bytes > 0
    assert last.second.logits_bytes == 4 * tokens * (1 + VOCAB) * 4


def test_doctor_says_which_reference_makes_a_run_fit(capsys):
    lora = {"model.model_config.pet_config.pet_type": "lora"}
    copy = _plan({**DPO, **lora}, micro_batch=2)
    adapter = _plan({**DPO, **lora, "preference_config.reference": "adapter"}, micro_batch=2)
    between = (copy.stages[0].reserved_bytes + adapter.stages[0].reserved_bytes) / 2 + copy.accelerator.runtime(
        copy.dims
    )
    tight = _plan({**DPO, **lora}, micro_batch=2, device_memory=between)
    assert not tight.fits
    lines = reference_findings(tight)
    assert [line.split(" (")[0] for line in lines] == [
        "fits with preference_config.reference: adapter",
        "fits with preference_config.reference: precomputed",
    ]
    # the CLI: the seed config as a LoRA DPO run on a device that holds it with `adapter` but not with `copy`
    seed = str(ROOT / "configs" / "seed_pretrain_skeleton.yaml")
    argv = [seed, "--device-memory", "67", "--model.model_config.compute_dtype", "bfloat16",
            "--preference_config.method", "dpo", "--model.model_config.pet_config.pet_type", "lora"]  # fmt: skip
    capsys.readouterr()
    assert main(["doctor", *argv]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "reference: copy: frozen weights 6.29 GiB per rank" in out
    knobs = out[out.index("out of memory") :]
    assert "- preference_config.reference: adapter (the reference is the policy with its LoRA adapters off: no " \
           "second copy of the weights): saves 6.3 GiB -> 61.6 GiB, fits" in knobs  # fmt: skip
    assert knobs.index("reference: adapter") < knobs.index("reference: precomputed") < knobs.index("batch_size")
    assert main(["plan", *argv]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "fits with preference_config.reference: adapter" in out
    assert "fits with preference_config.reference: precomputed" in out


def test_what_each_divergence_saves_for_the_students_backward():
    """The planner's count of the distillation loss's saved tensors (planner/distill_memory.py), per token and
    vocabulary entry, against what train/distill_loss.py keeps: forward_kl the student's log-probabilities and the
    teacher's probabilities (2 float32), reverse_kl the student's log-probabilities, probabilities and their
    difference with the teacher's (3), top_k a bool support mask more (1 byte), alpha < 1 the cross-entropy's
    log-softmax more (4)."""
    from meshformer.planner.distill_memory import loss_saved_bytes

    tokens, vocab = 64, 4096
    per_entry = {}
    for name, extra in {
        "sft": {}, "forward_kl": {"distill_config.loss": "forward_kl"},
        "reverse_kl": {"distill_config.loss": "reverse_kl"},
        "forward_kl, top_k": {"distill_config.loss": "forward_kl", "distill_config.top_k": 8},
        "forward_kl, alpha": {"distill_config.loss": "forward_kl", "distill_config.alpha": 0.5},
    }.items():  # fmt: skip
        argv = [x for k, v in {**TINY, **extra}.items() for x in (f"--{k}", str(v))]
        cfg = load_config(None, argv)
        if name != "sft":  # the teacher's path is not read by the count
            cfg.distill_config.teacher = "teacher"
        per_entry[name] = loss_saved_bytes(cfg, tokens, vocab) / (tokens * vocab)
    assert per_entry["sft"] == 4  # the cross-entropy's float32 log-softmax
    want = {"forward_kl": 8, "reverse_kl": 12, "forward_kl, top_k": 9, "forward_kl, alpha": 12}
    for name, bytes_ in want.items():
        assert abs(per_entry[name] - bytes_) < 0.01, (name, per_entry[name])


def test_a_7b_dpo_full_fine_tune_on_8_ascend_devices_fits_with_a_precomputed_reference(capsys):
    """The seed's 7B Llama (dp2 x tp2 x pp2), DPO without LoRA, 2 pairs a micro-batch with selective recompute, on
    8 x 910B (64 GB): the frozen copy's 6.3 GiB a rank does not fit, `precomputed` does and is the first knob;
    `adapter` is not offered (no adapters to turn off)."""
    seed = str(ROOT / "configs" / "seed_pretrain_skeleton.yaml")
    argv = [seed, "--accelerator", "910B", "--model.model_config.compute_dtype", "bfloat16",
            "--preference_config.method", "dpo", "--train_dataset.batch_size", "2",
            "--recompute_config.select_recompute", "true"]  # fmt: skip
    capsys.readouterr()
    assert main(["doctor", *argv]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "8 x 910B (64 GB each" in out and "reference: copy: frozen weights 6.28 GiB per rank" in out
    knobs = out[out.index("out of memory") :]
    first = knobs[knobs.index("Knobs in the order to try them: - ") :].split(" - ")[1]
    assert first.startswith("preference_config.reference: precomputed (") and first.endswith(", fits"), first
    assert "reference: adapter" not in out
    assert main(["plan", *argv]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "does not fit" in out and "fits with preference_config.reference: precomputed" in out
    assert "reference: adapter" not in out
