"""The Gemma 3 family's entry in the model-family registry: what its folder's modules do not say by their names."""

from meshformer.models.gemma3 import config, gguf, hf, model
from meshformer.models.llama.model import CP_ATTENTION
from meshformer.models.registry import folder_family, register_family

# activation_model None: the planner counts activations on the real modules (planner/counted_activations.py):
# Llama's formulas know neither the extra norms nor the GeGLU nor the sliding layers' banded masks
GEMMA3 = folder_family(
    "gemma3", model.Gemma3Transformer, config, hf, model, gguf, activation_model=None, cp_attention=CP_ATTENTION
)
register_family(GEMMA3)
