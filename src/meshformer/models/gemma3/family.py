"""The Gemma 3 family's entry in the model-family registry (models/registry.py `BUILTIN_FAMILIES` names the
folder; the registry imports this module on first use)."""

from meshformer.models.gemma3.config import CONFIG_CLASSES, SHAPE_FIELDS
from meshformer.models.gemma3.gguf import GGUF_NAMES
from meshformer.models.gemma3.hf import HF_MODEL_TYPES, config_from_hf, config_to_hf
from meshformer.models.gemma3.model import Gemma3Transformer, param_count, tp_plan
from meshformer.models.llama.model import Attention
from meshformer.models.registry import ModelFamily, register_family

GEMMA3 = ModelFamily(
    name="gemma3",
    config_types=CONFIG_CLASSES,
    hf_model_types=HF_MODEL_TYPES,
    build=Gemma3Transformer,
    tp_plan=tp_plan,
    param_count=param_count,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    gguf_names=GGUF_NAMES,
    # None: the planner counts activations on the real modules (planner/counted_activations.py): Llama's formulas
    # know neither the extra norms nor the GeGLU nor the sliding layers' banded masks
    activation_model=None,
    shape_fields=SHAPE_FIELDS,
    cp_attention={Attention: {"attend": "attend"}},
)
register_family(GEMMA3)
