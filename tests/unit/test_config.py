"""Config loading and validation: the seed article's YAML, real MindSpore configs, and every class of bad
input, each checked for a message that names the field and the fix (not just for the exception type)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from meshformer.config import load_config, validate_layout
from meshformer.config.validate import stage_layer_counts
from meshformer.errors import UserError

SEED_33 = """\
run_mode: train
model:
  model_config:
    type: LlamaConfig
    seq_length: 2048
    hidden_size: 4096
    num_layers: 32
    num_heads: 32
train_dataset:
  data_loader:
    type: MindDataset
    dataset_dir: ./data/train
    shuffle: True
  batch_size: 4
parallel_config:
  data_parallel: 2
  model_parallel: 2
  pipeline_stage: 2
  micro_batch_num: 8
optimizer:
  type: AdamW
  learning_rate: 1.0e-4
  warmup_steps: 2000
"""

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "mindformers-configs"  # ../shared


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def error(fn, *a, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*a, **kw)
    msg = str(e.value)
    assert "\n" not in msg  # the CLI prints it as one line
    return msg


# ---------------------------------------------------------------- valid configs


def test_seed_article_yaml_loads_exactly_as_written(tmp_path):
    notices: list[str] = []
    cfg = load_config(write(tmp_path, SEED_33), notices=notices)
    assert notices == []
    mc = cfg.model.model_config
    assert cfg.run_mode == "train"
    assert (mc.type, mc.seq_length, mc.hidden_size, mc.num_layers, mc.num_heads) == ("LlamaConfig", 2048, 4096, 32, 32)
    dl = cfg.train_dataset.data_loader
    assert (dl.type, dl.dataset_dir, dl.shuffle, cfg.train_dataset.batch_size) == (
        "MindDataset",
        "./data/train",
        True,
        4,
    )
    pc = cfg.parallel_config
    assert (pc.data_parallel, pc.model_parallel, pc.pipeline_stage, pc.micro_batch_num) == (2, 2, 2, 8)
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.warmup_steps == 2000
    assert cfg.optimizer.learning_rate == 1e-4 and isinstance(cfg.optimizer.learning_rate, float)
    validate_layout(cfg, world_size=8)  # 2 x 2 x 2 processes
    assert stage_layer_counts(cfg) == [16, 16]


# Real MindSpore configs that use features meshformer does not have: they must fail with a clear one-line reason.
UNSUPPORTED: dict[str, str] = {}  # reference config -> the one-line refusal it gets (none at present)


@pytest.mark.parametrize("name", sorted(p.name for p in REFERENCE.glob("*.yaml")) or ["(none found)"])
def test_real_mindspore_configs_load(name):
    assert REFERENCE.is_dir(), f"{REFERENCE} missing: the shared reference configs come with every checkout"
    notices: list[str] = []
    if name in UNSUPPORTED:
        with pytest.raises(UserError) as e:
            load_config(REFERENCE / name, notices=notices)
        assert UNSUPPORTED[name] in str(e.value) and "\n" not in str(e.value)
        return
    cfg = load_config(REFERENCE / name, notices=notices)
    assert cfg.model.model_config.num_layers > 0
    assert notices and all("MindSpore-only" in n for n in notices)


def test_the_pretraining_template_reads_its_megatron_blend_block():
    cfg = load_config(REFERENCE / "master__general__llm_pretrain_dense_template.yaml")
    dl = cfg.train_dataset.data_loader
    assert (dl.type, dl.datasets_type, dl.sizes) == ("BlendedMegatronDatasetDataLoader", "GPTDataset", [1000, 0, 0])
    assert (dl.config.seed, dl.config.seq_length, dl.config.eod, dl.config.pad) == (1234, 4096, 1, -1)
    assert dl.config.data_path == ["1", "/path/megatron_data"] and dl.config.create_attention_mask is True


def test_llama2_pretrain_reference_values_and_notices():
    path = REFERENCE / "r1.5.0__llama2__pretrain_llama2_7b.yaml"
    assert path.is_file(), f"{path} missing: the shared reference configs come with every checkout"
    notices: list[str] = []
    cfg = load_config(path, notices=notices)
    mc = cfg.model.model_config
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.vocab_size) == (4096, 32, 32, 32000)
    assert mc.layernorm_compute_dtype == "float32"  # given as the alias layernorm_compute_type
    assert any(n.startswith("model.model_config.use_flash_attention ") for n in notices)
    assert any(n.startswith("context ") for n in notices)


def test_aliases_and_accepted_misspelling(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            "model:\n  model_config:\n    rotary_emb_base: 500000\n"
            "    softmax_compute_type: bfloat16\n"
            "runner_config:\n  train_steps: 7\n"
            "callbacks:\n  - type: CheckpointMointor\n    save_checkpoint_steps: 3\n",
        )
    )
    assert cfg.model.model_config.theta == 500000.0
    assert cfg.model.model_config.softmax_compute_dtype == "bfloat16"
    assert cfg.runner_config.stop_step == 7
    assert cfg.callbacks[0].type == "CheckpointMonitor" and cfg.callbacks[0].save_checkpoint_steps == 3
    msg = error(load_config, write(tmp_path, "model:\n  model_config:\n    theta: 1.0\n    rotary_emb_base: 2\n"))
    assert "rotary_emb_base" in msg and "theta" in msg


# ---------------------------------------------------------------- bad input


def test_unknown_key_did_you_mean_names_the_dotted_path(tmp_path):
    msg = error(load_config, write(tmp_path, "model:\n  model_config:\n    num_layer: 4\n"))
    assert "model.model_config.num_layer" in msg and "did you mean 'model.model_config.num_layers'" in msg
    msg = error(load_config, None, ["--parallel_config.data_paralel", "2"])
    assert "did you mean 'parallel_config.data_parallel'" in msg
    msg = error(load_config, write(tmp_path, "optimzer:\n  type: AdamW\n"))
    assert "'optimzer'" in msg and "did you mean 'optimizer'" in msg
    msg = error(load_config, write(tmp_path, "callbacks:\n  - type: CheckpointMonitor\n    save_steps: 3\n"))
    assert "callbacks.0.save_steps" in msg


@pytest.mark.parametrize(
    "yaml_text, field, words",
    [
        ("model:\n  model_config:\n    seq_length: abc\n", "model.model_config.seq_length", "an integer"),
        ("model:\n  model_config:\n    num_layers: true\n", "model.model_config.num_layers", "an integer"),
        ("model:\n  model_config:\n    hidden_size: 64.5\n", "model.model_config.hidden_size", "an integer"),
        ("optimizer:\n  learning_rate: fast\n", "optimizer.learning_rate", "a number"),
        ("train_dataset:\n  data_loader:\n    shuffle: maybe\n", "train_dataset.data_loader.shuffle", "true/false"),
        ("parallel_config: 4\n", "parallel_config", "section"),
    ],
)
def test_wrong_type(tmp_path, yaml_text, field, words):
    msg = error(load_config, write(tmp_path, yaml_text))
    assert field in msg and words in msg


@pytest.mark.parametrize(
    "override, needle",
    [
        (["--model.model_config.num_heads", "0"], "model.model_config.num_heads=0 is out of range: it must be > 0"),
        (["--optimizer.beta2", "1.5"], "optimizer.beta2=1.5 is out of range: it must be < 1"),
        (["--seed", "-1"], "seed=-1 is out of range: it must be >= 0"),
        (["--parallel_config.context_parallel", "0"], "parallel_config.context_parallel=0 is out of range: it must"),
    ],
)
def test_out_of_range(override, needle):
    assert needle in error(load_config, None, override)


def test_bad_choice_suggests_the_closest_option():
    msg = error(load_config, None, ["--run_mode", "trian"])
    assert "run_mode='trian'" in msg and "did you mean 'train'" in msg and "finetune" in msg
    msg = error(load_config, None, ["--parallel_config.pipeline_schedule", "1F1B"])
    assert "parallel_config.pipeline_schedule" in msg and "gpipe" in msg


def test_malformed_yaml_reports_line(tmp_path):
    p = write(tmp_path, "run_mode: train\nmodel:\n  model_config:\n    num_layers: [1, 2\n    num_heads: 4\n")
    msg = error(load_config, p)
    m = re.search(r"line (\d+)", msg)
    assert "malformed YAML" in msg and str(p) in msg and m and int(m.group(1)) in (4, 5)
    msg = error(load_config, write(tmp_path, "a: 1\n b: 2\n", "indent.yaml"))
    assert "line 2" in msg
    assert "top level must be a mapping" in error(load_config, write(tmp_path, "- 1\n- 2\n", "list.yaml"))


def test_missing_file(tmp_path):
    msg = error(load_config, tmp_path / "absent.yaml")
    assert "absent.yaml" in msg and "not found" in msg


# ---------------------------------------------------------------- overrides


def test_dotted_overrides(tmp_path):
    p = write(tmp_path, SEED_33)
    cfg = load_config(
        p,
        [
            "--parallel_config.data_parallel",
            "1",
            "--optimizer.learning_rate=3e-4",
            "--train_dataset.data_loader.dataset_dir=/x=y",
            "--model.model_config.offset",
            "[-1, 1]",
        ],
    )
    assert cfg.parallel_config.data_parallel == 1 and cfg.parallel_config.model_parallel == 2  # rest of the file kept
    assert cfg.optimizer.learning_rate == 3e-4  # YAML 1.1 reads 3e-4 as a string; still a float here
    assert cfg.train_dataset.data_loader.dataset_dir == "/x=y"  # only the first '=' splits
    assert stage_layer_counts(cfg) == [15, 17]
    # Overrides beat the file and are type-checked like it.
    assert "parallel_config.data_parallel must be an integer" in error(
        load_config, p, ["--parallel_config.data_parallel", "two"]
    )


CALLBACK_OVERRIDES = ["--callbacks.CheckpointMonitor.save_checkpoint_steps", "5", "--callbacks.0.per_print_times", "3"]


def test_callback_overrides_on_callbacks_from_the_file(tmp_path):
    p = write(
        tmp_path,
        SEED_33 + "callbacks:\n  - type: MFLossMonitor\n  - type: CheckpointMonitor\n    keep_checkpoint_max: 2\n",
    )
    cfg = load_config(p, CALLBACK_OVERRIDES)
    cb = {c.type: c for c in cfg.callbacks}
    assert cb["CheckpointMonitor"].save_checkpoint_steps == 5 and cb["CheckpointMonitor"].keep_checkpoint_max == 2
    assert cb["MFLossMonitor"].per_print_times == 3


def test_callback_overrides_on_default_callbacks(tmp_path):
    # The seed YAML has no callbacks: section, so the override must address the default callbacks.
    cfg = load_config(write(tmp_path, SEED_33), CALLBACK_OVERRIDES)
    cb = {c.type: c for c in cfg.callbacks}
    assert cb["CheckpointMonitor"].save_checkpoint_steps == 5 and cb["MFLossMonitor"].per_print_times == 3


def test_bad_overrides():
    assert "has no value" in error(load_config, None, ["--seed"])
    assert "--section.field VALUE" in error(load_config, None, ["seed", "3"])
    assert "run_mode must be a string" in error(load_config, None, ["--run_mode.x", "1"])
    assert "run_mode is a value, not a section" in error(
        load_config, None, ["--run_mode", "train", "--run_mode.x", "1"]
    )
    msg = error(load_config, None, ["--callbacks.Nope.per_print_times", "1"])
    assert "'Nope'" in msg and "callbacks" in msg


# ---------------------------------------------------------------- impossible layouts


def layout(**kw):
    """A default config with some parallel_config / model_config fields replaced, *without* load-time checks."""
    cfg = load_config(None)
    pc = {k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(cfg.parallel_config)}}
    mc = {k: v for k, v in kw.items() if k not in pc}
    cfg.parallel_config = dataclasses.replace(cfg.parallel_config, **pc)
    cfg.model.model_config = dataclasses.replace(cfg.model.model_config, **mc)
    return cfg


def test_world_size_mismatch_lists_valid_alternatives():
    cfg = layout(data_parallel=2, model_parallel=2, pipeline_stage=2, micro_batch_num=8)
    validate_layout(cfg, 8)
    msg = error(validate_layout, cfg, 4)
    assert "2x2x2 = 8" in msg and "4 processes" in msg
    alts = re.findall(r"dp(\d+)xmp(\d+)xpp(\d+)", msg)
    assert len(alts) >= 3
    for dp, mp, pp in alts:  # every suggestion must itself be a valid layout for 4 processes
        assert int(dp) * int(mp) * int(pp) == 4
        validate_layout(
            layout(data_parallel=int(dp), model_parallel=int(mp), pipeline_stage=int(pp), micro_batch_num=8), 4
        )


def test_model_parallel_not_dividing_heads_lists_valid_degrees():
    cfg = layout(num_heads=32, hidden_size=4096, model_parallel=3)
    msg = error(validate_layout, cfg, None)
    assert "parallel_config.model_parallel=3" in msg and "num_heads=32" in msg
    degrees = [int(d) for d in re.search(r"\[([\d, ]+)\]", msg).group(1).split(",")]
    assert degrees == [1, 2, 4, 8, 16, 32]
    # And it is enforced when loading, not only when launching.
    assert "model_parallel=3" in error(load_config, None, ["--parallel_config.model_parallel", "3"])


def test_model_parallel_must_divide_kv_heads_and_intermediate_size():
    msg = error(validate_layout, layout(n_kv_heads=8, model_parallel=16), None)
    assert "n_kv_heads=8" in msg and re.search(r"\[1, 2, 4, 8\]$", msg)
    msg = error(validate_layout, layout(intermediate_size=11001, model_parallel=2), None)
    assert "intermediate_size=11001" in msg and "[1]" in msg
    validate_layout(layout(n_kv_heads=8, model_parallel=8), None)


def test_more_pipeline_stages_than_layers():
    msg = error(validate_layout, layout(num_layers=2, pipeline_stage=4, micro_batch_num=4), None)
    assert "pipeline_stage=4" in msg and "num_layers=2" in msg
    # Interleaved schedules count virtual stages: 2 ranks x 2 chunks = 4 stages > 3 layers.
    msg = error(
        validate_layout,
        layout(
            num_layers=3, pipeline_stage=2, micro_batch_num=4, pipeline_schedule="interleaved_1f1b", pp_interleave_num=2
        ),
        None,
    )
    assert "4 stages" in msg


def test_too_few_micro_batches_for_1f1b():
    msg = error(validate_layout, layout(pipeline_stage=4, micro_batch_num=2), None)
    assert "micro_batch_num=2" in msg and "pipeline_stage=4" in msg and "gpipe" in msg
    validate_layout(layout(pipeline_stage=4, micro_batch_num=2, pipeline_schedule="gpipe"), None)
    validate_layout(layout(pipeline_stage=4, micro_batch_num=4), None)


def test_offsets():
    assert stage_layer_counts(layout(num_layers=10, pipeline_stage=4, micro_batch_num=4)) == [2, 2, 3, 3]
    assert stage_layer_counts(layout(num_layers=10, pipeline_stage=4, micro_batch_num=4, offset=[1, 1, 0, 0])) == [
        3,
        3,
        2,
        2,
    ]
    for off, needle in (
        ([1, 1, 0], "give 4 integers"),
        ([1, 0, 0, 0], "sum to num_layers=10"),
        ([3, 1, -2, 0], ">= 1"),
        (2, "use 0 (even split) or a list"),
    ):
        msg = error(validate_layout, layout(num_layers=10, pipeline_stage=4, micro_batch_num=4, offset=off), None)
        assert "model.model_config.offset" in msg and needle in msg, msg


def test_override_replaces_a_field_the_file_spells_by_its_alias(tmp_path):
    p = write(tmp_path, "runner_config:\n  train_steps: 100\nmodel:\n  model_config:\n    rotary_emb_base: 500000\n")
    cfg = load_config(p, ["--runner_config.stop_step", "20", "--model.model_config.theta", "1000"])
    assert cfg.runner_config.stop_step == 20 and cfg.model.model_config.theta == 1000.0


def test_numeric_looking_strings_from_the_command_line_stay_strings():
    assert load_config(None, ["--output_dir", "2024"]).output_dir == "2024"


@pytest.mark.parametrize(
    "yaml_text, field, fix",
    [
        ("moe_config:\n  expert_num: 8\n", "model.model_config.moe_config.expert_num", "Qwen3MoeConfig"),
        ("model:\n  model_config:\n    extend_method: NTK\n", "model.model_config.extend_method", "rope_scaling"),
        (
            "model:\n  model_config:\n    scaling_factor: 4.0\n",
            "model.model_config.scaling_factor",
            "scaling_factor: 1.0",
        ),
        ("model:\n  model_config:\n    rotary_pct: 0.5\n", "model.model_config.rotary_pct", "rotary_pct: 1.0"),
        ("model:\n  model_config:\n    emb_dropout_prob: 0.1\n", "model.model_config.emb_dropout_prob", "0.0"),
    ],
)
def test_mindspore_blocks_that_change_the_model_are_refused(tmp_path, yaml_text, field, fix):
    import meshformer.models  # noqa: F401  (the families name the MoE types the check lists)

    msg = error(load_config, write(tmp_path, yaml_text))
    assert msg.startswith(field + "=") and fix in msg and "\n" not in msg


def test_a_mindspore_top_level_moe_config_is_read_under_the_model(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            "model:\n  model_config:\n    type: Qwen3MoeConfig\nmoe_config:\n  expert_num: 8\n"
            "  num_experts_chosen: 2\n  routing_policy: TopkRouterV2\n",
        )
    )
    assert cfg.model.model_config.moe_config.expert_num == 8 and cfg.model.model_config.is_moe
    msg = error(load_config, write(tmp_path, "moe_config:\n  expert_num: two\n"))
    assert msg.startswith("model.model_config.moe_config.expert_num must be an integer")


def test_mindspore_model_keys_at_their_neutral_values_are_accepted_with_a_notice(tmp_path):
    notices: list[str] = []
    load_config(
        write(
            tmp_path,
            'moe_config:\n  expert_num: 1\nmodel:\n  model_config:\n    extend_method: "None"\n'
            "    scaling_factor: 1.0\n    rotary_pct: 1.0\n    emb_dropout_prob: 0.0\n",
        ),
        notices=notices,
    )
    assert len(notices) == 4 and all("MindSpore-only" in n for n in notices)


def test_derived_shapes_are_model_config_properties():
    from meshformer.config.schema import ModelConfig

    mc = ModelConfig(hidden_size=4096, num_heads=32)
    assert (mc.num_kv_heads, mc.dim_per_head, mc.ffn_hidden_size) == (32, 128, 11008)  # Llama 2 7B
    mc = ModelConfig(hidden_size=4096, num_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024)
    assert (mc.num_kv_heads, mc.ffn_hidden_size) == (8, 14336)  # Llama 3 8B
    assert ModelConfig(hidden_size=64, num_heads=4, head_dim=32, intermediate_size=100).dim_per_head == 32
    assert not {"num_kv_heads", "dim_per_head", "ffn_hidden_size"} & set(ModelConfig.__dataclass_fields__)


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_numbers_are_refused(tmp_path, value):
    msg = error(load_config, write(tmp_path, f"optimizer:\n  learning_rate: {value}\n"))
    assert msg.startswith("optimizer.learning_rate=") and ("finite" in msg or "out of range" in msg)


def test_a_config_without_a_model_section_gets_its_familys_class():
    """The default model config is the default type's class, with that family's own fields (a bare ModelConfig
    lacked them, and counting its parameters raised AttributeError)."""
    from meshformer.config.fields import MODEL_CONFIGS
    from meshformer.models.registry import family_of

    mc = load_config(None, []).model.model_config
    assert type(mc) is MODEL_CONFIGS.class_of(mc.type)
    assert family_of(mc).param_count(mc) > 6 * 10**9  # the default: Llama 2 7B's shape


def test_what_the_loader_records_is_no_setting(tmp_path):
    """model_fields_given (which model fields the file set, for run_mode finetune) is declared on the config, but
    it is no setting: not read from YAML, not saved, not explained."""
    from meshformer.cli.config_cmd import explain_text
    from meshformer.config.load import to_dict

    cfg = load_config(None, ["--model.model_config.num_layers", "2"])
    assert cfg.model_fields_given == {"num_layers"}
    assert "model_fields_given" not in to_dict(cfg) and "model_fields_given" not in explain_text()
    with pytest.raises(UserError, match="unknown config key 'model_fields_given'"):
        load_config(None, ["--model_fields_given", "[]"])
