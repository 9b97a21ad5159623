"""Reading a Hugging Face config: its fields as a dict (from a dict, a config.json, a model folder
or a config object), the part of a composite config and the layer type asked for, and the head
size transformers' rotary modules read. _hf_config builds the RoPE from what this reads."""

import json
import os

from ._errors import RopeTypeError, RopeValueError

# Other names of the fields read here, as transformers' config classes map them (attribute_map):
# for every family (the GPT-2 lineage's, vision towers' num_heads), and for the families whose
# own names mean these fields only there. Two names that disagree are an error.
_FIELD_ALIASES = {
    "hidden_size": ("n_embd", "d_model"),
    "num_attention_heads": ("n_head", "num_heads"),
    "max_position_embeddings": ("n_positions",),
}
_FAMILY_ALIASES = {
    "dbrx": {"num_attention_heads": ("n_heads",), "max_position_embeddings": ("max_seq_len",)},
    "jetmoe": {"head_dim": ("kv_channels",)},
    "zamba": {"head_dim": ("attention_head_dim",), "layer_types": ("layers_block_type",)},
    "zamba2": {"head_dim": ("attention_head_dim",), "layer_types": ("layers_block_type",)},
    "moonshine": {"num_attention_heads": ("decoder_num_attention_heads",)},
    "bailing_hybrid": {"max_position_embeddings": ("model_max_length",)},
    "bamba": {"layer_types": ("layers_block_type",)},
    "falcon_h1": {"layer_types": ("layers_block_type",)},
    "nemotron_h": {"layer_types": ("layers_block_type",)},
    "recurrent_gemma": {"layer_types": ("layers_block_type",)},
    "glm4_moe_lite": {"head_dim": ("qk_rope_head_dim",)},
    "idefics_vision": {"hidden_size": ("embed_dim",)},
    "mllama_vision_model": {"num_attention_heads": ("attention_heads",)},
    "qwen2_5_omni_audio_encoder": {"num_attention_heads": ("encoder_attention_heads",)},
    "qwen3_omni_moe_audio_encoder": {"num_attention_heads": ("encoder_attention_heads",)},
    "wav2vec2-conformer": {"rope_theta": ("rotary_embedding_base",)},
    "wav2vec2-bert": {"rope_theta": ("rotary_embedding_base",)},
    "seamless_m4t": {
        "rope_theta": ("rotary_embedding_base",),
        "num_attention_heads": ("decoder_attention_heads",),  # its RoPE's: _HEADS_FIELDS
    },
}
# Families whose RoPE's heads are counted by another field than num_attention_heads:
# SeamlessM4T's is its speech encoder's.
_HEADS_FIELDS = {"seamless_m4t": "speech_encoder_attention_heads"}
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
# Video trackers whose RoPE turns the memory attention's heads: memory_attention_hidden_size,
# divided by its downsample rate, over memory_attention_num_attention_heads.
MEMORY_ATTENTION_FAMILIES = frozenset({"sam2_video", "sam3_tracker_video", "edgetam_video"})


def fields(config):
    """The config's fields as a dict: from a dict, a config.json (or a model folder holding
    one), or an object (a transformers config: its fields read through its attributes)."""
    if isinstance(config, dict):
        return _derived(_canonical(dict(config)))
    if isinstance(config, (str, os.PathLike)):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        try:
            with open(path) as f:
                return _derived(_canonical(json.load(f)))
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


# Names transformers' config classes give in place of a file's: a model type a class renames
# (EXAONE 4.5's released text model), and the older layer type names it maps to the current ones.
_MODEL_TYPE_RENAMES = {"exaone4_5_text": "exaone4"}
_LEGACY_LAYER_TYPES = {
    "mamba": "linear_attention",
    "attention": "full_attention",
    "deepseek_sparse_attention": "indexed_attention",
    "qwen_sparse_attention": "indexed_attention",
}


def _every(pattern, count):
    """Layer types of ``count`` layers where every ``pattern``-th is global, the rest sliding."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(count)]


def _cohere2_moe(cfg, count):
    dense = cfg.get("first_k_dense_replace", 0)
    kinds = _every(cfg.get("prefix_dense_sliding_window_pattern", 1), dense)
    kinds += _every(cfg.get("sliding_window_pattern", 4), count - dense)
    return kinds, ["dense" if i < dense else "sparse" for i in range(count)]


def _every_fourth_unrotated(cfg, count):
    """SmolLM3's, Llama 4's and Mistral Large 4's no_rope_layers: 0 (NoPE) every
    no_rope_layer_interval-th layer. Llama 4's class treats an empty list as none given."""
    layers = cfg.get("no_rope_layers")
    if layers is not None and not (layers == [] and cfg.get("model_type") == "llama4_text"):
        return {}
    interval = cfg.get("no_rope_layer_interval", 4)
    if type(interval) is not int or interval < 1:
        raise RopeValueError(f"no_rope_layer_interval must be a positive int, got {interval!r}")
    return {"no_rope_layers": [int((i + 1) % interval != 0) for i in range(count)]}


def _muse_thetas(cfg, count):
    """MuSE's layer_rope_theta: 0 (NoPE) every fourth layer counted from the last; the rest
    rotate by the config's base (only whether a layer rotates is read from it)."""
    if cfg.get("layer_rope_theta") is not None:
        return {}
    return {"layer_rope_theta": [int((count - 1 - i) % 4 != 0) for i in range(count)]}


def _layer_types_by(derive):
    """A derivation of layer_types (and, as a second value, mlp_layer_types) where none given."""

    def fields(cfg, count):
        if cfg.get("layer_types") is not None:
            return {}
        for name in ("sliding_window_pattern", "prefix_dense_sliding_window_pattern"):
            pattern = cfg.get(name)
            if pattern is not None and (type(pattern) is not int or pattern < 1):
                raise RopeValueError(
                    f"config of model_type {cfg['model_type']!r} needs a positive int {name}, "
                    f"got {pattern!r}"
                )
        found = derive(cfg, count)
        if isinstance(found, tuple):
            found, mlp = found
            if cfg.get("mlp_layer_types") is None:
                return {"layer_types": found, "mlp_layer_types": mlp}
        return {} if found is None else {"layer_types": found}

    return fields


# Per-layer fields that a family's config class derives where a file gives none, as it derives
# them: {family: (cfg, number of layers) -> {field: value}}, empty where the file gives them.
_DERIVED = {
    "cohere2": _layer_types_by(
        lambda cfg, count: _every(cfg.get("sliding_window_pattern", 4), count)
    ),
    "exaone4": _layer_types_by(
        lambda cfg, count: (
            _every(cfg.get("sliding_window_pattern", 4), count)
            if cfg.get("sliding_window", 4096) is not None  # its class's default window
            else None
        )
    ),
    "cohere2_moe": _layer_types_by(_cohere2_moe),
    "smollm3": _every_fourth_unrotated,
    "llama4_text": _every_fourth_unrotated,
    "mistral_large4_text": _every_fourth_unrotated,
    "muse_glimmer_text": _muse_thetas,
    "muse_spark_text": _muse_thetas,
}


def _derived(cfg):
    """A file's fields with what its family's config class derives from them (see _DERIVED):
    a config object has them already."""
    derive = _DERIVED.get(cfg.get("model_type"))
    count = cfg.get("num_hidden_layers")
    if derive is not None and type(count) is int:
        cfg.update(derive(cfg, count))
    return cfg


def _canonical(cfg):
    """``cfg`` with the current names of aliased fields (two names that disagree are an error),
    of its model type and of its layer types, its layer_types checked."""
    if cfg.get("model_type") in _MODEL_TYPE_RENAMES:
        cfg["model_type"] = _MODEL_TYPE_RENAMES[cfg["model_type"]]
    aliases = {**_FIELD_ALIASES, **_FAMILY_ALIASES.get(cfg.get("model_type"), {})}
    for name, others in aliases.items():
        for alias in others:
            value = cfg.get(alias)
            if value is None:
                continue
            if cfg.get(name) is not None and cfg[name] != value:
                raise RopeValueError(
                    f"config has {name}={cfg[name]!r} and {alias}={value!r}, which disagree"
                )
            cfg[name] = value
    kinds = cfg.get("layer_types")
    if kinds is not None and (
        not isinstance(kinds, (list, tuple)) or not all(isinstance(k, str) for k in kinds)
    ):
        raise RopeTypeError(f"layer_types must be a list of strings, got {kinds!r}")
    if kinds is not None:
        cfg["layer_types"] = [_LEGACY_LAYER_TYPES.get(k, k) for k in kinds]
    return cfg


def _has_rope(cfg):
    return any(cfg.get(k) is not None for k in ("rope_parameters", "rope_scaling", "rope_theta"))


def part_of(cfg, part):
    """The fields of the part of a composite config that holds the RoPE asked for: the config
    itself where it has RoPE fields and no part was named, else its ``{part}_config``, found at
    the shallowest depth that has one (Qwen-Omni keeps its parts under thinker_config), or
    along a dotted path ("talker.text"). A part with no RoPE fields of its own is read at its
    text part."""
    if part is not None and (not isinstance(part, str) or not part):
        raise RopeTypeError(f"part must be a non-empty str, got {part!r}")
    if part is None and _has_rope(cfg):
        return cfg
    model_type = cfg.get("model_type")
    found = [("", cfg)]
    for name in (part or "text").split("."):
        found = _nearest(found, f"{name}_config")
    if not found:
        if part is None:
            return cfg  # no RoPE fields at all: the family's defaults, or an error below
        parts = ", ".join(repr(p) for p, _ in _nearest([("", cfg)], None)) or "none"
        raise RopeValueError(
            f"config of model_type {model_type!r} has no {part!r} part (its parts: {parts})"
        )
    if len(found) > 1:
        raise RopeValueError(
            f"config of model_type {model_type!r} has {len(found)} {part or 'text'!r} parts: "
            f"pass part= one of {', '.join(repr(p) for p, _ in found)}"
        )
    path, sub = found[0]
    sub = fields(sub)
    sub.setdefault("model_type", f"{model_type}_{path.replace('.', '_')}")
    if not _has_rope(sub) and isinstance(sub.get("text_config"), dict):
        return part_of(sub, None)
    return sub


def _nearest(found, key):
    """(dotted path, fields) of the sub-configs named ``key`` (any ``*_config`` where None)
    under each of ``found``, at the shallowest depth that has one."""
    level = found
    while level:
        hits, deeper = [], []
        for path, cfg in level:
            for k, v in cfg.items():
                if isinstance(v, dict) and k.endswith("_config") and k != "_config":
                    child = (f"{path}.{k[:-7]}" if path else k[:-7], v)
                    (hits if key is None or k == key else deeper).append(child)
        if hits or key is None:
            return hits
        level = deeper
    return []


def nested(cfg):
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


def layer(cfg, layer_type):
    """(fields with the layer type's overrides, its flat rope parameters)."""
    per_type = nested(cfg)
    if per_type is None:
        if layer_type is not None and layer_type not in (cfg.get("layer_types") or []):
            raise RopeValueError(
                f"layer_type {layer_type!r} is not a layer type of this config "
                f"(layer_types: {sorted(set(cfg.get('layer_types') or [])) or 'none'})"
            )
        params = cfg.get("rope_parameters")
        scaling = cfg.get("rope_scaling")
        if scaling and params and scaling != params:
            raise RopeValueError(
                f"config has both rope_scaling ({scaling!r}) and rope_parameters ({params!r}), "
                "and they differ"
            )
        params = params or scaling or {}
        if not isinstance(params, dict):
            raise RopeTypeError(f"rope_scaling / rope_parameters must be a mapping, got {params!r}")
        return cfg, dict(params)
    if layer_type is None:
        raise RopeValueError(
            f"config has one RoPE per layer type ({', '.join(per_type)}): pass layer_type= one "
            "of them, or use RoPE.from_hf_layers for all"
        )
    if layer_type not in per_type:
        raise RopeValueError(
            f"layer_type must be one of {', '.join(map(repr, per_type))}, got {layer_type!r}"
        )
    params = per_type[layer_type]
    if params is None:
        raise RopeValueError(f"layer type {layer_type!r} of this config has no RoPE")
    overrides = _layer_overrides(cfg, layer_type)
    return {**cfg, **overrides}, dict(params)


def _layer_overrides(cfg, layer_type):
    """The per-layer fields (a heterogeneous config's per_layer_config, keyed by layer index)
    of the layers of ``layer_type``; the head sizes they give must agree."""
    found_per_layer = cfg.get("per_layer_config") or {}
    if not isinstance(found_per_layer, dict) or not all(
        isinstance(v, dict) for v in found_per_layer.values()
    ):
        raise RopeTypeError(
            f"per_layer_config must map layer indices to mappings of fields, got "
            f"{found_per_layer!r:.200}"
        )
    per_layer = {int(k): v for k, v in found_per_layer.items() if str(k).isdigit()}
    found, sizes = None, set()
    for index, kind in enumerate(cfg.get("layer_types") or []):
        if kind == layer_type:
            overrides = per_layer.get(index) or {}
            sizes.add(head_dim({**cfg, **overrides}))
            found = overrides if found is None else found
    if len(sizes) > 1:
        raise RopeValueError(
            f"layers of type {layer_type!r} have different head sizes {sorted(sizes)}"
        )
    return found or {}


def need(cfg, key, where="config"):
    value = cfg.get(key)
    if value is None:
        raise RopeValueError(f"{where} has no {key!r}, which this rope type needs")
    return value


def integer(cfg, name, minimum=1):
    """The int field ``name`` of ``cfg`` (None where absent), checked."""
    value = cfg.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RopeTypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise RopeValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def head_dim(cfg):
    """The head size transformers' rotary module reads: head_dim, else hidden_size //
    num_attention_heads (floored, as the family's projections are)."""
    found = integer(cfg, "head_dim")
    if found is not None:
        return found
    if cfg.get("model_type") in MEMORY_ATTENTION_FAMILIES:  # the RoPE is the memory attention's
        width = integer(cfg, "memory_attention_hidden_size")
        rate = integer(cfg, "memory_attention_downsample_rate") or 1
        heads = integer(cfg, "memory_attention_num_attention_heads")
        if width is None or heads is None:
            raise RopeValueError(
                f"config of model_type {cfg.get('model_type')!r} has no "
                "memory_attention_hidden_size or memory_attention_num_attention_heads"
            )
        return width // rate // heads
    heads_field = _HEADS_FIELDS.get(cfg.get("model_type"), "num_attention_heads")
    hidden, heads = integer(cfg, "hidden_size"), integer(cfg, heads_field)
    if hidden is None or heads is None:
        missing = "hidden_size" if hidden is None else heads_field
        raise RopeValueError(f"config has no head_dim and no {missing!r} to derive it from")
    return hidden // heads
