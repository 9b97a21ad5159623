"""Which layers of a transformers model take a RoPE, and which: the rules of families whose
layers choose it by layer type, by index (no_rope_layers, layer_rope_theta,
rope_scaling_layers) or by config fields (a sliding window, a position embedding switch), as
each family's attention and model code do. tests/test_hf_layers.py runs these families' own
models layer by layer against them.
"""

from ._errors import RopeTypeError, RopeValueError

# Layer types whose layers take no position embedding in every family: layers that are not
# softmax attention (convolutions, linear attention, NemotronH's MLP and MoE blocks).
NO_ROPE_LAYER_TYPES = frozenset({"conv", "linear_attention", "mlp", "moe"})


def _entry(cfg, name, index):
    """The per-layer field ``name`` of ``cfg`` at layer ``index``."""
    values = cfg.get(name)
    if not isinstance(values, (list, tuple)) or not 0 <= index < len(values):
        raise RopeValueError(
            f"config of model_type {cfg.get('model_type')!r} needs {name} with an entry for "
            f"layer {index}, got {values!r}"
        )
    return values[index]


def _sliding(cfg, index, kind):
    return kind == "sliding_attention"


def _window(cfg):
    """Whether the config sets a sliding window: each of these families' config classes sets
    one by default, so a file without the field has one."""
    return "sliding_window" not in cfg or cfg["sliding_window"] is not None


def _windowed(cfg, index, kind):  # a sliding layer whose window the config sets
    return kind == "sliding_attention" and _window(cfg)


def _global_nope(cfg, index, kind):  # without a window every layer rotates; with one, sliding ones
    return not _window(cfg) or kind == "sliding_attention"


def _dense_prefix(cfg, index, kind):  # Cohere 2 MoE: dense layers rotate when the pattern is 1
    forced = (
        _entry(cfg, "mlp_layer_types", index) == "dense"
        and cfg.get("prefix_dense_sliding_window_pattern", 1) == 1  # the class's default
    )
    return forced or _windowed(cfg, index, kind)


def _listed(name):  # a per-layer list whose entry is true (1, a nonzero theta) where layers rotate
    return lambda cfg, index, kind: bool(_entry(cfg, name, index))


def _own_theta(cfg, index, kind):  # Granite SWA: each layer's base, 0 for none
    if cfg.get("layer_rope_theta") is None:  # its class's default: the config's base everywhere
        return {}
    theta = _entry(cfg, "layer_rope_theta", index)
    return {"rope_theta": theta} if theta else None


def _scaled_layers(cfg, index, kind):  # Molmo2: layers outside the list take the unscaled rope
    layers = cfg.get("rope_scaling_layers")
    if layers is not None and not isinstance(layers, (list, tuple)):
        raise RopeTypeError(f"rope_scaling_layers must be a list of layer indices, got {layers!r}")
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        return {}  # refused as the config's parameters are read
    scaled = params.get("rope_type", params.get("type", "default")) != "default"
    return {} if not scaled or layers is None or index in layers else UNSCALED


# The override of the rope parameters that marks a layer rotated by the config's base alone.
UNSCALED = {"rope_type": "default"}

# Families whose layers choose their RoPE by their index or by config fields besides their layer
# type, as each family's attention and model code do: rule(cfg, layer index, layer type) gives
# whether the layer rotates, or None (no RoPE) or the overrides of the config's rope parameters
# that it rotates by ({}: none).
LAYER_RULES = {
    "afmoe": _sliding,
    "cohere2": _windowed,
    "flint": _windowed,
    "cohere2_moe": _dense_prefix,
    "exaone4": _global_nope,
    "exaone_moe": _global_nope,
    "kolibri1": _global_nope,
    "llama4_text": _listed("no_rope_layers"),
    "smollm3": _listed("no_rope_layers"),
    "mistral_large4_text": _listed("no_rope_layers"),
    "muse_glimmer_text": _listed("layer_rope_theta"),
    "muse_spark_text": _listed("layer_rope_theta"),
    "granite_swa": _own_theta,
    "granitemoe_swa": _own_theta,
    "molmo2_text": _scaled_layers,
}


def layer_kinds(cfg):
    """The layer type of each layer (None where the config names none)."""
    kinds = cfg.get("layer_types")
    if kinds:
        return list(kinds)
    count = cfg.get("num_hidden_layers")
    return [None] * count if type(count) is int and count > 0 else []


def layer_rope(cfg, index, kind):
    """None where layer ``index`` (of layer type ``kind``) takes no RoPE, else the overrides of
    the config's rope parameters that it rotates by ({}: none)."""
    if not switched_on(cfg) or kind in NO_ROPE_LAYER_TYPES:
        return None
    rule = LAYER_RULES.get(cfg.get("model_type"))
    found = {} if rule is None else rule(cfg, index, kind)
    if isinstance(found, bool):
        return {} if found else None
    return found


def type_rope(cfg, layer_type):
    """layer_rope shared by every layer of ``layer_type`` (None: of the layers that rotate):
    None where they take no RoPE; a RopeValueError where the layers differ."""
    if not switched_on(cfg) or layer_type in NO_ROPE_LAYER_TYPES:
        return None
    if cfg.get("model_type") not in LAYER_RULES:
        return {}
    found = [
        layer_rope(cfg, i, kind)
        for i, kind in enumerate(layer_kinds(cfg))
        if layer_type is None or kind == layer_type
    ]
    if layer_type is None:
        found = [f for f in found if f is not None] or [None]
    distinct = [f for i, f in enumerate(found) if f not in found[:i]]
    if len(distinct) > 1:
        which = "its layers" if layer_type is None else f"layers of type {layer_type!r}"
        indices = [
            i for i, kind in enumerate(layer_kinds(cfg)) if layer_type is None or kind == layer_type
        ]
        groups = "; ".join(
            f"{_describe(f)} at layers {_some([i for i, g in zip(indices, found) if g == f])}"
            for f in distinct
        )
        raise RopeValueError(
            f"{which} of model_type {cfg.get('model_type')!r} do not share one RoPE ({groups}): "
            "pass layer= a layer index, or use RoPE.from_hf_layers(config, per_layer=True)"
        )
    return distinct[0] if distinct else {}


def _some(indices):
    shown = ", ".join(map(str, indices[:4]))
    return shown if len(indices) <= 4 else f"{shown}, ... ({len(indices)} layers)"


def _describe(overrides):
    if overrides is None:
        return "no RoPE"
    if overrides == UNSCALED:
        return "unscaled"
    return ", ".join(f"{k}={v!r}" for k, v in overrides.items()) or "the config's"


# Families whose attention takes a RoPE only where a config field says so: (field, its default
# where a config leaves it out, the value that turns the RoPE on; True: any true value).
ROPE_SWITCHES = {
    "zamba2": ("use_mem_rope", False, True),
    "clvp_encoder": ("use_rotary_embedding", True, True),
    # conformer speech encoders, whose attention rotates its input hidden states, viewed as
    # heads, before the q and k projections (by base rotary_embedding_base)
    "wav2vec2-conformer": ("position_embeddings_type", "relative", "rotary"),
    "wav2vec2-bert": ("position_embeddings_type", "relative_key", "rotary"),
    "seamless_m4t": ("position_embeddings_type", "relative", "rotary"),
    # encoders that choose their position embedding by the same kind of field
    "esm": ("position_embedding_type", "absolute", "rotary"),
    "evolla_protein_encoder": ("position_embedding_type", "absolute", "rotary"),
    "granitemoehybrid": ("position_embedding_type", None, "rope"),
}


def switched_on(cfg):
    """Whether the family's switch (ROPE_SWITCHES), if it has one, turns its RoPE on."""
    switch = ROPE_SWITCHES.get(cfg.get("model_type"))
    if switch is None:
        return True
    field, default, on = switch
    value = cfg.get(field, default)
    return bool(value) if on is True else value == on
