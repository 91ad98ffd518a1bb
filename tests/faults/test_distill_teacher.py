"""A distillation teacher the run's layout does not fit (train/distill_teacher.py teacher_config): one line naming
the teacher, before anything is built; a teacher that fits keeps its own shape at the run's sequence length."""

import pytest

from meshformer.config.load import load_config
from meshformer.config.validate import validate_config
from meshformer.errors import UserError

VOCAB = 96


def test_a_teacher_the_layout_does_not_fit_is_one_line(tmp_path):
    """The teacher is built under the student's layout: tensor parallelism must divide its own heads too."""
    import torch
    import transformers

    from meshformer.interop.base_model import BASE_MODEL_SOURCES
    from meshformer.train.distill_teacher import teacher_config

    hf = tmp_path / "three_heads"
    config = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=3)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(hf)
    extra = "model: {model_config: {vocab_size: 96, hidden_size: 32, num_heads: 4, n_kv_heads: 2}}\n"
    path = tmp_path / "tp.yaml"
    path.write_text(extra + f"distill_config: {{teacher: {hf}}}\nparallel_config: {{model_parallel: 2}}\n")
    cfg = load_config(str(path))
    validate_config(cfg)
    with pytest.raises(UserError, match=r"distill_config.teacher=.* does not fit the run's layout: .*3"):
        teacher_config(cfg, BASE_MODEL_SOURCES)
    path.write_text(extra + f"distill_config: {{teacher: {hf}}}\n")
    taught = teacher_config(load_config(str(path)), BASE_MODEL_SOURCES).model.model_config
    assert (taught.hidden_size, taught.num_heads, taught.num_layers) == (24, 3, 1)  # its own shape ...
    assert taught.seq_length == load_config(str(path)).model.model_config.seq_length  # ... at the run's length
