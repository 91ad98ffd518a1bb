"""The Mistral family's entry in the model-family registry (models/registry.py `BUILTIN_FAMILIES` names the
folder; the registry imports this module on first use)."""

from meshformer.models.llama.model import Attention, param_count, tp_plan
from meshformer.models.mistral.config import CONFIG_CLASSES, SHAPE_FIELDS
from meshformer.models.mistral.hf import HF_MODEL_TYPES, config_from_hf, config_to_hf
from meshformer.models.mistral.model import MistralTransformer
from meshformer.models.registry import ModelFamily, register_family

MISTRAL = ModelFamily(
    name="mistral",
    config_types=CONFIG_CLASSES,
    hf_model_types=HF_MODEL_TYPES,
    build=MistralTransformer,
    tp_plan=tp_plan,
    param_count=param_count,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    # None: the planner counts activations on the real modules (planner/counted_activations.py), which keep the
    # window's banded mask that Llama's formulas leave out
    activation_model=None,
    shape_fields=SHAPE_FIELDS,
    cp_attention={Attention: {"attend": "attend"}},
)
register_family(MISTRAL)
