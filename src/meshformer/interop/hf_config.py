"""Hugging Face `config.json` <-> `model.model_config`, dispatched to the model family that owns the architecture
(models/registry.py; the Llama family's mapping is models/llama/hf.py).

A config.json no model can have (an `mlp_only_layers` entry past the last layer, `n_group` not dividing the routed
experts) is refused here, naming config.json's own field and the fix, before anything is built: transformers
would fail on it (or route differently) long after the import said it worked."""

from __future__ import annotations

from meshformer.config.schema import ModelConfig
from meshformer.errors import UserError

# Our size fields under config.json's names, for messages about an import's sizes (models/sizes.py size_fields).
HF_SIZE_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "shared_expert_num": "n_shared_experts",
}
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")  # Qwen-MoE, DeepSeek, Mixtral


def model_config_from_hf(hf: dict, where: str = "config.json") -> dict:
    """The `model.model_config` fields (a dict for the config loader) of a Hugging Face config.json."""
    from meshformer.models.registry import family_for_hf

    if not isinstance(hf, dict):
        raise UserError(f"{where}: expected a JSON object")
    family, _ = family_for_hf(hf, where)
    fields = family.config_from_hf(hf, where)
    if isinstance(fields.get("moe_config"), dict):
        check_hf_moe(hf, fields, where)
    return fields


def hf_size_names(hf: dict) -> dict[str, str]:
    """Our size fields -> the names this config.json gives them."""
    experts = next((k for k in EXPERT_COUNT_KEYS if k in hf), "num_experts")
    return {**HF_SIZE_NAMES, "expert_num": experts}


def check_hf_moe(hf: dict, fields: dict, where: str) -> None:
    """One line naming config.json's field and the fix for MoE routing no model can have (`fields`: the family's
    mapping of hf, with its `moe_config`)."""
    moe, layers = fields["moe_config"], fields["num_layers"]
    experts, key = moe.get("expert_num"), hf_size_names(hf)["expert_num"]
    top_k, n_group, topk_group = moe.get("num_experts_chosen", 1), moe.get("n_group", 1), moe.get("topk_group", 1)
    step, first = moe.get("decoder_sparse_step", 1), moe.get("first_k_dense_replace", 0)
    dense = moe.get("mlp_only_layers") or []

    def refuse(text: str):
        raise UserError(f"{where}: {text}")

    if not _count(step) or step < 1:
        refuse(
            f"decoder_sparse_step={step!r}: layer i is sparse when (i + 1) % decoder_sparse_step == 0, so it must "
            f"be an integer >= 1: set 1 to make every layer sparse"
        )
    if not _count(top_k) or not 1 <= top_k <= experts:
        refuse(f"num_experts_per_tok={top_k!r}: a token goes to 1 to {key}={experts} experts: set it in that range")
    if not _count(n_group) or n_group < 1 or experts % n_group:
        refuse(
            f"n_group={n_group!r} does not divide {key}={experts}: the experts are split into n_group equal groups; "
            f"set n_group to a divisor of {experts} (1 for no groups)"
        )
    if not _count(topk_group) or not 1 <= topk_group <= n_group:
        refuse(
            f"topk_group={topk_group!r} exceeds n_group={n_group}: a token picks topk_group of the n_group groups; "
            f"set topk_group between 1 and {n_group}"
        )
    if not _count(first) or not 0 <= first < layers:
        refuse(
            f"first_k_dense_replace={first!r} leaves none of the num_hidden_layers={layers} layers sparse: set it "
            f"below {layers}"
        )
    bad = [i for i in dense if not _count(i) or not 0 <= i < layers]
    if bad:
        refuse(
            f"mlp_only_layers names {bad[:5]}, not layers of the num_hidden_layers={layers} (0 to {layers - 1}): "
            f"remove them, or correct num_hidden_layers"
        )
    listed = {i for i in dense if first <= i < layers and (i + 1) % step == 0}
    if layers // step - first // step - len(listed) < 1:  # ModelConfig.moe_layer_count, before there is one
        refuse(
            f"no layer is sparse (first_k_dense_replace={first}, decoder_sparse_step={step}, mlp_only_layers="
            f"{dense}): the model would have no experts; remove layers from mlp_only_layers"
        )


def _count(value) -> bool:
    """An integer (JSON's true is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_import_sizes(mc: ModelConfig, hf: dict, tensors: dict, where: str) -> None:
    """Before the model is built: sizes whose weights alone exceed this machine's memory (a typo, named with the
    bytes), then a config that claims more parameters than the file holds (`tensors`: ours, by our names)."""
    from meshformer.models.registry import family_of
    from meshformer.models.sizes import check_weights_fit, size_fields

    names = hf_size_names(hf)
    check_weights_fit(mc, "cpu", where, names)
    claimed, held = family_of(mc).param_count(mc), sum(t.numel() for t in tensors.values())
    if held < claimed:
        raise UserError(
            f"{where}: {claimed:,} parameters ({size_fields(mc, names)}), but the weights hold {held:,}: the "
            f"model directory is damaged, or its config.json belongs to another model or has a typo in those sizes"
        )


def hf_config_from_model(mc: ModelConfig, dtype: str) -> dict:
    """A config.json that `transformers` reads back as the same model."""
    from meshformer.models.registry import family_of

    return family_of(mc).config_to_hf(mc, dtype)
