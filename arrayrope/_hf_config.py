"""RoPE.from_hf_config: the RoPE a Hugging Face config describes, as transformers rotates it.

A config names the frequencies: rope_theta, the rope type and its fields, the rotated fraction
and the head size, read here; the pair and axis layouts live in each family's modeling code
(_hf_layouts). tests/test_hf_families.py drives every rotary family of the installed
transformers through its own modules against what this builds.
"""

import json
import math
import os

from . import _hf_layouts as layouts
from ._errors import RopeTypeError, RopeValueError
from ._spec import base_arg, dims_arg, style_arg

# Families whose config class defaults rope_theta to 10000 when the file omits it.
THETA_10000_FAMILIES = frozenset(
    {"llama", "mistral", "mixtral", "gptj", "codegen", "phi", "gpt_neox"}
)
# Other names of the fields read here (the GPT-2 lineage: GPT-J, CodeGen; vision towers'
# num_heads), as transformers' config classes map them (attribute_map).
_FIELD_ALIASES = {
    "hidden_size": ("n_embd", "d_model"),
    "num_attention_heads": ("n_head", "num_heads"),
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
    "rope_interleave",
    "layer_types",
)
# The parts of a composite config (vision-language, speech) that may hold a RoPE.
PARTS = ("text", "vision", "audio")

_COMMON_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    "original_max_position_embeddings",
    "mrope_section",
    "mrope_interleaved",
}
# Keys transformers writes beside the RoPE's own that do not change the rotation: the model's
# length, and Llama 4's attention temperature (a scale of the queries after the rotation).
_IGNORED_KEYS = {"max_position_embeddings", "llama_4_scaling_beta"}
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
    "proportional": {"factor"},
    "axial": set(),
}
_ALIASES = {"su": "longrope", "mrope": "default"}


def _fields(config):
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
            except Exception:  # noqa: BLE001 - per-layer configs raise for global reads
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


def _has_rope(cfg):
    return any(cfg.get(k) is not None for k in ("rope_parameters", "rope_scaling", "rope_theta"))


def _part(cfg, part):
    """The fields of the part of a composite config that holds the RoPE asked for: the config
    itself where it has RoPE fields and no part was named, else its ``{part}_config``."""
    if part is not None and part not in PARTS:
        raise RopeValueError(f"part must be one of {', '.join(map(repr, PARTS))}, got {part!r}")
    if part is None and _has_rope(cfg):
        return cfg
    sub = cfg.get(f"{part or 'text'}_config")
    if sub is None:
        if part is None:
            return cfg  # no RoPE fields at all: the family's defaults, or an error below
        raise RopeValueError(f"config of model_type {cfg.get('model_type')!r} has no {part}_config")
    sub = _fields(sub)
    sub.setdefault("model_type", f"{cfg.get('model_type')}_{part or 'text'}")
    return sub


def _nested(cfg):
    """{layer type: its rope parameters (None for a layer without RoPE)} where the config
    keeps one set per layer type (every value a mapping), else None; in the order of the
    config's layer_types."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if not isinstance(params, dict) or not params:
        return None
    if not all(v is None or isinstance(v, dict) for v in params.values()):
        return None
    used = [k for k in dict.fromkeys(cfg.get("layer_types") or []) if k in params]
    return {k: params[k] for k in used + [k for k in params if k not in used]}


def _layer(cfg, layer_type):
    """(fields with the layer type's overrides, its flat rope parameters)."""
    nested = _nested(cfg)
    if nested is None:
        if layer_type is not None and layer_type not in (cfg.get("layer_types") or []):
            raise RopeValueError(
                f"layer_type {layer_type!r} is not a layer type of this config "
                f"(layer_types: {sorted(set(cfg.get('layer_types') or [])) or 'none'})"
            )
        params = cfg.get("rope_parameters")
        scaling = cfg.get("rope_scaling")
        if scaling and params and scaling != params:
            raise RopeValueError(
                "config has both rope_scaling and rope_parameters, and they differ"
            )
        params = params or scaling or {}
        if not isinstance(params, dict):
            raise RopeTypeError("rope_scaling / rope_parameters must be a mapping")
        return cfg, dict(params)
    if layer_type is None:
        raise RopeValueError(
            f"config has one RoPE per layer type ({', '.join(nested)}): pass layer_type= one "
            "of them, or use RoPE.from_hf_layers for all"
        )
    if layer_type not in nested:
        raise RopeValueError(
            f"layer_type must be one of {', '.join(map(repr, nested))}, got {layer_type!r}"
        )
    params = nested[layer_type]
    if params is None:
        raise RopeValueError(f"layer type {layer_type!r} of this config has no RoPE")
    overrides = _layer_overrides(cfg, layer_type)
    return {**cfg, **overrides}, dict(params)


def _layer_overrides(cfg, layer_type):
    """The per-layer fields (a heterogeneous config's per_layer_config, keyed by layer index)
    of the layers of ``layer_type``; the head sizes they give must agree."""
    per_layer = {
        int(k): v for k, v in (cfg.get("per_layer_config") or {}).items() if str(k).isdigit()
    }
    found, sizes = None, set()
    for index, kind in enumerate(cfg.get("layer_types") or []):
        if kind == layer_type:
            fields = per_layer.get(index) or {}
            sizes.add(_head_dim({**cfg, **fields}))
            found = fields if found is None else found
    if len(sizes) > 1:
        raise RopeValueError(
            f"layers of type {layer_type!r} have different head sizes {sorted(sizes)}"
        )
    return found or {}


def _kind(params, model_type):
    kind, old_kind = params.get("rope_type"), params.get("type")
    if kind and old_kind and _ALIASES.get(kind, kind) != _ALIASES.get(old_kind, old_kind):
        raise RopeValueError(f"rope_type {kind!r} and type {old_kind!r} disagree")
    kind = kind or old_kind or "default"
    kind = _ALIASES.get(kind, kind)
    if kind not in _KEYS:
        raise RopeValueError(f"unknown rope type {kind!r}; known: {', '.join(sorted(_KEYS))}")
    unknown = set(params) - _COMMON_KEYS - _IGNORED_KEYS - _KEYS[kind]
    if {"short_mscale", "long_mscale"} & unknown:
        raise RopeValueError(
            f"model_type {model_type!r} gives short_mscale and long_mscale: its code scales "
            "cos and sin by one or the other with the sequence length while keeping the short "
            "frequencies, which no arrayrope scaling rule does"
        )
    if unknown:
        raise RopeValueError(f"unknown field(s) for rope type {kind!r}: {sorted(unknown)}")
    return kind


def _need(cfg, key, where="config"):
    value = cfg.get(key)
    if value is None:
        raise RopeValueError(f"{where} has no {key!r}, which this rope type needs")
    return value


def _theta(cfg, params):
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
        if cfg.get("model_type") not in THETA_10000_FAMILIES:
            raise RopeValueError(
                f"config has no rope_theta, and model_type {cfg.get('model_type')!r} has no "
                "known default"
            )
        theta = 10000.0
    if not (isinstance(theta, (int, float)) and math.isfinite(theta)):
        raise RopeValueError(f"rope_theta must be a finite number, got {theta!r}")
    return float(theta)


def _head_dim(cfg):
    """The head size transformers' rotary module reads: head_dim, else hidden_size //
    num_attention_heads (floored, as the family's projections are)."""
    for name in ("head_dim", "hidden_size", "num_attention_heads"):
        value = cfg.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise RopeTypeError(f"{name} must be an int, got {value!r}")
    if cfg.get("head_dim") is not None:
        return cfg["head_dim"]
    return _need(cfg, "hidden_size") // _need(cfg, "num_attention_heads")


def _partial(cfg, params):
    partial = params.get(
        "partial_rotary_factor", cfg.get("partial_rotary_factor", cfg.get("rotary_pct"))
    )
    if partial is None:
        return None
    if isinstance(partial, bool) or not isinstance(partial, (int, float)):
        raise RopeTypeError(f"partial_rotary_factor must be a number, got {partial!r}")
    if not (0 < partial <= 1):
        raise RopeValueError(f"partial_rotary_factor must be in (0, 1], got {partial}")
    return float(partial)


def _rule(kind, params, cfg):
    from . import scaling as sc

    orig = params.get(
        "original_max_position_embeddings", cfg.get("original_max_position_embeddings")
    )
    max_pos = cfg.get("max_position_embeddings")
    if kind == "linear":
        return sc.Linear(_need(params, "factor", "rope_scaling"))
    if kind == "dynamic":
        return sc.DynamicNTK(
            _need(params, "factor", "rope_scaling"), orig or _need(cfg, "max_position_embeddings")
        )
    if kind == "yarn":
        orig = orig or _need(cfg, "max_position_embeddings")
        factor = params.get("factor")
        if factor is None:
            factor = _need(cfg, "max_position_embeddings") / orig
        return sc.YaRN(
            factor,
            orig,
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            mscale=params.get("mscale") or 0.0,
            mscale_all_dim=params.get("mscale_all_dim") or 0.0,
            attention_factor=params.get("attention_factor"),
            truncate=params.get("truncate", True),
        )
    if kind == "longrope":
        orig = orig or _need(cfg, "max_position_embeddings")
        factor = params.get("factor")
        if factor is None and max_pos is not None:
            factor = max_pos / orig
        return sc.LongRoPE(
            _need(params, "short_factor", "rope_scaling"),
            _need(params, "long_factor", "rope_scaling"),
            orig,
            factor=factor,
            attention_factor=params.get("attention_factor"),
        )
    if kind == "llama3":
        return sc.Llama3(
            _need(params, "factor", "rope_scaling"),
            _need(params, "low_freq_factor", "rope_scaling"),
            _need(params, "high_freq_factor", "rope_scaling"),
            _need(params, "original_max_position_embeddings", "rope_scaling"),
        )
    return None


def rope_from_hf_config(cls, config, style, max_positions, layer_type, part):
    from . import scaling as sc

    cfg = _part(_fields(config), part)
    cfg, params = _layer(cfg, layer_type)
    model_type = cfg.get("model_type")
    kind = _kind(params, model_type)
    theta = _theta(cfg, params)
    partial = _partial(cfg, params)
    style = layouts.style(model_type, cfg.get("rope_interleave"), style)
    sign = layouts.sign(model_type)

    if kind == "axial":  # a vision tower: its head size may be over embed_dim
        head_dim = _head_dim({**cfg, "hidden_size": cfg.get("embed_dim") or cfg["hidden_size"]})
        rotary_dim, blocks, pair_axis, order = layouts.axial(model_type, head_dim, theta)
        return _build(
            cls, head_dim, rotary_dim, style, theta, max_positions, None,
            blocks=blocks, pair_axis=pair_axis, pick=layouts.pick(sign, order, len(pair_axis)),
        )  # fmt: skip
    if cfg.get("qk_rope_head_dim") is not None:  # MLA: RoPE covers this part of a head alone
        head_dim = int(cfg["qk_rope_head_dim"])
        rotated = head_dim
        if partial is not None:
            rotated = int(_head_dim(cfg) * partial)  # transformers scales the config's head_dim
            if rotated != head_dim:
                raise RopeValueError(
                    f"config of model_type {model_type!r} rotates {rotated} features "
                    f"(partial_rotary_factor {partial} of head_dim {_head_dim(cfg)}) of a "
                    f"rotary part of qk_rope_head_dim={head_dim}"
                )
    else:
        head_dim = _head_dim(cfg)
        # transformers truncates, and rotates ceil(rotated / 2) pairs at exponents over
        # ``rotated`` itself, odd or not
        rotated = head_dim if partial is None else int(head_dim * partial)
    absolute = cfg.get("rotary_dim")
    if absolute is not None and model_type in layouts.ABSOLUTE_ROTARY_DIM_FAMILIES:
        if partial is not None and absolute != rotated:
            raise RopeValueError(
                f"config has rotary_dim={absolute} and a partial rotary factor {partial} of "
                f"head_dim {head_dim} ({rotated} features), which disagree"
            )
        rotated = int(absolute)
    if kind == "proportional":  # pairs across the whole head, the unrotated ones at zero
        rule = sc.Proportional(1.0 if partial is None else partial, params.get("factor", 1.0))
        rotary_dim, rotated = head_dim, head_dim
    elif rotated < 1:
        raise RopeValueError(f"config rotates no features (head_dim {head_dim}, {partial=})")
    else:
        rule = _rule(kind, params, cfg)
        rotary_dim = rotated + rotated % 2
    pair_axis = layouts.sections(model_type, params, rotary_dim)
    return _build(
        cls, head_dim, rotary_dim, style, theta, max_positions, rule,
        blocks=[(rotated, theta)], pair_axis=pair_axis,
        pick=layouts.pick(sign, None, rotary_dim // 2),
    )  # fmt: skip


def _build(
    cls, head_dim, rotary_dim, style, base, max_positions, scaling, blocks, pair_axis, pick=None
):
    """A RoPE of any frequency blocks and pair layout (see RoPE._setup), checked as the public
    constructors check theirs."""
    head_dim, rotary_dim = dims_arg(head_dim, rotary_dim)
    rope = cls.__new__(cls)
    rope._setup(
        head_dim, rotary_dim, style_arg(style), base_arg(base), max_positions, scaling,
        blocks, pair_axis, pick,
    )  # fmt: skip
    return rope


def hf_layer_ropes(cls, config, style, max_positions, part):
    """{layer type: RoPE, or None for a layer type without RoPE} of every layer type."""
    cfg = _part(_fields(config), part)
    nested = _nested(cfg)
    kinds = nested if nested is not None else dict.fromkeys(cfg.get("layer_types") or [])
    if not kinds:
        raise RopeValueError("config has no layer_types; use RoPE.from_hf_config")
    ropes = {}
    for kind in kinds:
        if nested is not None and nested[kind] is None:
            ropes[kind] = None
            continue
        ropes[kind] = rope_from_hf_config(
            cls, config, style, max_positions, kind if nested is not None else None, part
        )
    return ropes
