"""RoPE.from_hf_config against every rotary family of the installed transformers.

The families are found in transformers' own modeling modules and driven through their own
attention code (see hf_families.py, and hf_grid_families.py for the modules that make their
positions from a grid): with the config class's defaults, and again with their
rope parameters turned into YaRN's and into half the head rotated. Each config is read as the
object and again as the dict transformers writes, and layer types a family leaves unrotated
must get no RoPE. No family may come out wrong, or refused unless REFUSED names it with the
reason. A rotary module this driver cannot run is named below with the reason; any other that it
cannot run fails, so a family added by a later transformers is looked at the day it is
installed.
"""

import warnings

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import hf_families  # noqa: E402

# Rotary modules of transformers 5.24 that the driver cannot run, and why. They are not
# arrayrope's refusals: from_hf_config is never reached for them.
NOT_DRIVEN = {
    "EsmFold2RotaryEmbedding": "a rotary module over atom coordinates, not positions",
    "MusicFlamingoRotaryEmbedding": "its rotary module takes timestamps and a length",
    # the family's own module fails on its config class's defaults
    "HunYuanVLRotaryEmbedding": "its config class gives no mrope_section, which it needs",
}

# Modeling modules that call a rotary apply function through no rotary module of their own, and
# why.
NO_ROTARY_MODULE = {
    "lightglue": "its positional encoder projects keypoint coordinates by a learned layer: cos "
    "and sin of learned frequencies, which ar.apply_cos_sin takes",
}

# Rotary modules that from_hf_config refuses, with the words of the reason it must give: layouts
# that no RoPE of pairs expresses.
REFUSED = {
    "Gemma4VisionRotaryEmbedding": "rotates each block by its own halves",
    "VJEPA2RopeAttention": "the two features of a pair turn by different angles",
    "Qwen2_5OmniDiTRotaryEmbedding": "rotates its first head alone",
}

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    COMPONENTS = hf_families.components()


@pytest.mark.parametrize(
    "family, module_name, rotary_name", COMPONENTS, ids=[c[2] for c in COMPONENTS]
)
def test_family(family, module_name, rotary_name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outcome = hf_families.drive(module_name, rotary_name)
        variants = [
            hf_families.drive(module_name, rotary_name, variant=v) for v in hf_families.VARIANTS
        ]
    for result in (outcome, *variants):
        assert result.status != hf_families.WRONG, result.detail
        if result.status == hf_families.REFUSED:
            assert REFUSED.get(rotary_name, "\0") in result.detail, result.detail
        # where the family's own tables give its results bit for bit, so do transformers' angles
        if hf_families.BIT_EXACT in result.detail:
            assert hf_families.HF_ANGLES in result.detail, result.detail
    if outcome.status == hf_families.UNDRIVEN:
        assert rotary_name in NOT_DRIVEN, f"not driven, and not known why: {outcome.detail}"


def test_every_module_that_rotates_is_driven_or_named():
    driven = {c[1] for c in COMPONENTS}
    for family, name in hf_families.modules(applying=True):
        assert name in driven or family in NO_ROTARY_MODULE, (
            f"{name} calls a rotary apply function, and neither driver runs it"
        )


def test_discovery_finds_the_families():
    # transformers 5.24 has 235 rotary modules in 207 modeling packages; a discovery that
    # misses most of them (a renamed folder, a moved module) must not pass quietly. test_family
    # passes a module's defaults only where they match or the module is named above, so at
    # least 200 families match where this and every test_family pass.
    named = set(REFUSED) | set(NOT_DRIVEN)
    matching = [c for c in COMPONENTS if c[2] not in named]
    assert len(matching) >= 200
    assert len({c[0] for c in matching}) >= 200


def test_every_field_name_a_config_class_maps_is_read():
    # a config class's attribute_map gives its own names of fields from_hf_config reads
    # (BailingHybrid's model_max_length for max_position_embeddings): a config.json, read as a
    # dict, has only those names, so each must be one of arrayrope's aliases
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from arrayrope import _hf_fields

    rotary = {family for family, _ in hf_families.modules()}
    read = set(_hf_fields._FIELDS) - {"model_type"}
    for model_type, config_cls in CONFIG_MAPPING.items():
        if config_cls.__module__.split(".")[2] not in rotary:
            continue
        aliases = {**_hf_fields._FIELD_ALIASES, **_hf_fields._FAMILY_ALIASES.get(model_type, {})}
        for field, name in (getattr(config_cls, "attribute_map", None) or {}).items():
            if field in read:
                assert name in aliases.get(field, ()), (model_type, field, name)
