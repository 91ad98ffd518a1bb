"""The GLM-4 family's entry in the model-family registry: what its folder's modules do not say by their names."""

from meshformer.models.glm4 import config, gguf, hf, model
from meshformer.models.llama.model import CP_ATTENTION
from meshformer.models.registry import folder_family, register_family

# activation_model None: the planner counts activations on the real modules (planner/counted_activations.py), which
# keep the two post-block norms' inputs that Llama's formulas leave out
GLM4 = folder_family(
    "glm4", model.Glm4Transformer, config, hf, model, gguf, activation_model=None, cp_attention=CP_ATTENTION
)
register_family(GLM4)
