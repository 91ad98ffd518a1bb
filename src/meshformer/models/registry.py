"""Model families: everything that makes one architecture, in one spec the rest of meshformer asks.

A family is one folder under models/ (its config classes, the modules, its config.json mapping, its GGUF names)
plus one `register_family` call; the config loader, the trainer, the planner, the converters and generation look
the family up by the config's `model_config.type` (`family_of`) or by a Hugging Face config.json (`family_for_hf`)
and ask it what varies by architecture (its config class, FLOPs, KV cache, context parallelism, the fields a
fine-tune takes): they never name an architecture, an attention class or a family's field themselves
(tests/unit/test_family_scan.py scans for it). The built-in families (`BUILTIN_FAMILIES`, each a folder's name)
register on the registry's first use; their config classes, which need no torch, as soon as `meshformer.models` is
imported.

The model a family builds is a plain nn.Module with `.config`, `layers` (a ModuleDict keyed by the global layer
index) and, for pipeline splitting, optional `embed_tokens` / `norm` / `lm_head` (docs/design.md, Seams).
Parameter names are the Hugging Face names minus what `to_hf` adds, so conversion is a renaming.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from meshformer.config.fields import MODEL_CONFIGS
from meshformer.config.model_schema import ModelConfig
from meshformer.errors import UserError

# The built-in families, in the order they register: each the name of its folder under models/, which holds its config
# classes (config.py, no torch) and its registry entry (family.py). Adding a family adds its folder and its name here.
BUILTIN_FAMILIES = ("llama", "llama_moe", "deepseek", "mistral", "gpt_oss", "glm4", "gemma3")

HF_HEAD = "lm_head.weight"  # every *ForCausalLM's output projection, outside the `model.` body


def hf_prefixed(name: str) -> str:
    """Hugging Face's name of a parameter of a `*ForCausalLM` whose body is `model.`: the head stays as it is."""
    return name if name == HF_HEAD else f"model.{name}"


def hf_unprefixed(name: str) -> str | None:
    """Our name of a Hugging Face parameter (the inverse of `hf_prefixed`); None for what is no parameter of ours
    (old checkpoints' rotary `inv_freq` buffers: meshformer computes them)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    return name if name == HF_HEAD else name.removeprefix("model.")


@dataclass(frozen=True)
class GgufArch:
    """How llama.cpp names one GGUF architecture of a family: `general.architecture` -> these tables."""

    hf_class: str  # the Hugging Face architecture class the file is read back as
    model_type: str
    global_names: dict[str, str]  # llama.cpp name -> Hugging Face name (embedding, final norm, head)
    layer_parts: dict[str, str]  # the part of `blk.N.<part>` -> the part of `model.layers.N.<part>`
    # llama.cpp's converter interleaves the rotary halves of q/k rows for this architecture (GPT-J style rotary)
    permute_rotary: bool = False
    # The config.json key holding the fraction of each head the rotary turns, for an architecture that turns only
    # part of it: llama.cpp's `rope.dimension_count` is then int(head_dim x fraction), read back as count / head_dim
    # (None: the whole head, dimension_count = head_dim)
    rotary_fraction_key: str | None = None
    # Added to every `*norm.weight` on write, subtracted on read (llama.cpp's converter `norm_shift`: a norm that
    # scales by (1 + weight) is stored as the factor llama.cpp multiplies by). Not bit for bit in float32: w + 1
    # keeps w to 2**-23 absolute.
    norm_shift: float = 0.0
    # (writer, gguf module, config.json) -> None: the architecture's own metadata beyond the common keys (windows,
    # other rotary bases, its rotary scaling: the common keys' check of rope_scaling is skipped when this is set);
    # a UserError for what llama.cpp cannot compute
    write_metadata: Callable | None = None
    # (GGUF metadata {key: value}, config.json read so far) -> config.json keys to add or replace
    read_config: Callable | None = None


@dataclass(frozen=True)
class MindSporeNames:
    """How MindSpore Transformers names a family's parameters (its convert_weight.py / convert_reversed.py), both
    ways; fused projections are split and joined with the model config's shape."""

    # ({MindSpore Transformers name: tensor}, ModelConfig, where) -> {our name: tensor}; a UserError naming the first
    # tensor that is no parameter of the family, or a fused one whose shape the config contradicts
    from_mindspore: Callable
    to_mindspore: Callable  # ({our name: tensor}, ModelConfig, fused: bool) -> {MindSpore Transformers name: tensor}
    name_of: Callable  # our parameter name -> MindSpore Transformers' (unfused), for messages


@dataclass(frozen=True)
class AttentionCost:
    """Attention's own model FLOPs per token (scores and their weighted sum, forward and backward; PaLM's count,
    causality not halved), and the formula `meshformer plan --explain` prints with its numbers."""

    flops_per_token: int
    formula: str  # e.g. "12 x L x heads x head_dim x s"
    numbers: str  # the same with the config's values, seq_length last


def dense_attention_cost(mc) -> AttentionCost:
    """Multi-head (grouped-query) attention whose queries, keys and values are `dim_per_head` wide."""
    L, heads, hd, s = mc.num_layers, mc.num_heads, mc.dim_per_head, mc.seq_length
    return AttentionCost(
        6 * L * heads * (hd + hd) * s, "12 x L x heads x head_dim x s", f"12 x {L} x {heads} x {hd} x {s}"
    )


def window_keys(s: int, window: int | None) -> int:
    """Keys the `s` queries of a row attend in all under a sliding window: query i sees min(i + 1, window)."""
    w = s if window is None else min(window, s)
    return w * (w + 1) // 2 + (s - w) * w


def windowed_attention_cost(mc) -> AttentionCost:
    """Grouped-query attention's count (`dense_attention_cost`) with each layer's window (`mc.window_of`): a layer's
    not-halved count scaled by the share of the causal triangle's scores its window keeps, keys(W) / keys(s). A
    window as long as the row is the dense count; a short one tends to 2W keys a query, the not-halved count of W."""
    dense = dense_attention_cost(mc)
    s, L = mc.seq_length, mc.num_layers
    causal = window_keys(s, None)
    keys = sum(window_keys(s, mc.window_of(i)) for i in range(L))
    if keys == L * causal:
        return dense
    heads, hd = mc.num_heads, mc.dim_per_head
    return AttentionCost(
        dense.flops_per_token // L * keys // causal,
        "12 x heads x head_dim x s x sum over layers of keys(W_l) / keys(s), keys(W) = W(W+1)/2 + (s-W)W",
        f"12 x {heads} x {hd} x {s} x {keys} / {causal}",
    )


def dense_kv_width(mc) -> int:
    """Numbers a KV cache keeps per token and layer: keys and values of every key/value head."""
    return 2 * mc.num_kv_heads * mc.dim_per_head


def window_cache_tokens(mc, tokens: int) -> int:
    """Token slots a KV cache for `tokens` tokens holds, summed over the layers: a layer with a sliding window keeps
    a ring of at most its window's keys (models/kv_cache.py), a global one all of them."""
    windows = [mc.window_of(i) for i in range(mc.num_layers)]
    return sum(tokens if w is None else min(w, tokens) for w in windows)


def dense_cp_gather_width(mc, tp: int) -> int:
    """Numbers context parallelism gathers per token and attention layer on a rank of `tp`: its K and V heads."""
    return 2 * (mc.num_kv_heads // tp) * mc.dim_per_head


@dataclass(frozen=True)
class ModelFamily:
    name: str
    # the `model_config.type` values this family builds -> their config classes (each a config/model_schema.py
    # ModelConfig subclass in the family's folder holding the family's own fields and defaults, and its own
    # cross-field rules in `validate(cfg)`)
    config_types: dict[str, type]
    hf_model_types: dict[str, str]  # Hugging Face model_type -> architecture class name, both ways of conversion
    build: Callable  # (ModelConfig) -> nn.Module, called under torch.device("meta")
    tp_plan: Callable  # (model or pipeline piece) -> {module-path glob: style name} (parallel/tp.py)
    param_count: Callable  # (ModelConfig) -> parameters of the whole model, nothing built
    config_from_hf: Callable  # (config.json dict, where) -> `model_config` fields (a dict for the loader)
    config_to_hf: Callable  # (ModelConfig, dtype name) -> a config.json transformers reads as the same model
    to_hf: Callable = hf_prefixed  # our parameter name -> Hugging Face's
    from_hf: Callable = hf_unprefixed  # Hugging Face's -> ours, or None to skip the tensor
    # Whole-state conversion where one tensor of ours is several of Hugging Face's (stacked MoE experts): called on
    # the renamed dict, ({name: tensor}) -> {name: tensor}. from_hf_tensors sees our names for what `from_hf` renamed
    # and Hugging Face's for what it returned unchanged; to_hf_tensors runs before `to_hf` renames.
    from_hf_tensors: Callable | None = None
    to_hf_tensors: Callable | None = None
    # A family whose architectures name tensors differently (llama_moe: Mixtral's block_sparse_moe.experts.E.w1,
    # Qwen's mlp.experts.E.gate_proj): (ModelConfig) -> ({our name: tensor}) -> {Hugging Face name: tensor}, the
    # whole export renaming; when set it replaces to_hf_tensors and to_hf wherever the config is known.
    to_hf_for: Callable | None = None
    gguf_names: dict[str, GgufArch] = field(default_factory=dict)  # GGUF architecture -> its names
    # The planner's per-layer activation count; None: planner/memory.py counts on the real (meta) modules.
    activation_model: object | None = None
    # MindSpore Transformers' names (`meshformer import MODEL.ckpt`, `export --format mindspore`); None: not converted
    mindspore_names: MindSporeNames | None = None
    moe: bool = False  # builds routed experts from model_config.moe_config (its config classes have one)
    # The family's own config fields a fine-tune takes from its base model (train/finetune.py adds the common ones;
    # "moe_config.expert_num" names a field of a section)
    shape_fields: tuple[str, ...] = ()
    attention_cost: Callable = windowed_attention_cost  # (ModelConfig) -> AttentionCost
    kv_cache_width: Callable = dense_kv_width  # (ModelConfig) -> numbers the KV cache keeps per token and layer
    # (ModelConfig, tokens) -> token slots a cache for `tokens` tokens holds over all layers (a sliding-window layer
    # keeps at most its window: models/kv_cache.py)
    kv_cache_tokens: Callable = window_cache_tokens
    # Context parallelism (parallel/context_parallel.py): {attention module class: {its attribute: what cp puts
    # there}}; the names cp offers are `attend` (attention over K/V gathered from the cp ranks), `gather` (any
    # per-token tensor gathered over the row) and `attend_gathered` (attention over already gathered K/V). The
    # model's files stay free of parallel code: the attention only calls its attributes. Empty: cp is refused.
    cp_attention: dict = field(default_factory=dict)
    cp_gather_width: Callable = dense_cp_gather_width  # (ModelConfig, tp) -> numbers gathered per token and layer
    # (cfg, dims, micro_batch) -> (bytes one attention layer keeps under cp beyond the local-length plan, bytes its
    # attention saves transiently); None: the gathered K/V (cp_gather_width) are what it keeps
    # (planner/context_parallel.py)
    cp_saved_bytes: Callable | None = None

    def to_hf_state(self, state: dict, mc=None) -> dict:
        """Our state dict -> Hugging Face's names on disk: the architecture's renaming where the family has one
        (`to_hf_for`) and the config is given, else `to_hf_tensors` then `to_hf`."""
        if self.to_hf_for is not None and mc is not None:
            return self.to_hf_for(mc)(state)
        if self.to_hf_tensors is not None:
            state = self.to_hf_tensors(state)
        return {self.to_hf(k): v for k, v in state.items()}

    def active_param_count(self, mc) -> int:
        """Parameters one token passes through: all of them for a dense model; for an MoE model everything but the
        routed experts it is not sent to (top-k of each layer's experts; models/moe/params.py counts them on the
        family's meta-device modules)."""
        if not (self.moe and mc.is_moe):
            return self.param_count(mc)
        from meshformer.models.moe.params import active_param_count

        return active_param_count(self, mc)

    def flops_per_token(self, mc) -> float:
        """Model FLOPs per token (PaLM's appendix, as Megatron and torchtitan count them; the MFU convention):
        6 x every parameter that does a matmul per token (all but the input embedding, which is a lookup, plus the
        output projection, tied to that embedding or not; of an MoE model the active ones: top-k routed experts)
        + 6 x layers x heads x (q/k head width + v head width) x seq_length for the attention scores and their
        weighted sum, i.e. 12 x layers x heads x head_dim x seq_length when q, k and v are as wide (not halved for
        causality; the family's `attention_cost`: latent attention's q/k and v heads have widths of their own).
        Recompute is overhead, not model work: not counted."""
        embedding = mc.vocab_size * mc.hidden_size
        head = embedding if mc.tie_word_embeddings else 0  # an untied head is in param_count already
        matmul = self.active_param_count(mc) - embedding + head
        return 6 * matmul + self.attention_cost(mc).flops_per_token


_FAMILIES: dict[str, ModelFamily] = {}
_BUILTIN_REGISTERED = False


def register_family(family: ModelFamily) -> ModelFamily:
    """Add a family; its config types, Hugging Face architectures and GGUF names must be new. The built-in families
    come first, whoever registers first."""
    _ensure_builtin()
    for other in _FAMILIES.values():
        clash = (
            set(family.config_types) & set(other.config_types)
            or set(family.hf_model_types) & set(other.hf_model_types)
            or set(family.hf_model_types.values()) & set(other.hf_model_types.values())
            or set(family.gguf_names) & set(other.gguf_names)
        )
        if family.name == other.name or clash:
            raise ValueError(f"model family {family.name!r} clashes with {other.name!r} ({clash or 'same name'})")
    for name, cls in family.config_types.items():
        if not (isinstance(cls, type) and issubclass(cls, ModelConfig)):
            raise ValueError(f"model family {family.name!r}: type {name!r} needs a ModelConfig subclass, not {cls!r}")
    _FAMILIES[family.name] = family
    for name, cls in family.config_types.items():
        MODEL_CONFIGS.add(name, cls)
    return family


# The tensor hooks of ModelFamily a folder's hf.py supplies by defining a function of the field's name
HF_TENSOR_HOOKS = ("to_hf", "from_hf", "from_hf_tensors", "to_hf_tensors", "to_hf_for")


def folder_family(name: str, build: Callable, config, hf, model, gguf=None, **particular) -> ModelFamily:
    """The family of folder `name` from its modules, by the names each defines: config.py's `CONFIG_CLASSES` and
    `SHAPE_FIELDS`; hf.py's `HF_MODEL_TYPES`, `config_from_hf`, `config_to_hf` and whichever tensor hooks
    (`HF_TENSOR_HOOKS`) it defines; the model module's `tp_plan` and `param_count`; gguf.py's `GGUF_NAMES` when
    given. `particular`: the family's own ModelFamily fields, which also replace a tensor hook or the GGUF names.
    The first eight fields go by position, in ModelFamily's order."""
    found = {hook: getattr(hf, hook) for hook in HF_TENSOR_HOOKS if hasattr(hf, hook)}
    if gguf is not None:
        found["gguf_names"] = gguf.GGUF_NAMES
    return ModelFamily(
        name,
        config.CONFIG_CLASSES,
        hf.HF_MODEL_TYPES,
        build,
        model.tp_plan,
        model.param_count,
        hf.config_from_hf,
        hf.config_to_hf,
        shape_fields=config.SHAPE_FIELDS,
        **{**found, **particular},
    )


def unregister_family(name: str) -> None:
    gone = _FAMILIES.pop(name, None)
    if gone is not None:
        MODEL_CONFIGS.discard(gone.config_types)


def model_config(type: str = "LlamaConfig", **fields) -> ModelConfig:
    """A model config of `type` built directly (tests, tools): its family's class with these fields."""
    cls = MODEL_CONFIGS.class_of(type) if families() else None
    if cls is None:
        family_of(ModelConfig(type=type))  # one line naming the known types
    return cls(type=type, **fields)


def families() -> list[ModelFamily]:
    _ensure_builtin()
    return list(_FAMILIES.values())


def config_types() -> list[str]:
    """Every `model_config.type` a registered family builds (the schema's choices)."""
    return [t for f in families() for t in f.config_types]


def family_of(mc) -> ModelFamily:
    """The family of a ModelConfig (by `mc.type`), or one line naming the field and the known types."""
    for f in families():
        if mc.type in f.config_types:
            return f
    known = config_types()
    guess = difflib.get_close_matches(str(mc.type), known, n=1)
    hint = f"did you mean {guess[0]!r}? " if guess else ""
    raise UserError(
        f"model.model_config.type={mc.type!r} is not a model family: {hint}choose one of {', '.join(known)}"
    )


def family_for_hf(hf: dict, where: str) -> tuple[ModelFamily, str]:
    """(family, Hugging Face model_type) of a config.json: by its `architectures`, or its `model_type` when it
    names none; one line listing what is supported otherwise."""
    by_class = {arch: (f, mt) for f in families() for mt, arch in f.hf_model_types.items()}
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in by_class:
            return by_class[arch]
    by_type = {mt: (f, mt) for f in families() for mt in f.hf_model_types}
    if not archs and hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    named = archs[0] if archs else hf.get("model_type", "none given")
    raise UserError(
        f"{where}: architecture {named!r} is not supported (supported: {', '.join(by_class)}); "
        f"convert a model of one of these families"
    )


def hf_model_type(hf: dict, hf_model_types: dict[str, str], where: str, expected: str) -> str:
    """Which of a family's Hugging Face model types (`hf_model_types`: model_type -> architecture class) a
    config.json is, by its `architectures` or else its `model_type` (as `family_for_hf` found the family);
    `expected` names them in the one-line error."""
    by_class = {arch: mt for mt, arch in hf_model_types.items()}
    for arch in hf.get("architectures") or []:
        if arch in by_class:
            return by_class[arch]
    if hf.get("model_type") in hf_model_types:
        return hf["model_type"]
    raise UserError(f"{where}: not a {expected} config.json")


def family_for_gguf(arch: str) -> tuple[ModelFamily, GgufArch] | None:
    """(family, its names) of a GGUF `general.architecture`, or None."""
    for f in families():
        if arch in f.gguf_names:
            return f, f.gguf_names[arch]
    return None


def family_for_hf_class(hf_class: str) -> tuple[ModelFamily, str] | None:
    """(family, GGUF architecture) whose GGUF tables read back as Hugging Face class `hf_class`, or None."""
    for f in families():
        for arch, names in f.gguf_names.items():
            if names.hf_class == hf_class:
                return f, arch
    return None


def gguf_architectures() -> list[str]:
    return [arch for f in families() for arch in f.gguf_names]


def builtin_config_classes(name: str) -> dict[str, type]:
    """The config classes of built-in family `name` (`model_config.type` -> class), from its folder's config.py:
    no torch, nothing built."""
    return importlib.import_module(f"meshformer.models.{name}.config").CONFIG_CLASSES


def register_builtin_configs() -> None:
    """The built-in families' config classes as `model_config.type`'s choices (config/fields.py MODEL_CONFIGS), for
    the loader; `import meshformer.models` calls it, the families themselves register on first use."""
    for name in BUILTIN_FAMILIES:
        for type_name, cls in builtin_config_classes(name).items():
            MODEL_CONFIGS.add(type_name, cls)


def family_config_classes() -> dict[str, dict[str, type]]:
    """Each family's name -> its config classes, in the order of `families()`, without registering the built-in
    ones (their config.py only: no torch, for `meshformer config explain`)."""
    out = {name: builtin_config_classes(name) for name in BUILTIN_FAMILIES}
    out.update((f.name, f.config_types) for f in _FAMILIES.values())
    return out


def _ensure_builtin() -> None:
    """Register the built-in families (`BUILTIN_FAMILIES`) on first use: each folder's family.py, which builds on
    torch, is imported only here."""
    global _BUILTIN_REGISTERED
    if _BUILTIN_REGISTERED:
        return
    _BUILTIN_REGISTERED = True  # before the imports: each family.py calls register_family, which comes back here
    try:
        for name in BUILTIN_FAMILIES:
            importlib.import_module(f"meshformer.models.{name}.family")
    except BaseException:
        _BUILTIN_REGISTERED = False  # the next use tries again (the families already imported stay registered)
        raise
