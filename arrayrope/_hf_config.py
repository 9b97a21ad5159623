"""RoPE.from_hf_config: the RoPE a Hugging Face ``config.json`` describes."""

import json
import math
import os

from ._errors import RopeTypeError, RopeValueError

# Pair style per model family, as Hugging Face transformers rotates it: rotate_half pairs
# (x[i], x[i + d/2]) for the Llama lineage; adjacent pairs where the family multiplies complex
# numbers or rotates every two (DeepSeek-V2/V3, GPT-J, Cohere).
HALF_FAMILIES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "phi",
        "phi3",
        "phimoe",
        "gpt_neox",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "olmo",
        "olmo2",
        "starcoder2",
        "stablelm",
        "falcon",
        "granite",
        "internlm2",
        "persimmon",
        "exaone",
        "nemotron",
        "smollm3",
    }
)
INTERLEAVED_FAMILIES = frozenset(
    {"deepseek_v2", "deepseek_v3", "gptj", "codegen", "cohere", "cohere2"}
)
# Families whose Hugging Face config class defaults rope_theta to 10000 when the file omits it.
THETA_10000_FAMILIES = frozenset(
    {"llama", "mistral", "mixtral", "gptj", "codegen", "phi", "gpt_neox"}
)
# Older names of the fields read here (GPT-2 lineage: GPT-J, CodeGen), as transformers' config
# classes map them (attribute_map).
_FIELD_ALIASES = {
    "hidden_size": ("n_embd", "d_model"),
    "num_attention_heads": ("n_head",),
    "max_position_embeddings": ("n_positions",),
}
# Every field this module reads from a config: read from an object by attribute, so that its
# class's aliases and defaults apply.
_FIELDS = (
    "model_type",
    "rope_theta",
    "rotary_emb_base",
    "rope_scaling",
    "rope_parameters",
    "head_dim",
    "qk_rope_head_dim",
    "hidden_size",
    "num_attention_heads",
    "partial_rotary_factor",
    "rotary_pct",
    "rotary_dim",
    "max_position_embeddings",
    "original_max_position_embeddings",
)

_COMMON_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    "original_max_position_embeddings",
    "mrope_section",
    "mrope_interleaved",
}
_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {
        "factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    },
    "longrope": {"short_factor", "long_factor", "factor", "attention_factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor"},
}
_ALIASES = {"su": "longrope", "mrope": "default"}


def _as_dict(config):
    """The config's fields as a dict: from a dict, a config.json (or a model folder holding
    one), or an object (a transformers config: its fields read through its attributes)."""
    if isinstance(config, dict):
        return _canonical(dict(config))
    if isinstance(config, (str, os.PathLike)):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        try:
            with open(path) as f:
                return _canonical(json.load(f))
        except OSError as error:
            raise RopeValueError(f"config path {str(path)!r} cannot be read: {error}") from None
        except json.JSONDecodeError as error:
            raise RopeValueError(f"config file {str(path)!r} is not JSON: {error}") from None
    if hasattr(config, "to_dict") or hasattr(config, "__dict__"):
        fields = dict(config.to_dict()) if hasattr(config, "to_dict") else {}
        if not fields:
            fields = {k: v for k, v in vars(config).items() if not k.startswith("_")}
        for name in _FIELDS:
            try:
                value = getattr(config, name)
            except AttributeError:
                continue
            if value is not None:
                fields[name] = value
        return _canonical(fields)
    raise RopeTypeError(
        f"config must be a dict, a path to config.json or a model folder, or an object with "
        f"attributes, got {type(config).__name__}"
    )


def _canonical(cfg):
    """``cfg`` with the current names of aliased fields; two names that disagree are an
    error."""
    for name, aliases in _FIELD_ALIASES.items():
        for alias in aliases:
            value = cfg.get(alias)
            if value is None:
                continue
            if cfg.get(name) is not None and cfg[name] != value:
                raise RopeValueError(
                    f"config has {name}={cfg[name]!r} and {alias}={value!r}, which disagree"
                )
            cfg[name] = value
    return cfg


def _need(cfg, key, where="config"):
    value = cfg.get(key)
    if value is None:
        raise RopeValueError(f"{where} has no {key!r}, which this rope type needs")
    return value


def rope_from_hf_config(cls, config, style=None, max_positions=None):
    from . import scaling as sc

    cfg = _as_dict(config)
    model_type = cfg.get("model_type")
    scaling_field, parameters_field = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    if scaling_field and parameters_field and scaling_field != parameters_field:
        raise RopeValueError("config has both rope_scaling and rope_parameters, and they differ")
    params = dict(parameters_field or scaling_field or {})
    if not isinstance(parameters_field or scaling_field or {}, dict):
        raise RopeTypeError("rope_scaling / rope_parameters must be a mapping")
    kind, old_kind = params.get("rope_type"), params.get("type")
    if kind and old_kind and _ALIASES.get(kind, kind) != _ALIASES.get(old_kind, old_kind):
        raise RopeValueError(f"rope_type {kind!r} and type {old_kind!r} disagree")
    kind = _ALIASES.get(kind or old_kind or "default", kind or old_kind or "default")
    if kind not in _KEYS:
        raise RopeValueError(f"unknown rope type {kind!r}; known: {', '.join(sorted(_KEYS))}")
    unknown = set(params) - _COMMON_KEYS - _KEYS[kind]
    if unknown:
        raise RopeValueError(f"unknown field(s) for rope type {kind!r}: {sorted(unknown)}")

    thetas = {
        name: value
        for name, value in (
            ("rope_parameters' rope_theta", params.get("rope_theta")),
            ("rope_theta", cfg.get("rope_theta")),
            ("rotary_emb_base", cfg.get("rotary_emb_base")),
        )
        if value is not None
    }
    if len(set(thetas.values())) > 1:
        raise RopeValueError(
            "config gives the RoPE base more than once, with different values: "
            + ", ".join(f"{name}={value!r}" for name, value in thetas.items())
        )
    theta = next(iter(thetas.values()), None)
    if theta is None:
        if model_type not in THETA_10000_FAMILIES:
            raise RopeValueError(
                f"config has no rope_theta, and model_type {model_type!r} has no known default"
            )
        theta = 10000.0

    if cfg.get("qk_rope_head_dim") is not None:  # DeepSeek MLA: RoPE covers this part alone
        head_dim = cfg["qk_rope_head_dim"]
    elif cfg.get("head_dim") is not None:
        head_dim = cfg["head_dim"]
    else:
        hidden, heads = _need(cfg, "hidden_size"), _need(cfg, "num_attention_heads")
        if hidden % heads:
            raise RopeValueError(
                f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})"
            )
        head_dim = hidden // heads
    partial = params.get(
        "partial_rotary_factor", cfg.get("partial_rotary_factor", cfg.get("rotary_pct"))
    )
    if partial is not None:
        if not (0 < float(partial) <= 1):
            raise RopeValueError(f"partial_rotary_factor must be in (0, 1], got {partial}")
        rotary_dim = int(head_dim * float(partial))  # truncation, as transformers does
        if rotary_dim % 2:
            raise RopeValueError(
                f"partial_rotary_factor {partial} of head_dim {head_dim} gives an odd "
                f"rotary_dim ({rotary_dim})"
            )
    else:
        rotary_dim = head_dim
    absolute = cfg.get("rotary_dim")  # GPT-J, CodeGen: the rotated features themselves
    if absolute is not None:
        if partial is not None and absolute != rotary_dim:
            raise RopeValueError(
                f"config has rotary_dim={absolute} and a partial rotary factor {partial} of "
                f"head_dim {head_dim} ({rotary_dim} features), which disagree"
            )
        rotary_dim = absolute

    if style is None:
        if model_type in HALF_FAMILIES:
            style = "half"
        elif model_type in INTERLEAVED_FAMILIES:
            style = "interleaved"
        else:
            raise RopeValueError(
                f"model_type {model_type!r} has no known pair style; pass style='half' "
                "(rotate_half) or style='interleaved' (adjacent pairs)"
            )

    max_pos = cfg.get("max_position_embeddings")
    orig = params.get(
        "original_max_position_embeddings", cfg.get("original_max_position_embeddings")
    )
    rule = None
    if kind == "linear":
        rule = sc.Linear(_need(params, "factor", "rope_scaling"))
    elif kind == "dynamic":
        rule = sc.DynamicNTK(
            _need(params, "factor", "rope_scaling"), orig or _need(cfg, "max_position_embeddings")
        )
    elif kind == "yarn":
        orig = orig or _need(cfg, "max_position_embeddings")
        factor = params.get("factor")
        if factor is None:
            factor = _need(cfg, "max_position_embeddings") / orig
        rule = sc.YaRN(
            factor,
            orig,
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            mscale=params.get("mscale") or 0.0,
            mscale_all_dim=params.get("mscale_all_dim") or 0.0,
            attention_factor=params.get("attention_factor"),
            truncate=params.get("truncate", True),
        )
    elif kind == "longrope":
        orig = orig or _need(cfg, "max_position_embeddings")
        factor = params.get("factor")
        if factor is None and max_pos is not None:
            factor = max_pos / orig
        rule = sc.LongRoPE(
            _need(params, "short_factor", "rope_scaling"),
            _need(params, "long_factor", "rope_scaling"),
            orig,
            factor=factor,
            attention_factor=params.get("attention_factor"),
        )
    elif kind == "llama3":
        rule = sc.Llama3(
            _need(params, "factor", "rope_scaling"),
            _need(params, "low_freq_factor", "rope_scaling"),
            _need(params, "high_freq_factor", "rope_scaling"),
            _need(params, "original_max_position_embeddings", "rope_scaling"),
        )

    sections = params.get("mrope_section")
    if sections is not None:
        assign = "interleaved" if params.get("mrope_interleaved") else "contiguous"
        return cls.sectioned(
            head_dim,
            tuple(sections),
            base=theta,
            style=style,
            assign=assign,
            rotary_dim=rotary_dim,
            max_positions=max_positions,
            scaling=rule,
        )
    if not (isinstance(theta, (int, float)) and math.isfinite(theta)):
        raise RopeValueError(f"rope_theta must be a finite number, got {theta!r}")
    return cls(
        head_dim,
        base=theta,
        style=style,
        rotary_dim=rotary_dim,
        max_positions=max_positions,
        scaling=rule,
    )
