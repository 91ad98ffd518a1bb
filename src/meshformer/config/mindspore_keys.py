"""MindSpore Transformers keys meshformer does not model: which are accepted and ignored (one notice each), and
which would change the network when set, so are accepted only at the value that leaves the model as meshformer
builds it (config/load.py applies both while it reads a file)."""

from __future__ import annotations

# MindSpore-only keys users carry over from real configs: accepted and ignored, with one notice each.
# MindSpore data-pipeline knobs (columns, process workers, NUMA) that both dataset sections may carry; workers and
# prefetch are schema fields (num_parallel_workers, prefetch_size: meshformer's threads).
_DATASET_IGNORED = frozenset(
    """
    construct_args_key input_columns numa_enable output_columns python_multiprocessing repeat seed
    """.split()
)
IGNORED_KEYS = {
    (): frozenset(
        """
        auto_trans_ckpt auto_tune autotune_per_step context eval_callbacks eval_dataset_task filepath_prefix
        init_start_profile layer_scale load_ckpt_format lr_scale_factor metric only_save_strategy
        pretrained_model_dir profile_communication remote_save_url src_strategy_path_or_dir
        train_dataset_task trainer use_legacy
        """.split()
    ),
    ("parallel",): frozenset({"strategy_ckpt_config", "dataset_strategy"}),
    # The Ulysses share of hybrid_cp, which context_parallel_algo refuses: only colossalai_cp runs.
    ("parallel_config",): frozenset({"ulysses_degree_in_cp"}),
    ("train_dataset",): _DATASET_IGNORED,
    ("eval_dataset",): _DATASET_IGNORED,
    # MindSpore's sharding of a loader over devices: meshformer splits every global batch over data_parallel itself.
    ("train_dataset", "data_loader"): frozenset({"column_names", "num_shards", "shard_id", "phase"}),
    ("eval_dataset", "data_loader"): frozenset({"column_names", "num_shards", "shard_id", "phase"}),
    # The processor's classes and the tokenizer's arguments: meshformer reads the tokenizer.json itself, special
    # tokens and chat template included.
    ("processor",): frozenset({"type", "return_tensors", "max_length"}),
    ("processor", "tokenizer"): frozenset(
        """
        type auto_register merges_file unk_token bos_token eos_token pad_token add_bos_token add_eos_token
        chat_template model_max_length padding_side sp_model_kwargs clean_up_tokenization_spaces legacy errors
        split_special_tokens
        """.split()
    ),
    ("model", "model_config"): frozenset(
        """
        batch_size block_size checkpoint_name_or_path do_sample emb_dropout_prob extend_method
        fine_grain_interleave input_sliced_sig is_dynamic max_decode_length num_blocks
        qkv_concat repetition_penalty rotary_pct router_dense_type scaling_factor top_k top_p
        use_flash_attention use_past use_past_shard
        """.split()
    ),
    # MindSpore's MoE kernels, dispatchers and logging switches: torch picks its own kernels (moe_config.use_gmm
    # says which expert computation runs).
    ("model", "model_config", "moe_config"): frozenset(
        """
        callback_moe_droprate comp_comm_parallel comp_comm_parallel_degree enable_cold_hot_expert enable_deredundency
        enable_gmm_safe_tokens enable_sdrop group_wise_a2a moe_shared_expert_overlap npu_nums_per_device
        routing_policy save_token_distribution use_allgather_dispatcher use_fused_ops_permute use_fused_ops_topkrouter
        """.split()
    ),
}


# MindSpore-only keys that would change the network when set: accepted (with the notice above) only at the value
# that leaves the model as meshformer builds it, otherwise refused, since ignoring them would train a different
# model than the file describes. (path, key) -> (value is harmless, why it is refused and what to do).
MODEL_CHANGING_KEYS = {
    (("model", "model_config"), "extend_method"): (
        lambda v: v in (None, "None", "none"),
        "rotary extension PI/NTK is not supported: use "
        'model.model_config.rope_scaling (type: llama3) or set extend_method: "None"',
    ),
    (("model", "model_config"), "scaling_factor"): (
        lambda v: v in (None, 1, 1.0),
        "rotary position interpolation is not supported: set scaling_factor: 1.0",
    ),
    (("model", "model_config"), "rotary_pct"): (
        lambda v: v in (None, 1, 1.0),
        "partial rotary embeddings are not supported: set rotary_pct: 1.0",
    ),
    (("model", "model_config"), "emb_dropout_prob"): (
        lambda v: v in (None, 0, 0.0),
        "embedding dropout is not supported: set emb_dropout_prob: 0.0",
    ),
}
