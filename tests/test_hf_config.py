"""RoPE.from_hf_config on config dicts, against float64 oracles of transformers' formulas.

These run without transformers (tests/test_hf_families.py checks every installed family through
its own code): the frequencies base ** (-2 i / dim) over the rotated width dim as transformers
computes it (odd widths included), the pair styles, the families' layouts, layer types,
composite configs, and RoPEs whose pairs take reordered or negated frequencies.
"""

import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from oracles import oracle

import arrayrope as ar

TOL = 1e-12  # float64 rows against the float64 oracle, relative to the row's largest |x|


def _close(got, want, x):
    assert np.abs(got - want).max() <= TOL * max(1.0, np.abs(x).max())


def _hf_oracle(x, pos, head_dim, dim, base, style, factor=1.0, rotated_pairs=None, sign=1):
    """transformers' rotation: ceil(dim / 2) pairs at base ** (-2 i / dim), paired over
    2 * ceil(dim / 2) features by ``style``; pairs past ``rotated_pairs`` turn at 0."""
    freqs = sign * base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim) / factor
    if rotated_pairs is not None:
        freqs[rotated_pairs:] = 0.0
    return oracle(x, pos, style=style, rotary_dim=2 * len(freqs), freqs=freqs)


@given(
    head_dim=st.integers(2, 80).map(lambda n: 2 * n),
    fraction=st.one_of(st.none(), st.floats(0.05, 1.0)),
    base=st.floats(2.0, 1e7),
    family=st.sampled_from(["llama", "cohere", "glm", "some_new_family", "nanochat"]),
    interleave=st.sampled_from([None, True, False]),
    seed=st.integers(0, 2**32 - 1),
)
def test_families_rotate_as_transformers_computes(
    head_dim, fraction, base, family, interleave, seed
):
    config = {"model_type": family, "head_dim": head_dim, "rope_theta": base}
    if fraction is not None:
        config["partial_rotary_factor"] = fraction
    if interleave is not None:
        config["rope_interleave"] = interleave
    # a partial factor counts for families whose default rope reads one (GLM), not for others
    dim = head_dim if fraction is None or family != "glm" else int(head_dim * fraction)
    if dim < 1:
        with pytest.raises(ar.RopeValueError, match="rotates no features"):
            ar.RoPE.from_hf_config(config)
        return
    rope = ar.RoPE.from_hf_config(config)
    half = family in ("llama", "some_new_family", "nanochat")
    style = "half" if (half if interleave is None else not interleave) else "interleaved"
    assert (rope.style, rope.rotary_dim) == (style, dim + dim % 2)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 7, head_dim))
    pos = rng.integers(0, 2**31, size=7)
    sign = -1 if family == "nanochat" else 1  # rotate_half with flipped signs
    _close(rope.rotate(x, pos), _hf_oracle(x, pos, head_dim, dim, base, style, sign=sign), x)


@given(
    head_dim=st.integers(2, 64).map(lambda n: 4 * n),
    fraction=st.floats(0.01, 1.0),
    factor=st.floats(0.5, 8.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_proportional_rope_type(head_dim, fraction, factor, seed):
    params = {"rope_type": "proportional", "partial_rotary_factor": fraction}
    config = {"head_dim": head_dim, "rope_parameters": {**params, "rope_theta": 1e6}}
    config["rope_parameters"]["factor"] = factor
    rope = ar.RoPE.from_hf_config(config)
    assert rope.rotary_dim == head_dim and rope.scaling == ar.scaling.Proportional(fraction, factor)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, head_dim))
    pos = rng.integers(0, 10**6, size=5)
    want = _hf_oracle(
        x, pos, head_dim, head_dim, 1e6, "half", factor, int(fraction * head_dim // 2)
    )
    _close(rope.rotate(x, pos), want, x)


def test_composite_configs_and_their_parts():
    axial = {"rope_type": "axial", "rope_theta": 1e4}
    vision = {"model_type": "qwen2_vl_vision", "embed_dim": 1280, "num_heads": 16,
              "hidden_size": 3584, "rope_parameters": axial}  # fmt: skip
    text = {"model_type": "qwen2_vl_text", "hidden_size": 1536, "num_attention_heads": 12,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}  # fmt: skip
    config = {"model_type": "qwen2_vl", "text_config": text, "vision_config": vision}
    rope = ar.RoPE.from_hf_config(config)  # the text part, with the family's default sections
    assert (rope.n_axes, rope.head_dim) == (3, 128)
    assert np.array_equal(rope._spec.pair_axis, np.repeat([0, 1, 2], [16, 24, 24]))
    tower = ar.RoPE.from_hf_config(config, part="vision")  # embed_dim / num_heads
    assert (tower.n_axes, tower.head_dim, tower.style) == (2, 80, "half")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 16, 80))
    pos = rng.integers(0, 64, size=(9, 1, 2))  # (row, column) of each patch
    rows = oracle(x[..., [*range(20), *range(40, 60)]], pos[..., 0], style="half", base=1e4)
    columns = oracle(x[..., [*range(20, 40), *range(60, 80)]], pos[..., 1], style="half", base=1e4)
    want = np.concatenate(
        [rows[..., :20], columns[..., :20], rows[..., 20:], columns[..., 20:]], -1
    )
    _close(tower.rotate(x, pos), want, x)


def test_alternating_axes_and_a_pickled_copy():
    # Kimi-K2.5's vision tower: its two axes take turns pair by pair, columns first
    config = {"model_type": "kimi_k25_vision", "hidden_size": 96, "num_attention_heads": 4,
              "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}}  # fmt: skip
    rope = ar.RoPE.from_hf_config(config)
    per_axis = np.float64(100.0) ** (-np.arange(0, 12, 2) / 12)
    assert np.array_equal(rope.inv_freq, np.repeat(per_axis, 2))
    assert np.array_equal(rope._spec.pair_axis, np.tile([1, 0], 6))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 24))
    pos = rng.integers(0, 100, size=(4, 2))
    copy = pickle.loads(pickle.dumps(rope))
    assert np.array_equal(copy.inv_freq, rope.inv_freq)
    assert np.array_equal(copy.rotate(x, pos), rope.rotate(x, pos))


def test_layer_types_and_per_layer_head_sizes():
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    config = {
        "model_type": "gemma4_text", "head_dim": 256, "hidden_size": 1536,
        "num_attention_heads": 8, "layer_types": layer_types,
        "per_layer_config": {"05": {"head_dim": 512}},
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1e6},
        },
    }  # fmt: skip
    ropes = ar.RoPE.from_hf_layers(config)
    assert list(ropes) == ["sliding_attention", "full_attention"]
    assert ropes["sliding_attention"].head_dim == 256 and ropes["sliding_attention"].base == 1e4
    full = ar.RoPE.from_hf_config(config, layer_type="full_attention")
    assert full.head_dim == 512 and full.scaling == ar.scaling.Proportional(0.25)
    with pytest.raises(ar.RopeValueError, match="different head sizes"):
        ar.RoPE.from_hf_config(
            {**config, "layer_types": layer_types * 2}, layer_type="full_attention"
        )


def test_mrope_layouts_the_families_keep_in_their_code():
    base = {"hidden_size": 1024, "num_attention_heads": 8, "rope_theta": 1e6}
    ernie = ar.RoPE.from_hf_config({**base, "model_type": "ernie4_5_vl_moe_text"})
    assert ernie.style == "interleaved"  # height and width alternate, then time
    assert list(ernie._spec.pair_axis) == [1, 2] * 22 + [0] * 20
    qwen3 = ar.RoPE.from_hf_config({**base, "model_type": "qwen3_vl_text"})
    assert list(qwen3._spec.pair_axis[:6]) == [0, 1, 2, 0, 1, 2]
    compass = {**base, "model_type": "cohere_compass_text", "layer_types": ["full_attention"],
               "rope_parameters": {"full_attention": {"rope_theta": 1e6}}}  # fmt: skip
    compass = ar.RoPE.from_hf_config(compass, layer_type="full_attention")
    assert list(compass._spec.pair_axis) == list(qwen3._spec.pair_axis)
    for omni in ("qwen3_omni_moe_text", "qwen3_omni_moe_talker_text"):  # Qwen3-VL's layout
        rope = ar.RoPE.from_hf_config({**base, "model_type": omni})
        assert rope.n_axes == 3 and list(rope._spec.pair_axis) == list(qwen3._spec.pair_axis)
    # GLM-4V's text rotates adjacent pairs; GLM-4.5V's (glm4v_moe_text) rotate_half pairs
    glm = {**base, "head_dim": 128, "partial_rotary_factor": 0.5}
    assert ar.RoPE.from_hf_config({**glm, "model_type": "glm4v_text"}).style == "interleaved"
    assert ar.RoPE.from_hf_config({**glm, "model_type": "glm4v_moe_text"}).style == "half"
    given_sections = {"rope_theta": 1e6, "mrope_section": [32, 16, 16]}
    own = ar.RoPE.from_hf_config({**base, "model_type": "x", "rope_parameters": given_sections})
    assert list(own._spec.pair_axis) == [0] * 32 + [1] * 16 + [2] * 16


def test_layouts_no_rope_of_pairs_expresses_are_refused():
    gemma4 = {"model_type": "gemma4_vision", "head_dim": 64,
              "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}}  # fmt: skip
    with pytest.raises(ar.RopeValueError, match="each block by its own halves"):
        ar.RoPE.from_hf_config(gemma4)
    sections = {"rope_theta": 1e4, "mrope_section": [16, 16, 16, 16]}
    hunyuan = {"model_type": "hunyuan_vl_text", "head_dim": 128, "rope_parameters": sections}
    with pytest.raises(ar.RopeValueError, match="no rotation of pairs"):
        ar.RoPE.from_hf_config(hunyuan)


def test_dbrx_names_its_fields_its_own_way():
    dbrx = {"model_type": "dbrx", "d_model": 6144, "n_heads": 48, "max_seq_len": 32768}
    rope = ar.RoPE.from_hf_config({**dbrx, "rope_parameters": {"rope_theta": 5e5}})
    assert rope.head_dim == 128 and rope.base == 5e5
    # an older file keeps rope_theta in attn_config, which transformers 5 does not read there:
    # refused rather than read with a default base
    with pytest.raises(ar.RopeValueError, match="no rope_theta"):
        ar.RoPE.from_hf_config({**dbrx, "attn_config": {"rope_theta": 5e5}})


def test_what_transformers_computes_and_arrayrope_follows():
    # hidden_size // num_attention_heads is floored, as the family's projections are
    assert ar.RoPE.from_hf_config({"hidden_size": 4096, "num_attention_heads": 96,
                                   "rope_theta": 1e4}).head_dim == 42  # fmt: skip
    # keys transformers writes beside the RoPE's own
    params = {"rope_type": "default", "rope_theta": 1e6, "max_position_embeddings": 4096,
              "llama_4_scaling_beta": 0.1}  # fmt: skip
    assert ar.RoPE.from_hf_config({"head_dim": 128, "rope_parameters": params}).base == 1e6
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 64,
                "long_factor": [2.0] * 64, "original_max_position_embeddings": 4096,
                "short_mscale": 1.2, "long_mscale": 1.3}  # fmt: skip
    with pytest.raises(ar.RopeValueError, match="'phimoe' gives short_mscale and long_mscale"):
        ar.RoPE.from_hf_config(
            {"model_type": "phimoe", "head_dim": 128, "rope_parameters": longrope}
        )


def test_dynamic_grows_past_max_position_embeddings():
    # transformers' dynamic RoPE grows its base past max_position_embeddings and ignores an
    # original_max_position_embeddings in its parameters (tests/test_hf_angles.py drives it)
    config = {
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 512
        },
    }  # fmt: skip
    rope = ar.RoPE.from_hf_config(config)
    assert rope.scaling == ar.scaling.DynamicNTK(2.0, 2048)


@given(
    heads=st.integers(1, 16),
    projection=st.integers(1, 4096),
    head_dim=st.integers(32, 96).map(lambda n: 2 * n),
    seed=st.integers(0, 2**32 - 1),
)
def test_clvp_encoders_derive_their_rotated_width(heads, projection, head_dim, seed):
    # CLVP's encoders rotate max(projection_dim // (2 * heads), 32) features at base 10000,
    # whatever else the config says
    config = {"model_type": "clvp_encoder", "hidden_size": heads * head_dim,
              "num_attention_heads": heads, "projection_dim": projection,
              "use_rotary_embedding": True}  # fmt: skip
    dim = max(projection // (2 * heads), 32)
    if dim > head_dim:
        with pytest.raises(ar.RopeValueError):
            ar.RoPE.from_hf_config(config)
        return
    rope = ar.RoPE.from_hf_config(config)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, heads, head_dim))
    pos = rng.integers(0, 4096, size=(3, 1))
    want = _hf_oracle(x, pos, head_dim, dim, 10000.0, "half")
    _close(rope.rotate(x, pos), want, x)


def test_clvp_encoders_without_rotary_embedding_or_sizes_are_refused():
    config = {"model_type": "clvp_encoder", "hidden_size": 768, "num_attention_heads": 12,
              "projection_dim": 768, "use_rotary_embedding": True}  # fmt: skip
    with pytest.raises(ar.RopeValueError, match="use_rotary_embedding off"):
        ar.RoPE.from_hf_config({**config, "use_rotary_embedding": False})
    with pytest.raises(ar.RopeValueError, match="projection_dim"):
        ar.RoPE.from_hf_config({**config, "projection_dim": None})


def test_grid_families_read_their_default_rope_as_axial():
    # DINOv3, EoMT-DINOv3, Sapiens2, Llama 4's vision tower and EfficientLoFTR keep a default
    # rope in their configs while their modules turn pairs by the grid they make: their RoPE is
    # the axial one (the drivers in hf_grid_families.py compare it with their own code)
    dinov3 = {"model_type": "dinov3_vit", "hidden_size": 384, "num_attention_heads": 6,
              "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}  # fmt: skip
    axial = {**dinov3, "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}}
    rope, want = ar.RoPE.from_hf_config(dinov3), ar.RoPE.from_hf_config(axial)
    assert (rope.n_axes, rope.head_dim, rope.style) == (2, 64, "half")
    assert np.array_equal(rope.inv_freq, want.inv_freq)
    assert np.array_equal(rope._spec.pair_axis, want._spec.pair_axis)
    # EfficientLoFTR rotates the whole hidden vector before its split into heads; its
    # partial_rotary_factor of 4 is that ratio, not a fraction to rotate
    loftr = {"model_type": "efficientloftr", "hidden_size": 256, "num_attention_heads": 8,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                 "partial_rotary_factor": 4.0}}  # fmt: skip
    rope = ar.RoPE.from_hf_config(loftr)
    got = (rope.n_axes, rope.head_dim, rope.rotary_dim, rope.style)
    assert got == (2, 256, 256, "interleaved")
    assert np.array_equal(rope._spec.pair_axis, np.tile([0, 1], 64))
    # a scaling rule names no grid: still refused, with the way to read the rotation
    yarn = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 2.0,
            "original_max_position_embeddings": 64}  # fmt: skip
    with pytest.raises(ar.RopeValueError, match="rope_type 'axial'"):
        ar.RoPE.from_hf_config({**dinov3, "rope_parameters": yarn})


def test_video_trackers_roformer_and_the_refused():
    # SAM 2 / SAM 3 trackers and EdgeTAM: the RoPE of the memory attention's heads, in
    # adjacent pairs
    sam2 = {"model_type": "sam2_video", "memory_attention_hidden_size": 256,
            "memory_attention_downsample_rate": 2, "memory_attention_num_attention_heads": 4,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 1e4}}  # fmt: skip
    rope = ar.RoPE.from_hf_config(sam2)
    assert (rope.head_dim, rope.n_axes, rope.style) == (32, 2, "interleaved")
    with pytest.raises(ar.RopeValueError, match="memory_attention_hidden_size"):
        ar.RoPE.from_hf_config({**sam2, "memory_attention_hidden_size": None})
    # RoFormer: base 10000 in its code, adjacent pairs over the whole head
    roformer = {"model_type": "roformer", "hidden_size": 768, "num_attention_heads": 12}
    rope = ar.RoPE.from_hf_config(roformer)
    got = (rope.head_dim, rope.rotary_dim, rope.base, rope.style)
    assert got == (64, 64, 1e4, "interleaved")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 12, 64))
    pos = rng.integers(0, 512, size=(5, 1))
    _close(rope.rotate(x, pos), oracle(x, pos, style="interleaved", base=1e4), x)
    vjepa2 = {"model_type": "vjepa2", "hidden_size": 1024, "num_attention_heads": 16}
    with pytest.raises(ar.RopeValueError, match="different angles"):
        ar.RoPE.from_hf_config(vjepa2)
    dit = {"model_type": "qwen2_5_omni_dit", "hidden_size": 1024, "num_attention_heads": 16,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
    with pytest.raises(ar.RopeValueError, match="first head alone"):
        ar.RoPE.from_hf_config(dit)
    # MusicFlamingo's top level is its audio encoder's time rotation; part="text" reads its LM
    music = {"model_type": "musicflamingo", "head_dim": 1280,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1200.0,
                                 "partial_rotary_factor": 0.2},
             "text_config": {"model_type": "qwen2", "hidden_size": 896,
                             "num_attention_heads": 14, "rope_theta": 1e6}}  # fmt: skip
    with pytest.raises(ar.RopeValueError, match="atom coordinates"):
        ar.RoPE.from_hf_config({"model_type": "esmfold2", "hidden_size": 1024})
    with pytest.raises(ar.RopeValueError, match="audio encoder's output"):
        ar.RoPE.from_hf_config(music)
    assert ar.RoPE.from_hf_config(music, part="text").head_dim == 64


def test_rope_parameters_keyed_by_labels():
    # DeepSeek-V4 keys its rope parameters "main" (its sliding-window layers) and "compress"
    # (its compressed ones), in adjacent pairs over the last qk_rope_head_dim features; the
    # config's top-level rope_theta is main's, and each label's own base is the one it reads
    types = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    config = {
        "model_type": "deepseek_v4", "head_dim": 512, "qk_rope_head_dim": 64,
        "num_attention_heads": 64, "hidden_size": 4096, "rope_theta": 1e4, "layer_types": types,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.125},
            "compress": {"rope_type": "yarn", "rope_theta": 1.6e5, "factor": 4.0,
                         "original_max_position_embeddings": 4096,
                         "partial_rotary_factor": 0.125},
        },
    }  # fmt: skip
    main = ar.RoPE.from_hf_config(config, layer_type="main")
    assert (main.head_dim, main.base, main.style, main.scaling) == (64, 1e4, "interleaved", None)
    compress = ar.RoPE.from_hf_config(config, layer_type="compressed_sparse_attention")
    assert compress.base == 1.6e5 and isinstance(compress.scaling, ar.scaling.YaRN)
    ropes = ar.RoPE.from_hf_layers(config)
    assert list(ropes) == types
    assert ropes["sliding_attention"].base == 1e4
    assert ropes["heavily_compressed_attention"].base == 1.6e5
    with pytest.raises(ar.RopeValueError, match="layer_type must be one of 'main', 'compress'"):
        ar.RoPE.from_hf_config(config, layer_type="full_attention")


def _layered(model_type, n=4, **fields):
    return {"model_type": model_type, "head_dim": 16, "num_attention_heads": 2, "hidden_size": 32,
            "num_hidden_layers": n, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
            **fields}  # fmt: skip


SW, FULL = "sliding_attention", "full_attention"


def _same(a, b):
    return (repr(a), a.scaling) == (repr(b), b.scaling) and np.array_equal(a.inv_freq, b.inv_freq)


@pytest.mark.parametrize(
    "config, rotated",
    [
        # a sliding window decides which layers rotate (each family's attention code)
        (_layered("cohere2", layer_types=[SW, SW, SW, FULL], sliding_window=8), [1, 1, 1, 0]),
        (_layered("cohere2", layer_types=[SW, SW, SW, FULL], sliding_window=None), [0, 0, 0, 0]),
        (_layered("afmoe", layer_types=[SW, FULL, SW, FULL], sliding_window=None), [1, 0, 1, 0]),
        (_layered("exaone4", layer_types=[SW, SW, SW, FULL], sliding_window=8), [1, 1, 1, 0]),
        (_layered("exaone4", layer_types=[FULL] * 4, sliding_window=None), [1, 1, 1, 1]),
        # a file without the field has the window its config class sets by default
        (_layered("exaone4", layer_types=[SW, SW, SW, FULL]), [1, 1, 1, 0]),
        (_layered("cohere2", layer_types=[SW, SW, SW, FULL]), [1, 1, 1, 0]),
        (
            _layered(
                "cohere2_moe",
                layer_types=[FULL, SW, SW, FULL],
                sliding_window=8,
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                prefix_dense_sliding_window_pattern=1,
            ),
            [1, 1, 1, 0],
        ),  # fmt: skip
        # by index, whatever the layer type
        (_layered("smollm3", layer_types=[FULL] * 4, no_rope_layers=[1, 1, 1, 0]), [1, 1, 1, 0]),
        (
            _layered("llama4_text", layer_types=[FULL] * 4, no_rope_layers=[0, 1, 1, 1]),
            [0, 1, 1, 1],
        ),
        (
            _layered(
                "muse_spark_text", layer_types=[FULL] * 4, layer_rope_theta=[1e4, 0, 1e4, 1e4]
            ),
            [1, 0, 1, 1],
        ),  # fmt: skip
        (_layered("zamba2", use_mem_rope=False), [0, 0, 0, 0]),
        (
            _layered("some_new_family", layer_types=[SW, FULL, "linear_attention", FULL]),
            [1, 1, 0, 1],
        ),
    ],
)
def test_which_layers_rotate(config, rotated):
    ropes = ar.RoPE.from_hf_layers(config, per_layer=True)
    assert [r is not None for r in ropes] == [bool(r) for r in rotated]
    assert len({id(r) for r in ropes if r is not None}) <= 1  # layers that rotate alike share one
    for layer, r in enumerate(rotated):
        if r:
            assert _same(ar.RoPE.from_hf_config(config, layer=layer), ropes[layer])
        else:
            with pytest.raises(ar.RopeValueError, match=f"layer {layer} of model_type"):
                ar.RoPE.from_hf_config(config, layer=layer)
    kinds = config.get("layer_types") or [None] * 4
    for kind in set(kinds) - {None}:
        mine = [r for k, r in zip(kinds, rotated) if k == kind]
        if len(set(mine)) > 1:  # layers of one type that differ: asked by type, refused
            with pytest.raises(ar.RopeValueError, match="do not share one RoPE.*per_layer=True"):
                ar.RoPE.from_hf_config(config, layer_type=kind)
            with pytest.raises(ar.RopeValueError, match="do not share one RoPE"):
                ar.RoPE.from_hf_layers(config)
        elif not any(mine):
            with pytest.raises(ar.RopeValueError, match="take no RoPE"):
                ar.RoPE.from_hf_config(config, layer_type=kind)
    if any(rotated):  # the config's RoPE: the one every rotated layer shares
        assert _same(ar.RoPE.from_hf_config(config), next(r for r in ropes if r is not None))
    else:
        with pytest.raises(ar.RopeValueError, match="take no RoPE"):
            ar.RoPE.from_hf_config(config)


def test_layers_with_their_own_base_or_without_the_scaling_rule():
    granite = _layered("granite_swa", layer_types=[SW, FULL, SW, FULL],
                       layer_rope_theta=[0, 1e4, 5e5, 1e4])  # fmt: skip
    ropes = ar.RoPE.from_hf_layers(granite, per_layer=True)
    assert ropes[0] is None and ropes[1] is ropes[3]
    assert (ropes[1].base, ropes[2].base) == (1e4, 5e5)
    with pytest.raises(ar.RopeValueError, match="'sliding_attention' of model_type 'granite_swa'"):
        ar.RoPE.from_hf_layers(granite)  # its sliding layers: one without RoPE, one at 5e5
    with pytest.raises(ar.RopeValueError, match="do not share one RoPE"):
        ar.RoPE.from_hf_config(granite)  # two bases among the rotated layers
    linear = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}
    molmo = _layered("molmo2_text", rope_scaling_layers=[0, 2], rope_parameters=linear)
    ropes = ar.RoPE.from_hf_layers(molmo, per_layer=True)
    assert ropes[0] is ropes[2] and ropes[1] is ropes[3]
    assert ropes[0].scaling == ar.scaling.Linear(4.0) and ropes[1].scaling is None
    assert ropes[1].base == ropes[0].base == 1e4
    x = np.random.default_rng(0).standard_normal((3, 16))
    _close(
        ropes[1].rotate(x, np.arange(3) * 100),
        _hf_oracle(x, np.arange(3) * 100, 16, 16, 1e4, "half"),
        x,
    )
    unscaled = {**molmo, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    assert len(set(map(id, ar.RoPE.from_hf_layers(unscaled, per_layer=True)))) == 1
    for bad, error in [(4, ar.RopeValueError), (-1, ar.RopeValueError), (1.0, ar.RopeTypeError),
                       (True, ar.RopeTypeError)]:  # fmt: skip
        with pytest.raises(error, match="layer"):
            ar.RoPE.from_hf_config(molmo, layer=bad)
    with pytest.raises(ar.RopeValueError, match="layer 1 is of type"):
        ar.RoPE.from_hf_config(granite, layer=1, layer_type=SW)
    with pytest.raises(ar.RopeValueError, match="no_rope_layers with an entry for layer 3"):
        ar.RoPE.from_hf_config(_layered("smollm3", no_rope_layers=[1, 1, 1]), layer=3)


@pytest.mark.parametrize("family", ["hunyuan_v1_dense", "hunyuan_v1_moe"])
def test_hunyuan_reads_a_dynamic_rope_with_alpha_as_static_ntk(family):
    # as its checkpoints write it: a "dynamic" rope_scaling with alpha (and YaRN's fields, which
    # its code does not read); base * alpha ** (d / (d - 2)) at every length
    config = {
        "model_type": family, "head_dim": 32, "num_attention_heads": 2, "hidden_size": 64,
        "rope_theta": 1e4, "max_position_embeddings": 64,
        "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    }  # fmt: skip
    rope = ar.RoPE.from_hf_config(config)
    assert rope.scaling == ar.scaling.NTK(1000.0)
    x = np.random.default_rng(1).standard_normal((4, 32))
    pos = np.array([0, 5, 63, 5000])  # past max_position_embeddings too: no dynamic growth
    _close(rope.rotate(x, pos), _hf_oracle(x, pos, 32, 32, 1e4 * 1000.0 ** (32 / 30), "half"), x)
    without = {**config, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    assert isinstance(ar.RoPE.from_hf_config(without).scaling, ar.scaling.DynamicNTK)
    other = {**config, "model_type": "llama"}  # alpha means nothing to another family's code
    with pytest.raises(ar.RopeValueError, match="rope type 'dynamic' of model_type 'llama'"):
        ar.RoPE.from_hf_config(other)


def test_composite_parts_at_any_depth_and_errors_that_name_the_family():
    params = {"rope_type": "default", "rope_theta": 1e6}
    text = {"model_type": "omni_text", "head_dim": 16, "num_attention_heads": 2,
            "hidden_size": 32, "rope_parameters": params}  # fmt: skip
    talker = {**text, "model_type": "omni_talker", "rope_parameters": {"rope_theta": 1e4}}
    omni = {"model_type": "omni", "thinker_config": {"model_type": "thinker",
            "text_config": text}, "talker_config": talker}  # fmt: skip
    assert ar.RoPE.from_hf_config(omni).base == 1e6  # the thinker's text part
    assert ar.RoPE.from_hf_config(omni, part="thinker").base == 1e6  # a part of parts: its text
    assert ar.RoPE.from_hf_config(omni, part="talker").base == 1e4
    both = {**omni, "talker_config": {"model_type": "talker", "text_config": talker}}
    with pytest.raises(ar.RopeValueError, match="2 'text' parts: pass part= one of 'thinker.text'"):
        ar.RoPE.from_hf_config(both)
    assert ar.RoPE.from_hf_config(both, part="talker.text").base == 1e4
    with pytest.raises(
        ar.RopeValueError, match="no 'vision' part \\(its parts: 'thinker', 'talker'"
    ):
        ar.RoPE.from_hf_config(omni, part="vision")
    with pytest.raises(ar.RopeTypeError, match="part must be a non-empty str"):
        ar.RoPE.from_hf_config(omni, part=3)
    # an error from deeper down names the family it was reading
    odd = {**text, "model_type": "some_family", "head_dim": 15}
    with pytest.raises(ar.RopeValueError, match="model_type 'some_family': head_dim must be even"):
        ar.RoPE.from_hf_config(odd)
    ernie = {**text, "model_type": "ernie4_5_vl_moe_text",
             "rope_parameters": {"rope_theta": 1e4, "mrope_section": [4, 4]}}  # fmt: skip
    with pytest.raises(ar.RopeValueError, match="must be three sections"):
        ar.RoPE.from_hf_config(ernie)


@pytest.mark.parametrize(
    "changes, kw, error, words",
    [
        ({"model_type": "molmo2_text", "rope_scaling_layers": 3}, {"layer": 0}, ar.RopeTypeError,
         "rope_scaling_layers must be a list"),
        ({"model_type": "molmo2_text", "rope_parameters": "x"}, {"layer": 1}, ar.RopeTypeError,
         "must be a mapping"),
        ({"per_layer_config": {"0": "x"}, "layer_types": [FULL] * 4,
          "rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 1e4}}},
         {"layer_type": FULL}, ar.RopeTypeError, "per_layer_config must map"),
        ({"rope_parameters": {"rope_theta": True}}, {}, ar.RopeValueError, "finite number"),
        ({"model_type": "smollm3", "no_rope_layers": 1}, {"layer": 0}, ar.RopeValueError,
         "no_rope_layers with an entry for layer 0"),
    ],
)  # fmt: skip
def test_malformed_per_layer_fields_are_refused(changes, kw, error, words):
    with pytest.raises(error, match=words):
        ar.RoPE.from_hf_config({**_layered("some_family"), **changes}, **kw)
