"""The parity suite's cases and variants: the layouts (CASES, EP_CASES), the models and settings run under them
(VARIANTS and the FP8, preference and distillation tables), as config overrides. tests/dist/harness.py builds and
runs them; tests read them as `harness.X`, which re-exports every name here.
"""

from __future__ import annotations

from meshformer.config.schema import PIPELINE_SCHEDULES

STEPS = 5
GLOBAL_BATCH = 16
SEQ = 16
VOCAB = 128

# A tiny Llama with every optional piece switched on: GQA (8 q heads, 4 kv heads), q/k/v bias (Qwen2),
# q/k norm (Qwen3). 4 layers so pp2 with two virtual stages per rank has one layer per stage.
MODEL = {
    "model.model_config.hidden_size": 64,
    "model.model_config.num_layers": 4,
    "model.model_config.num_heads": 8,
    "model.model_config.n_kv_heads": 4,
    "model.model_config.intermediate_size": 128,
    "model.model_config.vocab_size": VOCAB,
    "model.model_config.seq_length": SEQ,
    "model.model_config.qkv_has_bias": True,
    "model.model_config.use_qk_norm": True,
    "seed": 7,
    # AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1 off norms and biases) at a constant rate, clipped at 1.0.
    "optimizer.learning_rate": 1e-3,
    "lr_schedule.type": "constant",
    "optimizer.weight_decay": 0.1,
    "runner_wrapper.max_grad_norm": 1.0,
    # fp32 linears on oneDNN on every CPU (auto picks it only on some): each layout proves it against the single
    # process; tensor parallelism's DTensor weights and the zero-bubble schedules take BLAS (backends/cpu.py).
    "cpu_matmul": "onednn",
}

DROP = object()  # a variant's value that removes MODEL's key (a field the variant's family does not have)

# name -> (overrides, micro-batches per step on each rank). World size = dp x tp x pp of the overrides.
P = "parallel_config."
CASES = {
    # 2 processes
    "dp2": ({P + "data_parallel": 2}, 1),
    "dp2_accum": ({P + "data_parallel": 2}, 4),
    "dp2_rc_accum": ({P + "data_parallel": 2, "recompute_config.recompute": True}, 2),
    "tp2": ({P + "model_parallel": 2}, 1),
    "tp2_sp_accum": ({P + "model_parallel": 2, P + "use_seq_parallel": True}, 2),
    "tp2_sp_rc": ({P + "model_parallel": 2, P + "use_seq_parallel": True, "recompute_config.recompute": True}, 1),
    "fsdp2": ({P + "data_parallel": 2, P + "optimizer_shard": True}, 1),
    "fsdp2_zero3_rc_accum": (
        {
            P + "data_parallel": 2,
            P + "optimizer_shard": True,
            "recompute_config.recompute": True,
            "recompute_config.parallel_optimizer_comm_recompute": True,
        },
        2,
    ),
    **{
        f"pp2_{s}{rc}": (
            {
                P + "pipeline_stage": 2,
                P + "micro_batch_num": 4,
                P + "pipeline_schedule": s,
                P + "pp_interleave_num": 2 if s in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble") else 1,
                "recompute_config.recompute": rc == "_rc",
            },
            4,
        )
        for s in PIPELINE_SCHEDULES
        for rc in ("", "_rc")
    },
    "pp2_1f1b_rc_accum": ({P + "pipeline_stage": 2, P + "micro_batch_num": 4, "recompute_config.recompute": [1, 2]}, 8),
    # selective recompute (keep matmul/attention/collective outputs, recompute the element-wise work)
    "dp2_sel_accum": ({P + "data_parallel": 2, "recompute_config.select_recompute": True}, 2),
    "tp2_sp_sel": (
        {P + "model_parallel": 2, P + "use_seq_parallel": True, "recompute_config.select_recompute": True},
        1,
    ),
    "fsdp2_offload_accum": ({P + "data_parallel": 2, P + "optimizer_shard": True, P + "cpu_offload": True}, 2),
    "fsdp2_sel": ({P + "data_parallel": 2, P + "optimizer_shard": True, "recompute_config.select_recompute": True}, 1),
    "pp2_1f1b_sel": (
        {P + "pipeline_stage": 2, P + "micro_batch_num": 4, "recompute_config.select_recompute": [1, 2]},
        4,
    ),
    "pp2_interleaved_1f1b_sel": (
        {
            P + "pipeline_stage": 2,
            P + "micro_batch_num": 4,
            P + "pp_interleave_num": 2,
            P + "pipeline_schedule": "interleaved_1f1b",
            "recompute_config.select_recompute": True,
        },
        4,
    ),
    "tp2_sel": ({P + "model_parallel": 2, "recompute_config.select_recompute": True}, 2),
    # 4 processes
    "dp4": ({P + "data_parallel": 4}, 1),
    "tp4_sp": ({P + "model_parallel": 4, P + "use_seq_parallel": True}, 1),
    "fsdp4_accum": ({P + "data_parallel": 4, "optimizer.optimizer_parallel": 4}, 2),
    "hsdp2x2_rc": ({P + "data_parallel": 4, "optimizer.optimizer_parallel": 2, "recompute_config.recompute": True}, 1),
    "dp4_rc_accum": ({P + "data_parallel": 4, "recompute_config.recompute": True}, 2),
    "tp4_rc_accum": ({P + "model_parallel": 4, "recompute_config.recompute": True}, 2),
    "fsdp4_rc": ({P + "data_parallel": 4, "optimizer.optimizer_parallel": 4, "recompute_config.recompute": True}, 1),
    "hsdp2x2_accum": ({P + "data_parallel": 4, "optimizer.optimizer_parallel": 2}, 2),
    "dp2xtp2": ({P + "data_parallel": 2, P + "model_parallel": 2}, 2),
    "dp2xtp2_rc": ({P + "data_parallel": 2, P + "model_parallel": 2, "recompute_config.recompute": True}, 1),
    "dp2xtp2_rc_sel": (
        {
            P + "data_parallel": 2,
            P + "model_parallel": 2,
            "recompute_config.recompute": [2],
            "recompute_config.select_recompute": True,
        },
        2,
    ),
    "fsdp2xtp2_sp_rc": (
        {
            P + "data_parallel": 2,
            P + "model_parallel": 2,
            P + "use_seq_parallel": True,
            "parallel.enable_parallel_optimizer": True,
            "recompute_config.recompute": True,
        },
        1,
    ),
    "tp2xpp2_sp": (
        {P + "model_parallel": 2, P + "pipeline_stage": 2, P + "micro_batch_num": 4, P + "use_seq_parallel": True},
        4,
    ),
    "tp2xpp2_rc_accum": (
        {
            P + "model_parallel": 2,
            P + "pipeline_stage": 2,
            P + "micro_batch_num": 2,
            "recompute_config.recompute": True,
        },
        4,
    ),
    "dp2xpp2": ({P + "data_parallel": 2, P + "pipeline_stage": 2, P + "micro_batch_num": 2}, 2),
    "dp2xpp2_rc": (
        {P + "data_parallel": 2, P + "pipeline_stage": 2, P + "micro_batch_num": 2, "recompute_config.recompute": True},
        4,
    ),
    "fsdp2xpp2": (
        {
            P + "data_parallel": 2,
            P + "pipeline_stage": 2,
            P + "micro_batch_num": 4,
            P + "optimizer_shard": True,
            P + "pipeline_schedule": "interleaved_1f1b",
            P + "pp_interleave_num": 2,
        },
        4,
    ),
    # 8 processes
    "dp2xtp2xpp2": (
        {P + "data_parallel": 2, P + "model_parallel": 2, P + "pipeline_stage": 2, P + "micro_batch_num": 2},
        2,
    ),
    "dp2xtp2xpp2_rc_accum": (
        {
            P + "data_parallel": 2,
            P + "model_parallel": 2,
            P + "pipeline_stage": 2,
            P + "micro_batch_num": 2,
            "recompute_config.recompute": True,
        },
        4,
    ),
    "dp2xtp2xpp2_sel": (
        {
            P + "data_parallel": 2,
            P + "model_parallel": 2,
            P + "pipeline_stage": 2,
            P + "micro_batch_num": 2,
            "recompute_config.select_recompute": True,
        },
        2,
    ),
    "fsdp2xtp2xpp2_sp_rc": (
        {
            P + "data_parallel": 2,
            P + "model_parallel": 2,
            P + "pipeline_stage": 2,
            P + "micro_batch_num": 2,
            P + "optimizer_shard": True,
            P + "use_seq_parallel": True,
            "recompute_config.recompute": True,
        },
        4,
    ),
}
# Expert parallelism, run with the "moe" variant: ep borrows the parameter-sharding data-parallel ranks.
EP_CASES = {
    "fsdp2_ep2": ({P + "data_parallel": 2, P + "optimizer_shard": True, P + "expert_parallel": 2}, 1),
    "fsdp2_ep2_rc_accum": (
        {
            P + "data_parallel": 2,
            P + "optimizer_shard": True,
            P + "expert_parallel": 2,
            "recompute_config.recompute": True,
        },
        2,
    ),
    "fsdp2_ep2_sel": (
        {
            P + "data_parallel": 2,
            P + "optimizer_shard": True,
            P + "expert_parallel": 2,
            "recompute_config.select_recompute": True,
        },
        2,
    ),
    "fsdp4_ep4": ({P + "data_parallel": 4, P + "optimizer_shard": True, P + "expert_parallel": 4}, 1),
    "fsdp4_ep2_accum": ({P + "data_parallel": 4, P + "optimizer_shard": True, P + "expert_parallel": 2}, 2),
    "hsdp2x2_ep2": ({P + "data_parallel": 4, "optimizer.optimizer_parallel": 2, P + "expert_parallel": 2}, 1),
    "fsdp2xtp2_ep2": (
        {P + "data_parallel": 2, P + "optimizer_shard": True, P + "model_parallel": 2, P + "expert_parallel": 2},
        2,
    ),
    "fsdp2xtp2_sp_ep2_sel": (
        {
            P + "data_parallel": 2,
            P + "optimizer_shard": True,
            P + "model_parallel": 2,
            P + "use_seq_parallel": True,
            P + "expert_parallel": 2,
            "recompute_config.select_recompute": True,
        },
        1,
    ),
    "fsdp2xpp2_ep2": (
        {
            P + "data_parallel": 2,
            P + "optimizer_shard": True,
            P + "pipeline_stage": 2,
            P + "micro_batch_num": 4,
            P + "expert_parallel": 2,
        },
        4,
    ),
    "fsdp8_ep4_accum": ({P + "data_parallel": 8, P + "optimizer_shard": True, P + "expert_parallel": 4}, 2),
    "fsdp4xtp2_ep4_rc": (
        {
            P + "data_parallel": 4,
            P + "optimizer_shard": True,
            P + "model_parallel": 2,
            P + "expert_parallel": 4,
            "recompute_config.recompute": True,
        },
        1,
    ),
    "fsdp2xtp2xpp2_ep2": (
        {
            P + "data_parallel": 2,
            P + "optimizer_shard": True,
            P + "model_parallel": 2,
            P + "pipeline_stage": 2,
            P + "micro_batch_num": 2,
            P + "expert_parallel": 2,
        },
        2,
    ),
}
# Variants of the model (each has its own single-process reference).
VARIANTS = {
    "fp32": {},
    "tied": {"model.model_config.tie_word_embeddings": True, "model.model_config.use_qk_norm": False},
    "bf16": {"model.model_config.compute_dtype": "bfloat16"},
    "fp16": {"model.model_config.compute_dtype": "float16"},  # dynamic loss scaling from 2^16 (train/loss_scale.py)
    "wrapped": {},  # fp32, the decoder's linears wrapped by a model transform (VARIANT_TRANSFORMS)
    # LoRA on column- (q, v, gate) and row-parallel (o, down) linears; the rest frozen.
    "lora": {
        "model.model_config.pet_config.pet_type": "lora",
        "model.model_config.pet_config.lora_rank": 4,
        "model.model_config.pet_config.target_modules": ".*q_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj",
    },
    # QLoRA: LoRA over an NF4 base (models/qlora.py), 256 wide so an FSDP shard holds whole NF4 scaler blocks
    # (k_proj: 128 x 256 = 512 blocks of 64 = 2 scaler blocks of 256).
    "qlora": {
        "model.model_config.pet_method": "qlora",
        "model.model_config.pet_config.lora_rank": 4,
        "model.model_config.pet_config.target_modules": ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj",
        "model.model_config.hidden_size": 256,
        "model.model_config.intermediate_size": 512,
    },
    "packed": {},  # fp32, every row packs several documents (batches(packed=True)): document masking
    "compiled": {"compile": True},  # fp32, every decoder layer through torch.compile (Inductor's C++ on a CPU)
    # Qwen3-MoE-shaped: every layer 8 routed experts, top-2 (the expert-parallel cases)
    "moe": {
        "model.model_config.type": "Qwen3MoeConfig",
        "model.model_config.moe_config.expert_num": 8,
        "model.model_config.moe_config.num_experts_chosen": 2,
        "model.model_config.moe_config.moe_intermediate_size": 32,
    },
}
# The MoE model with every balancing term: global-batch and sequence-wise losses, z-loss, the routing-bias update
# (a rate large enough to move the routes within the run); "moe_bal_seq" without the global-batch loss, which
# pipeline parallelism refuses.
BALANCE = {
    **VARIANTS["moe"],
    "model.model_config.moe_config.aux_loss_types": ["global_batch", "sequence"],
    "model.model_config.moe_config.aux_loss_factors": [0.01, 0.001],
    "model.model_config.moe_config.z_loss_factor": 0.001,
    "model.model_config.moe_config.balance_via_topk_bias": True,
    "model.model_config.moe_config.topk_bias_update_rate": 0.01,
}
VARIANTS["moe_bal"] = BALANCE
# LoRA on attention and on the dense MLP of layer 0 (mlp_only_layers); routers and experts frozen.
VARIANTS["moe_lora"] = {
    **VARIANTS["moe"],
    **VARIANTS["lora"],
    "model.model_config.moe_config.mlp_only_layers": [0],
}
VARIANTS["moe_bf16"] = {**VARIANTS["moe"], **VARIANTS["bf16"]}
# DeepSeek-V3-shaped: latent attention (low-rank queries, YaRN, interleaved rotary), a shared expert, sigmoid
# routing with the score-correction bias (moved by the bias update), group-limited top-k, routed scaling, the first
# layer dense; sequence-wise balancing loss.
_M, _E = "model.model_config.", "model.model_config.moe_config."
VARIANTS["deepseek_v3"] = {
    _M + "type": "DeepseekV3Config", _M + "qkv_has_bias": False, _M + "use_qk_norm": False,
    _M + "q_lora_rank": 32, _M + "kv_lora_rank": 16, _M + "qk_rope_head_dim": 8, _M + "qk_nope_head_dim": 16,
    _M + "v_head_dim": 12, _M + "rope_interleave": True, _M + "rope_scaling.type": "yarn",
    _M + "rope_scaling.factor": 4.0, _M + "rope_scaling.original_max_position_embeddings": 8,
    _M + "rope_scaling.mscale_all_dim": 1.0,
    _E + "expert_num": 8, _E + "num_experts_chosen": 2, _E + "moe_intermediate_size": 32, _E + "shared_expert_num": 1,
    _E + "use_gating_sigmoid": True, _E + "topk_method": "noaux_tc", _E + "n_group": 4, _E + "topk_group": 2,
    _E + "routed_scaling_factor": 2.5, _E + "first_k_dense_replace": 1,
    _E + "aux_loss_types": ["sequence"], _E + "aux_loss_factors": [0.001],
    _E + "balance_via_topk_bias": True, _E + "topk_bias_update_rate": 0.01,
}  # fmt: skip
# tests/parity/test_expert_parallel.py
MOE_VARIANTS = ("moe", "moe_bal", "moe_bal_seq", "moe_lora", "moe_bf16", "deepseek_v3", "gpt_oss")
# DeepSeek-V3 with the global-batch balancing loss instead of the sequence-wise one
# (tests/parity/test_context_parallel.py runs both); "_packed": every row packs several documents, as "packed"
VARIANTS["deepseek_v3_gb"] = {
    **VARIANTS["deepseek_v3"],
    _E + "aux_loss_types": ["global_batch"],
    _E + "aux_loss_factors": [0.01],
}
VARIANTS["deepseek_v3_gb_packed"] = VARIANTS["deepseek_v3_gb"]
# Mistral-shaped: Llama's decoder without q/k/v bias or q/k norm, every layer's attention a sliding window of
# SEQ // 4 keys (shorter than the row and than a cp2 chunk pair, so it is active under every layout).
WINDOW = SEQ // 4
VARIANTS["mistral"] = {
    _M + "type": "MistralConfig", _M + "qkv_has_bias": False, _M + "use_qk_norm": False,
    _M + "sliding_window": WINDOW,
}  # fmt: skip
# GPT-OSS-shaped: biased attention with learned sinks, layers alternating a sliding window of SEQ // 4 keys and full
# attention, YaRN (truncate false), every layer 8 experts top-2 with router and expert biases and the clamped SwiGLU.
VARIANTS["gpt_oss"] = {
    _M + "type": "GptOssConfig", _M + "use_qk_norm": False, _M + "sliding_window": WINDOW,
    _M + "rope_scaling.type": "yarn", _M + "rope_scaling.factor": 4.0,
    _M + "rope_scaling.original_max_position_embeddings": 8,
    _E + "expert_num": 8, _E + "num_experts_chosen": 2, _E + "moe_intermediate_size": 32,
}  # fmt: skip
# GLM-4-shaped: q/k/v biases, no q/k norm, the rotary turning half of each head (4 of 8 channels, adjacent pairs)
# and the post-attention / post-MLP norms (models/glm4/).
VARIANTS["glm4"] = {
    _M + "type": "Glm4Config", _M + "qkv_has_bias": True, _M + "use_qk_norm": False,
    _M + "partial_rotary_factor": 0.5,
}  # fmt: skip
# Gemma 3-shaped: sliding (window SEQ // 4) and global layers in turn, each kind with its own rotary base (the global
# one linearly scaled), a score scale other than 1/sqrt(head_dim); untied (pp2 splits it). Gemma has q/k norms and no
# q/k/v biases by construction: MODEL's two switches are dropped, not overridden.
VARIANTS["gemma3"] = {
    _M + "type": "Gemma3Config", _M + "qkv_has_bias": DROP, _M + "use_qk_norm": DROP,
    _M + "sliding_window": WINDOW, _M + "sliding_window_pattern": 2, _M + "query_pre_attn_scalar": 16,
    _M + "rope_local_base_freq": 1e3, _M + "global_rope_scaling_factor": 2.0, _M + "tie_word_embeddings": False,
}  # fmt: skip
VARIANTS["moe_bal_seq"] = {
    **BALANCE,
    "model.model_config.moe_config.aux_loss_types": ["sequence"],
    "model.model_config.moe_config.aux_loss_factors": [0.001],
}

# FP8 linears (fp8_config, tests/parity/test_fp8_parity.py), kept apart from VARIANTS (whose every entry the other
# parity files run as a reference): "fp8" as a user runs it (bf16 compute, tensorwise), and the same recipes over
# fp32 activations ("_fp32": the config refuses that mix for users, FP8_FP32 sets it after validation) so that the
# layouts' FP8 arithmetic is compared without bf16's rounding noise on top.
FP8_VARIANTS = {
    "fp8": {**VARIANTS["bf16"], "fp8_config.enable": True},
    "fp8_fp32": {**VARIANTS["bf16"], "fp8_config.enable": True},
    "fp8_gw_fp32": {**VARIANTS["bf16"], "fp8_config.enable": True, "fp8_config.recipe": "rowwise_with_gw_hp"},
    "fp8_rw_fp32": {**VARIANTS["bf16"], "fp8_config.enable": True, "fp8_config.recipe": "rowwise"},
}
FP8_FP32 = ("fp8_fp32", "fp8_gw_fp32", "fp8_rw_fp32")
# fp8_fp32 on a Llama without q/k/v biases or q/k norms (docs/benchmarks.md "FP8 layouts against one process":
# under tp2 an FP8 flip lands already at step 1 there, against the one process that sums as tp2).
FP8_VARIANTS["fp8_plain_fp32"] = {
    **FP8_VARIANTS["fp8_fp32"],
    "model.model_config.qkv_has_bias": False,
    "model.model_config.use_qk_norm": False,
}
FP8_FP32 = (*FP8_FP32, "fp8_plain_fp32")
# GPT-OSS in FP8 over fp32 activations: a biased row-parallel o_proj under tp2.
FP8_VARIANTS["fp8_gpt_oss_fp32"] = {**FP8_VARIANTS["fp8_fp32"], **VARIANTS["gpt_oss"]}
FP8_FP32 = (*FP8_FP32, "fp8_gpt_oss_fp32")

# Preference training (tests/parity/test_preference_layouts.py): DPO against a frozen copy of the starting weights
# with three loss types at once (sigmoid; ipo, which divides by each completion's length; sft, the token mean over
# the chosen completions), every pair two adjacent rows; with LoRA against the adapters-off reference; on the MoE
# model. Their own table, so the SFT suites' references do not grow.
PREFERENCE_VARIANTS = {
    "dpo": {"preference_config.method": "dpo", "preference_config.loss_type": "[sigmoid, ipo, sft]",
            "preference_config.loss_weights": "[1.0, 0.5, 0.2]", "preference_config.beta": 0.5},
}  # fmt: skip
PREFERENCE_VARIANTS["dpo_lora"] = {
    **VARIANTS["lora"],
    **PREFERENCE_VARIANTS["dpo"],
    "preference_config.reference": "adapter",
}
PREFERENCE_VARIANTS["dpo_moe"] = {**VARIANTS["moe"], **PREFERENCE_VARIANTS["dpo"]}
# SimPO: no reference, per-token mean log-probs (so it runs under pipeline parallelism too)
PREFERENCE_VARIANTS["simpo"] = {"preference_config.method": "simpo", "preference_config.beta": 2.0}
# DPO under bf16 autocast (tests/parity/test_preference_layouts.py BF16_RTOL)
PREFERENCE_VARIANTS["dpo_bf16"] = {**PREFERENCE_VARIANTS["dpo"], **VARIANTS["bf16"]}
# DPO against log-probs computed once before step 1 (train/precomputed_reference.py): the run `dpo` is
PREFERENCE_VARIANTS["dpo_pre"] = {**PREFERENCE_VARIANTS["dpo"], "preference_config.reference": "precomputed"}
# what a preference step adds to each step's record (TRL's names; KTO logs no accuracies: 0 on both sides)
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")
# ORPO (its NLL covers the chosen rows' prompt tokens: marked labels) and KTO (every other example undesirable,
# every odd row its KL row, z0 over the global batch)
PREFERENCE_VARIANTS["orpo"] = {"preference_config.method": "orpo", "preference_config.beta": 0.5}
PREFERENCE_VARIANTS["kto"] = {
    "preference_config.method": "kto", "preference_config.beta": 0.5, "preference_config.desirable_weight": 1.5,
    "preference_config.undesirable_weight": 0.8,
}  # fmt: skip
# Distillation (tests/parity/test_distill_layouts.py): the JSD over the teacher's top 16 tokens at temperature 1.5,
# mixed with the cross-entropy (alpha 0.6). The teacher is a Hugging Face directory the test writes, its path in
# the environment (DISTILL_TEACHER_ENV): it must exist when the config is read, which checks its vocabulary.
DISTILL_VARIANTS = {
    "distill": {"distill_config.loss": "jsd", "distill_config.beta": 0.3, "distill_config.temperature": 1.5,
                "distill_config.alpha": 0.6, "distill_config.top_k": 16},
}  # fmt: skip
DISTILL_TEACHER_ENV = "MESHFORMER_TEST_TEACHER"
