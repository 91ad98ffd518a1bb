"""The Mistral family's entry in the model-family registry: what its folder's modules do not say by their names."""

from meshformer.models.llama import model as llama_model
from meshformer.models.mistral import config, hf, model
from meshformer.models.registry import folder_family, register_family

# Llama's weights, so Llama's count and TP plan. activation_model None: the planner counts activations on the real
# modules (planner/counted_activations.py), which keep the window's banded mask that Llama's formulas leave out
MISTRAL = folder_family(
    "mistral",
    model.MistralTransformer,
    config,
    hf,
    llama_model,
    activation_model=None,
    cp_attention=llama_model.CP_ATTENTION,
)
register_family(MISTRAL)
