"""The Llama family's entry in the model-family registry: what its folder's modules do not say by their names."""

from meshformer.models.llama import config, gguf, hf, model
from meshformer.models.llama.activations import LLAMA_ACTIVATIONS
from meshformer.models.llama.mindspore_names import from_mindspore, mindspore_name, to_mindspore
from meshformer.models.registry import MindSporeNames, folder_family, register_family

LLAMA = folder_family(
    "llama",
    model.Transformer,
    config,
    hf,
    model,
    gguf,
    activation_model=LLAMA_ACTIVATIONS,
    mindspore_names=MindSporeNames(from_mindspore, to_mindspore, mindspore_name),
    cp_attention=model.CP_ATTENTION,
)
register_family(LLAMA)
