"""Hugging Face ``config.json`` to ModelSpec, for the MoE families moeplan models.

Pure: reads the JSON mapping only (no ``transformers``). Each family names the keys it maps;
every other key must be in ``IGNORED`` (tokenizer ids, serving and initialisation settings: no
effect on a training step's time or memory) or the config is refused in one line naming it, so
a key that changes the cost is never dropped silently. Errors name the config's key, not the
ModelSpec field it became.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from plans.enums import LinearBias, RouterScore, WindowKind
from plans.errors import SpecError
from plans.io import read_document
from plans.specs import MLASpec, ModelSpec, YaRNSpec

CONFIG_NAME = "config.json"

IGNORED = frozenset({
    # identity, provenance, serialisation
    "architectures", "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype",
    "_name_or_path", "name_or_path",
    # tokenizer and generation ids
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "pad_id", "boi_token_index",
    "eoi_token_index", "image_token_index",
    # serving and initialisation: no effect on a training step
    "use_cache", "initializer_range", "pretraining_tp", "output_router_logits",
    "return_dict", "ep_size", "router_jitter_noise", "input_jitter_noise",
    # positions: the sequence length is the training spec's (RoPE scaling: _rope_scaling)
    "max_position_embeddings", "initial_context_length", "original_max_position_embeddings",
    # the released checkpoint's storage format: training precision is TrainingSpec.precision
    "quantization_config",
    # which top-k algorithm runs the (mapped) group-limited routing, and the sequence-wise
    # balance loss (mapped to aux_loss_alpha's weight)
    "topk_method", "seq_aux",
    # Llama-4 attention-temperature tuning (a scale on the queries) and its L2 QK norm's form
    "attn_temperature_tuning", "floor_scale", "attn_scale",
})
"""Keys that change no shape, FLOP, byte or collective of a training step."""


@dataclass
class _Reader:
    """One config mapping: typed look-ups that record the keys used and name them in errors."""

    data: Mapping
    where: str
    used: set[str]

    def fail(self, key: str, reason: str) -> SpecError:
        return SpecError(f"{self.where}: {key}: {reason}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: object = None) -> object:
        self.used.add(key)
        value = self.data.get(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise self.fail(key, "required key is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer, got {value!r}")
        if value < 0:
            raise self.fail(key, f"must be >= 0, got {value}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"must be a number, got {value!r}")
        return float(value)

    def bool(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}")
        return value

    def equals(self, key: str, allowed: tuple, why: str) -> None:
        """A key moeplan models at one value only (``allowed``); others are refused."""
        value = self.get(key, allowed[0])
        if value not in allowed:
            raise self.fail(key, f"{value!r} is not modelled ({why})")


# ---- the shared keys ----------------------------------------------------------------------------


def _common(r: _Reader, experts_key: str, top_k_key: str) -> dict:
    """Keys every family shares (Llama-style decoder: RMSNorm, RoPE, SwiGLU)."""
    hidden = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    if heads and hidden % heads and not r.has("head_dim"):
        raise r.fail("num_attention_heads",
                     f"{heads} heads do not divide hidden_size {hidden} (and no head_dim)")
    experts, top_k = r.int(experts_key), r.int(top_k_key)
    if top_k > experts:
        raise r.fail(top_k_key, f"{top_k} is above the {experts} experts ({experts_key})")
    r.equals("hidden_act", ("silu",), "the FFNs are SwiGLU")
    dropout = max(r.float("attention_dropout", 0.0), r.float("hidden_dropout", 0.0))
    return dict(
        layers=r.int("num_hidden_layers"), hidden=hidden, query_heads=heads,
        kv_heads=r.int("num_key_value_heads", heads),
        head_dim=r.int("head_dim", hidden // heads if heads else 0),
        vocab=r.int("vocab_size"), experts=experts, top_k=top_k,
        tied_embeddings=r.bool("tie_word_embeddings"),
        rope_theta=r.float("rope_theta", 10000.0), norm_eps=r.float("rms_norm_eps", 1e-6),
        dropout=dropout, rope_scaling=_rope_scaling(r),
    )


YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "truncate", "mscale", "mscale_all_dim")
"""``rope_scaling`` keys of a YaRN config (YaRNSpec's fields, same names)."""


def _rope_scaling(r: _Reader) -> YaRNSpec | None:
    """``rope_scaling``: YaRN as YaRNSpec (every key read, others refused in one line naming
    them); None for plain RoPE. The other kinds (llama3, longrope, dynamic NTK) rescale the
    angles of the same RoPE kernels on every target, so their cost is plain RoPE's; they are
    not modelled and read as plain RoPE (moeplan's runtime then runs plain angles)."""
    scaling = r.get("rope_scaling")
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise r.fail("rope_scaling", f"must be a mapping, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        return None
    inner = _Reader(scaling, f"{r.where}: rope_scaling", {"rope_type", "type"})
    values = {k: inner.get(k) for k in YARN_KEYS}
    unknown = sorted(set(scaling) - inner.used)
    if unknown:
        raise inner.fail(unknown[0], "not modelled for YaRN (moeplan reads "
                         f"{', '.join(YARN_KEYS)})")
    try:
        return YaRNSpec.model_validate({"rope_type": kind} | {
            k: v for k, v in values.items() if v is not None})
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        msg = first["msg"].removeprefix("Value error, ")
        key = str(first["loc"][0]) if first["loc"] else msg.split(" ", 1)[0]
        raise inner.fail(key, msg) from None


def _no_window(r: _Reader, *keys: str) -> None:
    """Sliding-window keys of families that train without one (Qwen: use_sliding_window)."""
    if r.bool("use_sliding_window"):
        raise r.fail("use_sliding_window", "true is not modelled for this family (Qwen's "
                     "window applies above max_window_layers only)")
    for k in keys:
        r.get(k)


def _window(r: _Reader, key: str = "sliding_window") -> int:
    """A sliding window that covers every position the model accepts is no window."""
    window = r.int(key, 0)
    limit = r.data.get("max_position_embeddings")
    return 0 if isinstance(limit, int) and window >= limit else window


# ---- families -----------------------------------------------------------------------------------


def _mixtral(r: _Reader) -> dict:
    spec = _common(r, "num_local_experts", "num_experts_per_tok")
    return dict(spec, expert_ffn_hidden=r.int("intermediate_size"),
                aux_loss_coeff=r.float("router_aux_loss_coef", 0.001),
                sliding_window=_window(r))


def _qwen_moe(r: _Reader) -> dict:
    """qwen2_moe and qwen3_moe: every decoder_sparse_step-th layer MoE, mlp_only_layers dense."""
    spec = _common(r, "num_experts", "num_experts_per_tok")
    step = r.int("decoder_sparse_step", 1)
    if step != 1:
        raise r.fail("decoder_sparse_step", f"{step} is not modelled (MoE layers first-dense "
                     "or interleaved last-of-each-group only)")
    dense = r.get("mlp_only_layers", [])
    if dense != list(range(len(dense))):
        raise r.fail("mlp_only_layers", f"{dense} is not modelled (only leading dense layers)")
    shared = r.int("shared_expert_intermediate_size", 0)
    qwen2 = r.data.get("model_type") == "qwen2_moe"
    _no_window(r, "sliding_window", "max_window_layers")
    out = dict(
        spec, expert_ffn_hidden=r.int("moe_intermediate_size"),
        shared_experts=1 if shared else 0, shared_expert_ffn_hidden=shared,
        shared_expert_gate=bool(shared) and qwen2,
        dense_layers=len(dense), dense_ffn_hidden=r.int("intermediate_size") if dense else 0,
        router_pre_softmax=not r.bool("norm_topk_prob"),
        aux_loss_coeff=r.float("router_aux_loss_coef", 0.001),
        qk_norm=not qwen2,
        # Qwen2's q, k and v projections always carry biases (qkv_bias in newer configs)
        linear_bias=LinearBias.qkv if r.bool("qkv_bias", qwen2) or r.bool("attention_bias")
        else LinearBias.none,
    )
    if not dense:
        r.get("intermediate_size")  # the dense FFN width of a model without dense layers
    return out


def _deepseek(r: _Reader) -> dict:
    """deepseek_v2, deepseek_v3 and kimi_k2 (DeepSeek-V3's architecture)."""
    spec = _common(r, "n_routed_experts", "num_experts_per_tok")
    freq = r.int("moe_layer_freq", 1)
    if freq != 1:
        raise r.fail("moe_layer_freq", f"{freq} is not modelled (every layer after "
                     "first_k_dense_replace is MoE in every released model)")
    dense = r.int("first_k_dense_replace", 0)
    shared = r.int("n_shared_experts", 0)
    width = r.int("moe_intermediate_size")
    score = r.get("scoring_func", "softmax")
    if score not in ("softmax", "sigmoid"):
        raise r.fail("scoring_func", f"{score!r} is not modelled (softmax or sigmoid)")
    score = RouterScore(score)
    bias = r.get("topk_method", "greedy") == "noaux_tc"
    renormalised = r.bool("norm_topk_prob")
    if score == RouterScore.sigmoid and not renormalised:
        raise r.fail("norm_topk_prob", "false is not modelled with sigmoid scores (the kept "
                     "scores are renormalised)")
    groups = r.int("n_group", 1) or 1
    if r.bool("attention_bias"):
        raise r.fail("attention_bias", "true is not modelled with MLA")
    mla = MLASpec(q_lora_rank=r.int("q_lora_rank", 0), kv_lora_rank=r.int("kv_lora_rank"),
                  qk_nope_head_dim=r.int("qk_nope_head_dim"),
                  qk_rope_head_dim=r.int("qk_rope_head_dim"), v_head_dim=r.int("v_head_dim"))
    return dict(
        spec, kv_heads=spec["query_heads"], head_dim=mla.qk_head_dim, mla=mla,
        expert_ffn_hidden=width, shared_experts=shared,
        shared_expert_ffn_hidden=width if shared else 0,
        dense_layers=dense, dense_ffn_hidden=r.int("intermediate_size") if dense else 0,
        router_score=score, router_expert_bias=bias,
        router_pre_softmax=score == RouterScore.softmax and not renormalised,
        routed_scaling_factor=r.float("routed_scaling_factor", 1.0),
        expert_groups=groups, groups_per_token=r.int("topk_group", 1) or 1,
        aux_loss_coeff=r.float("aux_loss_alpha", 0.001),
        mtp_layers=r.int("num_nextn_predict_layers", 0),
    )


def _glm4_moe(r: _Reader) -> dict:
    spec = _common(r, "n_routed_experts", "num_experts_per_tok")
    dense = r.int("first_k_dense_replace", 0)
    width, shared = r.int("moe_intermediate_size"), r.int("n_shared_experts", 0)
    return dict(
        spec, expert_ffn_hidden=width, shared_experts=shared,
        shared_expert_ffn_hidden=width if shared else 0,
        dense_layers=dense, dense_ffn_hidden=r.int("intermediate_size") if dense else 0,
        router_score=RouterScore.sigmoid, router_expert_bias=True,
        routed_scaling_factor=r.float("routed_scaling_factor", 1.0),
        expert_groups=r.int("n_group", 1) or 1, groups_per_token=r.int("topk_group", 1) or 1,
        qk_norm=r.bool("use_qk_norm"),
        linear_bias=LinearBias.qkv if r.bool("attention_bias") else LinearBias.none,
        rotary_fraction=r.float("partial_rotary_factor", 1.0),
        mtp_layers=r.int("num_nextn_predict_layers", 0), aux_loss_coeff=0.0,
        **_checked_norm_topk(r),
    )


def _checked_norm_topk(r: _Reader) -> dict:
    if not r.bool("norm_topk_prob", True):
        raise r.fail("norm_topk_prob", "false is not modelled with sigmoid scores (the kept "
                     "scores are renormalised)")
    return {}


def _gpt_oss(r: _Reader) -> dict:
    spec = _common(r, "num_local_experts", "num_experts_per_tok")
    r.get("experts_per_token")  # the same count as num_experts_per_tok
    kinds = r.get("layer_types", [])
    window = _window(r)
    full = [i for i, k in enumerate(kinds) if k == "full_attention"]
    every = 0
    if window and full:
        every = full[0] + 1
        expected = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                    for i in range(len(kinds))]
        if kinds != expected or len(kinds) != spec["layers"]:
            raise r.fail("layer_types", "not modelled: full-attention layers must recur every "
                         "N layers, the last of each N")
    return dict(spec, expert_ffn_hidden=r.int("intermediate_size"),
                linear_bias=LinearBias.all if r.bool("attention_bias") else LinearBias.none,
                attention_sinks=True, sliding_window=window, full_attention_every=every,
                swiglu_limit=r.float("swiglu_limit", 0.0),
                aux_loss_coeff=r.float("router_aux_loss_coef", 0.9))


def _phimoe(r: _Reader) -> dict:
    spec = _common(r, "num_local_experts", "num_experts_per_tok")
    r.get("attention_bias")
    r.get("lm_head_bias")  # biases and LayerNorm's: under 0.01% of the parameters
    return dict(spec, expert_ffn_hidden=r.int("intermediate_size"),
                sliding_window=_window(r), norm_eps=r.float("rms_norm_eps", 1e-5),
                aux_loss_coeff=r.float("router_aux_loss_coef", 0.0))


def _llama4(r: _Reader) -> dict:
    """llama4 (the text_config of Llama4ForConditionalGeneration) and llama4_text."""
    spec = _common(r, "num_local_experts", "num_experts_per_tok")
    step = r.int("interleave_moe_layer_step", 1)
    moe = r.get("moe_layers")
    expected = list(range(step - 1, spec["layers"], step))
    if moe is not None and list(moe) != expected:
        raise r.fail("moe_layers", "not modelled: MoE layers must be the last of every "
                     "interleave_moe_layer_step layers")
    chunk = r.int("attention_chunk_size", 0)
    every = r.int("no_rope_layer_interval", 4) if chunk else 0
    nope = r.get("no_rope_layers")
    if nope is not None and every and list(nope) != [int((i + 1) % every != 0)
                                                     for i in range(spec["layers"])]:
        raise r.fail("no_rope_layers", "not modelled: the global (no-RoPE) layers must be "
                     "every no_rope_layer_interval-th")
    width, mlp = r.int("intermediate_size"), r.int("intermediate_size_mlp", 0)
    if r.bool("attention_bias"):
        raise r.fail("attention_bias", "true is not modelled for Llama-4")
    return dict(spec, expert_ffn_hidden=width, shared_experts=1, shared_expert_ffn_hidden=width,
                moe_layer_interval=step,
                dense_ffn_hidden=mlp if step > 1 else 0,
                router_score=RouterScore.sigmoid, qk_norm=r.bool("use_qk_norm"),
                sliding_window=chunk, window_kind=WindowKind.chunked,
                full_attention_every=every,
                aux_loss_coeff=r.float("router_aux_loss_coef", 0.001))


def _hunyuan(r: _Reader) -> dict:
    spec = _common(r, "num_experts", "moe_topk")
    share = r.int("cla_share_factor", 1) if r.bool("use_cla") else 1
    r.equals("use_mixed_mlp_moe", (True,), "the shared expert beside the routed ones")
    r.equals("norm_type", ("rms",), "every norm is RMSNorm")
    r.equals("mlp_bias", (False,), "the FFNs have no biases")
    shared = r.int("num_shared_expert", 1)
    width = r.int("intermediate_size")
    return dict(spec, expert_ffn_hidden=r.int("moe_intermediate_size", width),
                shared_experts=shared, shared_expert_ffn_hidden=width if shared else 0,
                kv_share_layers=share or 1,
                qk_norm=r.bool("use_qk_norm"), router_pre_softmax=spec["top_k"] == 1,
                linear_bias=LinearBias.qkv if r.bool("attention_bias") else LinearBias.none)


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    build: Callable[[_Reader], dict]


FAMILIES = (
    Family("Mixtral", ("mixtral",), _mixtral),
    Family("Qwen-MoE", ("qwen2_moe", "qwen3_moe"), _qwen_moe),
    Family("DeepSeek", ("deepseek_v2", "deepseek_v3", "kimi_k2"), _deepseek),
    Family("GLM-4.5", ("glm4_moe",), _glm4_moe),
    Family("GPT-OSS", ("gpt_oss",), _gpt_oss),
    Family("Phi-MoE", ("phimoe",), _phimoe),
    Family("Llama-4", ("llama4", "llama4_text"), _llama4),
    Family("Hunyuan", ("hunyuan", "hunyuan_v1_moe"), _hunyuan),
)
ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3", "Glm4MoeForCausalLM": "glm4_moe",
    "GptOssForCausalLM": "gpt_oss", "PhiMoEForCausalLM": "phimoe",
    "Llama4ForConditionalGeneration": "llama4", "Llama4ForCausalLM": "llama4_text",
    "HunYuanForCausalLM": "hunyuan", "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe",
}
"""Architecture class names, for a config whose model_type is missing."""

FIELD_KEYS = {
    "layers": "num_hidden_layers", "hidden": "hidden_size", "query_heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab": "vocab_size",
    "experts": "num_experts", "top_k": "num_experts_per_tok", "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps", "expert_ffn_hidden": "moe_intermediate_size",
    "dense_layers": "first_k_dense_replace", "dense_ffn_hidden": "intermediate_size",
    "shared_experts": "n_shared_experts", "expert_groups": "n_group",
    "groups_per_token": "topk_group", "mtp_layers": "num_nextn_predict_layers",
    "routed_scaling_factor": "routed_scaling_factor", "sliding_window": "sliding_window",
    "mla": "kv_lora_rank", "dropout": "attention_dropout", "aux_loss_coeff": "aux_loss_alpha",
    "rotary_fraction": "partial_rotary_factor", "swiglu_limit": "swiglu_limit",
}
"""The config key most families use for a ModelSpec field: errors name it."""


def is_hf_config(data: Mapping) -> bool:
    """A Hugging Face config rather than a moeplan spec: it names its model_type or classes."""
    return "model_type" in data or "architectures" in data


def _family(data: Mapping, where: str) -> tuple[Family, Mapping]:
    model_type = data.get("model_type")
    if model_type is None:
        classes = data.get("architectures") or []
        model_type = next((ARCHITECTURES[c] for c in classes if c in ARCHITECTURES), None)
        if model_type is None:
            raise SpecError(f"{where}: architectures: {classes!r} is not a mapped MoE "
                            f"architecture ({', '.join(sorted(ARCHITECTURES))})")
    if model_type == "llama4":
        text = data.get("text_config")
        if not isinstance(text, Mapping):
            raise SpecError(f"{where}: text_config: required for model_type llama4")
        return _family({**text, "model_type": "llama4_text"}, where)[0], text
    for family in FAMILIES:
        if model_type in family.model_types:
            return family, data
    known = sorted(t for f in FAMILIES for t in f.model_types)
    raise SpecError(f"{where}: model_type: {model_type!r} is not a mapped MoE architecture "
                    f"(mapped: {', '.join(known)})")


def _key_of(field: str, message: str, used: set[str]) -> str:
    """The config key behind a ModelSpec error: the field's usual key when the config used it,
    else the ModelSpec field itself."""
    key = FIELD_KEYS.get(field)
    if key in used:
        return key
    candidates = [k for f, k in FIELD_KEYS.items() if f == field or k.startswith(field)]
    return next((k for k in candidates if k in used), field)


def to_spec(data: Mapping, where: str, name: str | None = None) -> ModelSpec:
    """The ModelSpec of a Hugging Face config mapping; one-line SpecError naming the key."""
    family, config = _family(data, where)
    if config is not data:  # Llama-4's text_config: the outer keys are the multimodal model's
        where = f"{where}: text_config"
    reader = _Reader(config, where, set())
    fields = family.build(reader)
    unknown = sorted(k for k in config if k not in reader.used and k not in IGNORED
                     and k != "text_config" and k != "vision_config")
    if unknown:
        raise SpecError(f"{where}: {unknown[0]}: key not mapped to the model spec (it may change "
                        f"the cost; moeplan maps {family.name} configs' known keys only)")
    fields["name"] = name or str(data.get("_name_or_path") or config.get("model_type"))
    try:
        return ModelSpec.model_validate(fields)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        msg = first["msg"].removeprefix("Value error, ")
        if not field:  # a model-level rule: the message names the first field it checks
            field = next((f for f in ModelSpec.model_fields
                          if re.match(rf"{re.escape(f)}\b", msg)), "")
        raise SpecError(f"{where}: {_key_of(field, msg, reader.used)}: {msg}") from None


def config_path(path: Path) -> Path | None:
    """The config.json of a snapshot folder or the file itself; None for anything else."""
    try:
        if path.is_dir():
            inner = path / CONFIG_NAME
            return inner if inner.is_file() else None
    except OSError:
        return None
    return path if path.name == CONFIG_NAME or path.suffix == ".json" else None


def model_name(path: Path) -> str:
    """A config's model name: its snapshot folder's name (Hugging Face cache folders are
    ``models--org--name/snapshots/<hash>``)."""
    folder = path.parent if path.name == CONFIG_NAME else path
    parts = folder.resolve().parts
    for part in reversed(parts):
        if part.startswith("models--"):
            return part.removeprefix("models--").split("--")[-1]
    return folder.resolve().name if path.name == CONFIG_NAME else path.stem


def load(path: Path) -> ModelSpec:
    """A Hugging Face config.json (or a snapshot folder holding one) as a ModelSpec."""
    found = config_path(path) or path
    data = read_document(found, str(found))
    if not is_hf_config(data):
        raise SpecError(f"{found}: model_type: required key is missing (not a Hugging Face "
                        f"config.json)")
    return to_spec(data, str(found), model_name(found))
