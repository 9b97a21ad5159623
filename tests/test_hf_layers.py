"""Which layers rotate, and by what, against each family's own model code.

Families whose layers choose their RoPE by index or by config fields besides their layer type
(arrayrope._hf_layers.LAYER_RULES) are run as small models of four layers, with their config
class's defaults and with each per-layer field reversed (and without a sliding window, where
the family's model builds without one). Each attention layer's call of the family's rotary
apply function is recorded: a layer that makes none takes no RoPE, and layers whose cos tables
differ rotate differently. ``RoPE.from_hf_layers(config, per_layer=True)`` must agree, layer by
layer. Every config class of the installed transformers with a per-layer rope field must be one
of those families, and one with a position embedding switch one of ROPE_SWITCHES; a config.json
that leaves out per-layer fields its class derives must read as the class's object does.
"""

import importlib
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

import arrayrope as ar  # noqa: E402
from arrayrope import _hf_layers  # noqa: E402

LAYERS = 4
SMALL = {
    "num_hidden_layers": LAYERS, "hidden_size": 64, "intermediate_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 64,
    "pad_token_id": 0, "max_position_embeddings": 256,
}  # fmt: skip
# multi-head latent attention, at sizes that fit each other
SMALL_MLA = {
    "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8, "index_head_dim": 16,
    "index_n_heads": 2,
}  # fmt: skip


def _per_layer_fields(config):
    n = getattr(config, "num_hidden_layers", None)
    return {
        k: v for k, v in vars(config).items()
        if isinstance(v, (list, tuple)) and isinstance(n, int) and len(v) == n
    }  # fmt: skip


def _small(config_cls, changes):
    defaults = config_cls()
    fields = dict(SMALL)
    if getattr(defaults, "kv_lora_rank", None):
        fields.update(SMALL_MLA)
    for name, value in _per_layer_fields(defaults).items():
        fields[name] = (list(value) * LAYERS)[:LAYERS]
    if getattr(defaults, "rope_scaling_layers", None) is not None:
        fields["rope_scaling_layers"] = list(range(LAYERS))
    for name, value in vars(defaults).items():  # four small experts, two per token, one group
        if isinstance(value, int) and not isinstance(value, bool):
            if name.endswith(("intermediate_size", "hidden_size")):  # experts' widths too
                fields[name] = 64
            elif name in ("num_experts", "num_local_experts", "n_routed_experts"):
                fields[name] = 4
            elif "per_tok" in name or "top_k" in name or name in ("topk_group", "n_group"):
                fields[name] = 2 if "group" not in name else 1
    fields.update(changes)
    return config_cls(**fields)


def _variants(config_cls):
    """(name, field changes): the defaults, each per-layer field of RoPE or layer kinds
    reversed, scaling at some layers, no sliding window."""
    small = _small(config_cls, {})
    yield "defaults", {}
    for name, value in _per_layer_fields(small).items():
        ropeish = "rope" in name or name.endswith("_layer_types")  # mlp_layer_types: Cohere 2 MoE
        if ropeish and list(value[::-1]) != list(value):
            yield f"{name} reversed", {name: list(value[::-1])}
        if "theta" in name and all(value):  # a layer without RoPE, and one at another base
            yield f"{name} varied", {name: [0, value[0], 50 * value[0], value[0]]}
    if name_in(small, "rope_scaling_layers"):
        yield (
            "scaled at layers 0 and 2",
            {
                "rope_scaling_layers": [0, 2],
                "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            },
        )
    if getattr(small, "sliding_window", None) is not None:
        yield "no sliding window", {"sliding_window": None, "layer_types": ["full_attention"] * 4}


def name_in(config, name):
    return getattr(config, name, None) is not None


def _run(config):
    """[cos of each layer's rotation, or None], running the family's model once."""
    module = importlib.import_module(type(config).__module__.replace("configuration_", "modeling_"))
    model = None
    for name, cls in vars(module).items():
        if (
            isinstance(cls, type) and name.endswith("Model") and "PreTrained" not in name
            and cls.__module__ == module.__name__
            and getattr(cls, "config_class", None) is type(config)
        ):  # fmt: skip
            model = cls(config).eval()
            break
    assert model is not None, f"no model class of {module.__name__} takes {type(config)}"
    layer_of, found = [None], {}
    for m in model.modules():
        if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx"):
            m.register_forward_pre_hook(lambda m, *_: layer_of.__setitem__(0, m.layer_idx))
    originals = {
        name: f for name, f in vars(module).items()
        if name.startswith("apply_rotary") and callable(f) and "vision" not in name
    }  # fmt: skip
    assert originals, f"{module.__name__} has no rotary apply function"

    def recorder(original):
        def apply(*args, **kwargs):
            found[layer_of[0]] = args[2] if len(args) > 2 else kwargs.get("cos", args[-1])
            return original(*args, **kwargs)

        return apply

    try:
        for name, original in originals.items():
            setattr(module, name, recorder(original))
        with torch.no_grad():
            model(input_ids=torch.arange(6)[None], position_ids=torch.arange(6)[None] + 100)
    finally:
        for name, original in originals.items():
            setattr(module, name, original)
    return [found.get(i) for i in range(config.num_hidden_layers)]


@pytest.mark.parametrize("model_type", sorted(_hf_layers.LAYER_RULES))
def test_layers_rotate_as_the_family_does(model_type):
    config_cls = CONFIG_MAPPING[model_type]
    built = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for variant, changes in _variants(config_cls):
            try:
                config = _small(config_cls, changes)
                theirs = _run(config)
            except Exception as error:  # noqa: BLE001
                # a setting the family's own config or model refuses (most families need a
                # window for their sliding layers)
                assert variant != "defaults", f"{model_type}: {error!r}"
                continue
            built.append(variant)
            ours = ar.RoPE.from_hf_layers(config, per_layer=True)
            where = f"{model_type}, {variant}"
            assert [c is not None for c in theirs] == [r is not None for r in ours], where
            rotated = [i for i, c in enumerate(theirs) if c is not None]
            for i in rotated:
                for j in rotated:
                    alike = theirs[i].shape == theirs[j].shape and torch.equal(theirs[i], theirs[j])
                    assert alike == (ours[i] is ours[j]), f"{where}: layers {i} and {j}"
    assert "defaults" in built


def test_every_per_layer_rope_field_is_read():
    # a config class with a per-layer list that names RoPE (no_rope_layers, layer_rope_theta,
    # rope_scaling_layers) must be a family of LAYER_RULES
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for config_cls in CONFIG_MAPPING.values():
            try:
                configs = [config_cls()]
            except Exception:  # noqa: BLE001 - a config class without defaults
                continue
            while configs:
                config = configs.pop()
                configs += [
                    v for v in vars(config).values() if isinstance(v, transformers.PreTrainedConfig)
                ]
                fields = [k for k in _per_layer_fields(config) if "rope" in k]
                if fields:
                    assert config.model_type in _hf_layers.LAYER_RULES, (config.model_type, fields)


def test_every_position_embedding_switch_is_read():
    # a config that chooses its position embedding by a field (ESM's position_embedding_type,
    # GraniteMoeHybrid's "rope" or none, the conformers' position_embeddings_type) must be a
    # family of ROPE_SWITCHES, or from_hf_config gives a RoPE to a model that rotates nothing
    import hf_families

    rotary = {family for family, _ in hf_families.modules()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for config_cls in CONFIG_MAPPING.values():
            if config_cls.__module__.split(".")[2] not in rotary:
                continue
            try:
                top = config_cls()
            except Exception:  # noqa: BLE001 - a config class without defaults
                continue
            parts = [(top.model_type, top)] + [
                (v.model_type or f"{top.model_type}_{k.removesuffix('_config')}", v)
                for k, v in vars(top).items()
                if isinstance(v, transformers.PreTrainedConfig)
            ]
            for model_type, config in parts:
                fields = {"position_embedding_type", "position_embeddings_type"} & set(vars(config))
                if fields:
                    assert model_type in _hf_layers.ROPE_SWITCHES, (model_type, fields)
    for model_type in ("esm", "granitemoehybrid"):  # off by default in both
        with pytest.raises(ar.RopeValueError, match="take no RoPE with position_emb"):
            ar.RoPE.from_hf_config(CONFIG_MAPPING[model_type]())


@pytest.mark.parametrize(
    "model_type, fields, left_out",
    [
        ("cohere2", {"sliding_window_pattern": 3}, {"layer_types": None}),
        ("cohere2", {}, {"layer_types": None, "sliding_window": None}),
        ("exaone4", {"sliding_window_pattern": 2, "sliding_window": 64}, {"layer_types": None}),
        ("cohere2_moe", {"first_k_dense_replace": 2, "sliding_window_pattern": 3},
         {"layer_types": None, "mlp_layer_types": None}),
        ("cohere2_moe", {"first_k_dense_replace": 1, "prefix_dense_sliding_window_pattern": 2},
         {"layer_types": None, "mlp_layer_types": None}),
        ("smollm3", {}, {"no_rope_layers": None}),
        ("llama4_text", {}, {"no_rope_layers": []}),  # its class reads [] as none given
        ("mistral_large4_text", {}, {"no_rope_layers": None}),
        ("muse_glimmer_text", {}, {"layer_rope_theta": None}),
        ("granite_swa", {}, {"layer_rope_theta": None}),
    ],
)  # fmt: skip
def test_a_file_reads_as_its_config_class_derives_per_layer_fields(model_type, fields, left_out):
    # a config.json may leave out per-layer fields that the family's config class derives
    # (layer_types from a sliding window pattern, Cohere 2 MoE's dense prefix, no_rope_layers,
    # layer_rope_theta) or take its default window: the file, read as a dict, must give the
    # layers the class's object gives
    config_cls = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_cls(num_hidden_layers=8, **fields)
    written = {**config.to_dict(), **fields}
    for name, value in left_out.items():
        written.pop(name, None)
        if value is not None:
            written[name] = value
    ours = ar.RoPE.from_hf_layers(written, per_layer=True)
    theirs = ar.RoPE.from_hf_layers(config, per_layer=True)
    assert [r is None for r in ours] == [r is None for r in theirs]
    assert [r.base for r in ours if r is not None] == [r.base for r in theirs if r is not None]
    rotated = [r is not None for r in ours]
    assert any(rotated) and (not all(rotated) or model_type == "granite_swa")


def test_older_names_of_model_and_layer_types():
    exaone = {"model_type": "exaone4_5_text", "head_dim": 16, "num_attention_heads": 2,
              "hidden_size": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
              "sliding_window": 64}  # fmt: skip
    exaone["layer_types"] = ["sliding_attention", "full_attention"]
    assert ar.RoPE.from_hf_layers(exaone)["full_attention"] is None  # read as EXAONE 4's
    zamba = {**exaone, "model_type": "zamba2", "use_mem_rope": True,
             "layers_block_type": ["mamba", "hybrid", "mamba"]}  # fmt: skip
    del zamba["layer_types"]
    assert list(ar.RoPE.from_hf_layers(zamba)) == ["linear_attention", "hybrid"]
    assert ar.RoPE.from_hf_layers(zamba)["linear_attention"] is None
