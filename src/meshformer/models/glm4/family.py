"""The GLM-4 family's entry in the model-family registry (models/registry.py `BUILTIN_FAMILIES` names the
folder; the registry imports this module on first use)."""

from meshformer.models.glm4.config import CONFIG_CLASSES, SHAPE_FIELDS
from meshformer.models.glm4.gguf import GGUF_NAMES
from meshformer.models.glm4.hf import HF_MODEL_TYPES, config_from_hf, config_to_hf, join_gate_up, split_gate_up
from meshformer.models.glm4.model import Glm4Transformer, param_count, tp_plan
from meshformer.models.llama.model import Attention
from meshformer.models.registry import ModelFamily, register_family

GLM4 = ModelFamily(
    name="glm4",
    config_types=CONFIG_CLASSES,
    hf_model_types=HF_MODEL_TYPES,
    build=Glm4Transformer,
    tp_plan=tp_plan,
    param_count=param_count,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    from_hf_tensors=split_gate_up,
    to_hf_tensors=join_gate_up,
    gguf_names=GGUF_NAMES,
    # None: the planner counts activations on the real modules (planner/counted_activations.py), which keep the
    # two post-block norms' inputs that Llama's formulas leave out
    activation_model=None,
    shape_fields=SHAPE_FIELDS,
    cp_attention={Attention: {"attend": "attend"}},
)
register_family(GLM4)
