"""RoPE.from_hf_config: the RoPE a Hugging Face config describes, as transformers rotates it.

A config names the frequencies: rope_theta, the rope type and its fields, the rotated fraction
and the head size, turned here into a RoPE's frequency blocks and scaling rule; its fields are
read by _hf_fields, the pair and axis layouts, which live in each family's modeling code, come
from _hf_layouts, and which layers take a RoPE from _hf_layers. tests/test_hf_families.py
drives every rotary family of the installed transformers through its own modules against what
this builds.
"""

import contextlib
import math
import os

from . import _hf_fields as read
from . import _hf_layers as layers
from . import _hf_layouts as layouts
from ._errors import RopeError, RopeTypeError, RopeValueError
from ._spec import base_arg, dims_arg, style_arg

# Families whose config class defaults rope_theta to 10000 when the file omits it.
THETA_10000_FAMILIES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "gptj",
        "codegen",
        "phi",
        "gpt_neox",
        "clvp_encoder",
        "roformer",
    }
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
    # see NTK_ALPHA_FAMILIES: the fields of a YaRN or dynamic rope that its checkpoints also
    # give, which its code does not read
    "ntk_alpha": {"alpha", "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"},
}
# Families whose code reads a "dynamic" rope with an alpha as static NTK scaling by alpha (the
# base times alpha ** (d / (d - 2)), whatever the length: HunYuan's checkpoints label it so).
NTK_ALPHA_FAMILIES = frozenset({"hunyuan_v1_dense", "hunyuan_v1_moe"})
_ALIASES = {"su": "longrope", "mrope": "default"}


def _kind(params, model_type):
    kind, old_kind = params.get("rope_type"), params.get("type")
    if kind and old_kind and _ALIASES.get(kind, kind) != _ALIASES.get(old_kind, old_kind):
        raise RopeValueError(f"rope_type {kind!r} and type {old_kind!r} disagree")
    kind = kind or old_kind or "default"
    kind = _ALIASES.get(kind, kind)
    if kind == "dynamic" and params.get("alpha") and model_type in NTK_ALPHA_FAMILIES:
        kind = "ntk_alpha"
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
        raise RopeValueError(
            f"unknown field(s) for rope type {kind!r} of model_type {model_type!r}: "
            f"{sorted(unknown)}"
        )
    return kind


def _theta(cfg, params, per_type=False):
    """The base; a layer type's own rope_theta is the one its layers read, whatever the
    config's top level says (DeepSeek-V4 keeps its main layers' base there too)."""
    thetas = {
        name: value
        for name, value in (
            ("rope_parameters' rope_theta", params.get("rope_theta")),
            ("rope_theta", None if per_type and "rope_theta" in params else cfg.get("rope_theta")),
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
    if isinstance(theta, bool) or not (isinstance(theta, (int, float)) and math.isfinite(theta)):
        raise RopeValueError(f"rope_theta must be a finite number, got {theta!r}")
    return float(theta)


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
        return sc.Linear(read.need(params, "factor", "rope_scaling"))
    if kind == "ntk_alpha":
        return sc.NTK(params["alpha"])
    if kind == "dynamic":
        # transformers grows the base past max_position_embeddings, whatever
        # original_max_position_embeddings says (its module starts there and its formula reads it)
        return sc.DynamicNTK(
            read.need(params, "factor", "rope_scaling"), read.need(cfg, "max_position_embeddings")
        )
    if kind == "yarn":
        orig = orig or read.need(cfg, "max_position_embeddings")
        factor = params.get("factor")
        if factor is None:
            factor = read.need(cfg, "max_position_embeddings") / orig
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
        orig = orig or read.need(cfg, "max_position_embeddings")
        factor = params.get("factor")
        if factor is None and max_pos is not None:
            factor = max_pos / orig
        return sc.LongRoPE(
            read.need(params, "short_factor", "rope_scaling"),
            read.need(params, "long_factor", "rope_scaling"),
            orig,
            factor=factor,
            attention_factor=params.get("attention_factor"),
        )
    if kind == "llama3":
        return sc.Llama3(
            read.need(params, "factor", "rope_scaling"),
            read.need(params, "low_freq_factor", "rope_scaling"),
            read.need(params, "high_freq_factor", "rope_scaling"),
            read.need(params, "original_max_position_embeddings", "rope_scaling"),
        )
    return None


@contextlib.contextmanager
def _naming(cfg):
    """Errors raised inside name the family, where they do not already."""
    try:
        yield
    except RopeError as error:
        model_type = cfg.get("model_type")
        if model_type is None or repr(model_type) in str(error):
            raise
        raise type(error)(f"model_type {model_type!r}: {error}") from None


def rope_from_hf_config(cls, config, style, max_positions, layer_type, part, angles, layer=None):
    cfg = read.part_of(read.fields(config), part)
    with _naming(cfg):
        return _rope_of(cls, cfg, config, style, max_positions, layer_type, angles, layer)


def _rope_of(cls, cfg, config, style, max_positions, layer_type, angles, layer):
    _check_form(cfg, config)
    model_type = cfg.get("model_type")
    if layer is None:
        overrides = layers.type_rope(cfg, layer_type)
        which = "its layers" if layer_type is None else f"layers of type {layer_type!r}"
    else:
        kinds = layers.layer_kinds(cfg)
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise RopeTypeError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < len(kinds):
            raise RopeValueError(
                f"layer must be in [0, {len(kinds)}) for this config (its layer_types or "
                f"num_hidden_layers), got {layer}"
            )
        if layer_type is not None and layer_type != kinds[layer]:
            raise RopeValueError(
                f"layer {layer} is of type {kinds[layer]!r}, not layer_type {layer_type!r}"
            )
        layer_type = kinds[layer]
        overrides = layers.layer_rope(cfg, layer, layer_type)
        which = f"layer {layer}"
    if overrides is None:
        switch = layers.ROPE_SWITCHES.get(model_type)
        why = ""
        if switch and not layers.switched_on(cfg):
            field, default, on = switch
            value = cfg.get(field, default)
            why = f" with {field} off" if on is True else f" with {field}={value!r}"
        verb = "takes" if layer is not None else "take"
        raise RopeValueError(f"{which} of model_type {model_type!r} {verb} no RoPE{why}")
    if layer is not None and read.nested(cfg) is None and not cfg.get("layer_types"):
        layer_type = None
    return _rope(cls, cfg, style, max_positions, layer_type, angles, overrides)


def _check_form(cfg, config):
    """Refuse a file whose family keeps rope parameters per layer type in the older flat form,
    which transformers converts by the family's own rules (see LAYER_TYPE_FAMILIES)."""
    if isinstance(config, (dict, str, os.PathLike)) or not hasattr(config, "to_dict"):
        model_type = cfg.get("model_type")
        if model_type in layouts.LAYER_TYPE_FAMILIES and read.nested(cfg) is None:
            raise RopeValueError(
                f"config of model_type {model_type!r} gives flat rope fields, which transformers "
                "turns into one set per layer type by the family's own rules: pass the config "
                "object transformers loads (AutoConfig.from_pretrained(...)), or rope_parameters "
                "keyed by layer type"
            )


def _rope(cls, cfg, style, max_positions, layer_type, angles, overrides):
    """The RoPE of the (part's) fields ``cfg`` at ``layer_type``, its rope parameters changed
    by ``overrides`` (see layers.layer_rope)."""
    from . import scaling as sc

    per_type = read.nested(cfg) is not None
    cfg, params = read.layer(cfg, layouts.rope_label(cfg, layer_type))
    if overrides == layers.UNSCALED:  # the config's base, without its scaling rule
        params = {k: params[k] for k in ("rope_theta", "partial_rotary_factor") if k in params}
        params["rope_type"] = "default"
    elif overrides:  # a layer's own base: the one its layers read
        params = {**params, **overrides}
        cfg = {**cfg, "rope_theta": None, "rotary_emb_base": None}
    model_type = cfg.get("model_type")
    if model_type in layouts.UNEXPRESSED:
        raise RopeValueError(f"model_type {model_type!r}: {layouts.UNEXPRESSED[model_type]}")
    kind = _kind(params, model_type)
    if kind == "default" and model_type in layouts.GRID_FAMILIES:
        kind = "axial"  # the family's module turns pairs by the grid it makes (GRID_FAMILIES)
    theta = _theta(cfg, params, per_type)
    interleave = cfg.get("rope_interleave")
    if interleave is not None and not isinstance(interleave, bool):
        raise RopeTypeError(f"rope_interleave must be a bool, got {interleave!r}")
    style = layouts.style(model_type, interleave, style)
    sign = layouts.sign(model_type)

    if kind == "axial":  # a vision tower: its head size may be over embed_dim
        head_dim = read.head_dim(
            {**cfg, "hidden_size": cfg.get("embed_dim") or cfg.get("hidden_size")}
        )
        if model_type in layouts.WHOLE_VECTOR_FAMILIES:
            head_dim = read.integer(cfg, "hidden_size")
            if head_dim is None:
                raise RopeValueError(
                    f"config of model_type {model_type!r} has no hidden_size, the width it rotates"
                )
        rotary_dim, blocks, pair_axis, order = layouts.axial(model_type, head_dim, theta)
        return _build(
            cls, head_dim, rotary_dim, style, theta, max_positions, None,
            blocks=blocks, pair_axis=pair_axis, pick=layouts.pick(sign, order, len(pair_axis)),
            angles=angles,
        )  # fmt: skip
    partial = _partial(cfg, params)
    if kind == "default" and model_type not in layouts.PARTIAL_DEFAULT_FAMILIES:
        partial = None  # the family's default rope ignores it (see PARTIAL_DEFAULT_FAMILIES)
    if cfg.get("qk_rope_head_dim") is not None:  # MLA: RoPE covers this part of a head alone
        head_dim = read.integer(cfg, "qk_rope_head_dim")
        rotated = head_dim
        if partial is not None:
            rotated = int(read.head_dim(cfg) * partial)  # transformers scales the config's head_dim
            if rotated != head_dim:
                raise RopeValueError(
                    f"config of model_type {model_type!r} rotates {rotated} features "
                    f"(partial_rotary_factor {partial} of head_dim {read.head_dim(cfg)}) of a "
                    f"rotary part of qk_rope_head_dim={head_dim}"
                )
    else:
        head_dim = read.head_dim(cfg)
        # transformers truncates, and rotates ceil(rotated / 2) pairs at exponents over
        # ``rotated`` itself, odd or not
        rotated = head_dim if partial is None else int(head_dim * partial)
    absolute = None
    if model_type in layouts.ABSOLUTE_ROTARY_DIM_FAMILIES:
        absolute = read.integer(cfg, "rotary_dim")
    if absolute is None:
        absolute = layouts.derived_rotary_dim(cfg)
    if absolute is not None:
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
        pick=layouts.pick(sign, None, rotary_dim // 2), angles=angles,
    )  # fmt: skip


def _build(
    cls, head_dim, rotary_dim, style, base, max_positions, scaling, blocks, pair_axis, pick=None,
    angles="exact",
):  # fmt: skip
    """A RoPE of any frequency blocks and pair layout (see RoPE._setup), checked as the public
    constructors check theirs."""
    head_dim, rotary_dim = dims_arg(head_dim, rotary_dim)
    rope = cls.__new__(cls)
    rope._setup(
        head_dim, rotary_dim, style_arg(style), base_arg(base), max_positions, scaling,
        blocks, pair_axis, pick, angles,
    )  # fmt: skip
    return rope


def hf_layer_ropes(cls, config, style, max_positions, part, angles, per_layer=False):
    """{layer type: RoPE, or None for a layer type without RoPE} of every layer type; with
    ``per_layer``, [RoPE or None] of every layer, by index."""
    cfg = read.part_of(read.fields(config), part)
    with _naming(cfg):
        return _layer_ropes(cls, cfg, config, style, max_positions, angles, per_layer)


def _layer_ropes(cls, cfg, config, style, max_positions, angles, per_layer):
    _check_form(cfg, config)
    nested = read.nested(cfg)
    if per_layer:
        kinds = layers.layer_kinds(cfg)
        if not kinds:
            raise RopeValueError("config has no layer_types or num_hidden_layers")
        made, ropes = {}, []
        for index, kind in enumerate(kinds):
            overrides = None
            if nested is None or nested.get(layouts.rope_label(cfg, kind)) is not None:
                overrides = layers.layer_rope(cfg, index, kind)
            if overrides is None:
                ropes.append(None)
                continue
            key = (kind if nested is not None else None, repr(overrides))
            if key not in made:
                made[key] = _rope(cls, cfg, style, max_positions, key[0], angles, overrides)
            ropes.append(made[key])
        return ropes
    kinds = nested if nested is not None else dict.fromkeys(cfg.get("layer_types") or [])
    if nested is not None and cfg.get("model_type") in layouts.ROPE_LABELS:
        kinds = dict.fromkeys(cfg.get("layer_types") or nested)  # each read at its label
    if not kinds:
        raise RopeValueError("config has no layer_types; use RoPE.from_hf_config")
    ropes = {}
    for kind in kinds:
        label = layouts.rope_label(cfg, kind)
        overrides = None
        if nested is None or nested.get(label) is not None:
            overrides = layers.type_rope(cfg, kind)
        if overrides is None:
            ropes[kind] = None
        else:
            layer_type = kind if nested is not None else None
            ropes[kind] = _rope(cls, cfg, style, max_positions, layer_type, angles, overrides)
    return ropes
