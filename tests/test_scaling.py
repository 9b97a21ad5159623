"""Scaling rules against their published formulas, and from_hf_config on real model configs."""

import importlib.util
import json
import math

import numpy as np
import pytest
from conftest import assert_matches, inv_freq, oracle
from hypothesis import given
from hypothesis import strategies as st

import arrayrope as ar
from arrayrope import RopeValueError
from arrayrope.scaling import NTK, DynamicNTK, Linear, Llama3, LongRoPE, YaRN

# ---------------------------------------------------------------- formulas, written independently


def yarn_formula(dim, base, s, orig, beta_fast=32, beta_slow=1, truncate=True):
    """YaRN's frequency blend: pair i is extrapolated while its rotation count over the original
    context, orig / wavelength_i, exceeds beta_fast; interpolated (theta / s) below beta_slow;
    a ramp that is linear in the pair index in between (the reference implementation's form)."""
    theta = inv_freq(dim, base)
    index_of = lambda r: dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))  # noqa
    lo, hi = index_of(beta_fast), index_of(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    gamma = np.array([min(max((i - lo) / (hi - lo), 0.0), 1.0) for i in range(dim // 2)])
    return theta * (1 - gamma) + theta / s * gamma


def llama3_formula(dim, base, factor, low, high, orig):
    out = []
    for t in inv_freq(dim, base):
        wavelength = 2 * math.pi / t
        if wavelength < orig / high:
            out.append(t)
        elif wavelength > orig / low:
            out.append(t / factor)
        else:
            smooth = (orig / wavelength - low) / (high - low)
            out.append((1 - smooth) * t / factor + smooth * t)
    return np.array(out)


def rope_with(rule, d=128, base=10000.0, **kw):
    return ar.RoPE(d, base=base, scaling=rule, **kw)


# ---------------------------------------------------------------- each rule


@given(st.floats(0.25, 64), st.integers(2, 64), st.floats(100, 1e7))
def test_linear(factor, pairs, base):
    rope = rope_with(Linear(factor), d=2 * pairs, base=base)
    np.testing.assert_allclose(rope.inv_freq, inv_freq(2 * pairs, base) / factor, rtol=1e-14)
    assert rope.attention_scaling == 1.0


@given(st.floats(1, 64), st.integers(2, 64))
def test_ntk(factor, pairs):
    d = 2 * pairs
    rope = rope_with(NTK(factor), d=d)
    expected = inv_freq(d, 10000.0 * factor ** (d / (d - 2)))
    np.testing.assert_allclose(rope.inv_freq, expected, rtol=1e-13)
    assert rope.inv_freq[0] == 1.0 and (np.diff(rope.inv_freq) < 0).all()


def test_dynamic_ntk_switches_exactly_at_the_original_length():
    orig, factor, d = 2048, 4.0, 64
    rope = rope_with(DynamicNTK(factor, orig), d=d)
    x = np.random.default_rng(3).standard_normal((2, d))
    plain = ar.rotate(x, np.array([0, 2047]))
    np.testing.assert_array_equal(rope.rotate(x, np.array([0, 2047])), plain)  # L = 2048
    for length in (2049, 5000, 100000):
        pos = np.array([3, length - 1])
        base = 10000.0 * (factor * length / orig - (factor - 1)) ** (d / (d - 2))
        assert_matches(rope.rotate(x, pos), oracle(x, pos, freqs=inv_freq(d, base)), x)
    # An engine pins the length for its whole cache: position 10 with seq_len 5000.
    base = 10000.0 * (factor * 5000 / orig - (factor - 1)) ** (d / (d - 2))
    pinned = rope.rotate(x, 10, seq_len=5000)
    assert_matches(pinned, oracle(x, 10, freqs=inv_freq(d, base)), x)
    assert not np.array_equal(pinned, ar.rotate(x, 10))


def test_frequency_sets_never_mix():
    rope = rope_with(DynamicNTK(2.0, 16), d=16)
    x = np.ones((1, 16))
    for length in (20, 40, 20, 10, 40):  # alternate sets; each call must see its own
        got = rope.rotate(x, length - 1)
        base = 10000.0 * max(1.0, 2.0 * length / 16 - 1) ** (16 / 14)
        np.testing.assert_allclose(got, oracle(x, length - 1, freqs=inv_freq(16, base)), atol=1e-12)


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize(
    "dim, base, s, orig",
    [
        (128, 10000.0, 4.0, 32768),
        (64, 10000.0, 40.0, 4096),
        (128, 1e6, 4.0, 32768),
        (96, 5e5, 8, 8192),
    ],
)
def test_yarn(truncate, dim, base, s, orig):
    rope = rope_with(YaRN(s, orig, truncate=truncate), d=dim, base=base)
    np.testing.assert_allclose(
        rope.inv_freq, yarn_formula(dim, base, s, orig, truncate=truncate), rtol=1e-13
    )
    assert rope.attention_scaling == pytest.approx(0.1 * math.log(s) + 1)
    theta = inv_freq(dim, base)
    rotations = orig * theta / (2 * math.pi)
    fast, slow = rotations > 32 * 1.5, rotations < 1 / 1.5  # clear of the truncated edges
    np.testing.assert_allclose(rope.inv_freq[fast], theta[fast], rtol=1e-14)
    np.testing.assert_allclose(rope.inv_freq[slow], theta[slow] / s, rtol=1e-14)


def test_yarn_attention_factor_variants():
    assert YaRN(40, 4096)._attention(None) == pytest.approx(1.3688879454113936)  # 0.1 ln 40 + 1
    # DeepSeek-V2: mscale == mscale_all_dim cancels to 1.
    assert YaRN(40, 4096, mscale=0.707, mscale_all_dim=0.707)._attention(None) == 1.0
    ratio = (0.1 * 1.0 * math.log(40) + 1) / (0.1 * 0.5 * math.log(40) + 1)
    assert YaRN(40, 4096, mscale=1.0, mscale_all_dim=0.5)._attention(None) == pytest.approx(ratio)
    assert YaRN(40, 4096, attention_factor=0.8)._attention(None) == 0.8


def test_attention_scaling_multiplies_cos_and_sin():
    rope = rope_with(YaRN(16, 1024), d=32)
    x = np.random.default_rng(0).standard_normal((5, 32))
    pos = np.arange(5) * 1000
    expected = oracle(x, pos, freqs=rope.inv_freq, scale=rope.attention_scaling)
    assert_matches(rope.rotate(x, pos), expected, x)
    cos, _ = rope.cos_sin(np.array([0]), like=x)
    assert cos[0, 0] == pytest.approx(rope.attention_scaling)


def test_llama3_hand_computed():
    rope = rope_with(Llama3(8.0, 1.0, 4.0, 8192), d=128, base=500000.0)
    np.testing.assert_allclose(
        rope.inv_freq, llama3_formula(128, 500000.0, 8, 1, 4, 8192), rtol=1e-14
    )
    theta = inv_freq(128, 500000.0)
    assert rope.inv_freq[0] == 1.0  # wavelength 2 pi: kept
    assert rope.inv_freq[-1] == pytest.approx(theta[-1] / 8)  # longest wavelengths: / 8
    # Pair 30: wavelength 2 pi * 500000 ** (30 / 64) = 2948.3 lies in the smooth band [2048, 8192].
    wavelength = 2 * math.pi / theta[30]
    assert wavelength == pytest.approx(2948.30, abs=0.01)
    smooth = (8192 / wavelength - 1) / 3
    assert rope.inv_freq[30] == pytest.approx((1 - smooth) * theta[30] / 8 + smooth * theta[30])


def test_longrope_switches_sets_and_scales_attention():
    short, long = tuple(1.0 + 0.01 * i for i in range(8)), tuple(1.0 + 0.5 * i for i in range(8))
    rule = LongRoPE(short, long, 4096, factor=32.0)
    rope = rope_with(rule, d=16)
    theta = inv_freq(16, 10000.0)
    np.testing.assert_allclose(rope.inv_freq, theta / np.array(short), rtol=1e-14)
    attention = math.sqrt(1 + math.log(32) / math.log(4096))
    assert rope.attention_scaling == pytest.approx(attention) == pytest.approx(1.1902380714238083)
    x = np.random.default_rng(1).standard_normal((2, 16))
    for last, factors in ((4095, short), (4096, long)):  # L = 4096 is short, 4097 long
        pos = np.array([7, last])
        expected = oracle(x, pos, freqs=theta / np.array(factors), scale=attention)
        assert_matches(rope.rotate(x, pos), expected, x)


@pytest.mark.parametrize(
    "rule", [Linear(1.0), YaRN(1.0, 2048), Llama3(1.0, 1.0, 4.0, 8192), NTK(1.0)]
)
def test_factor_one_is_no_scaling(rule):
    rope = rope_with(rule, d=64)
    np.testing.assert_allclose(rope.inv_freq, inv_freq(64, 10000.0), rtol=1e-14)
    assert rope.attention_scaling == 1.0
    x = np.random.default_rng(2).standard_normal((3, 64))
    np.testing.assert_allclose(
        rope.rotate(x, np.array([1, 500, 9000])), ar.rotate(x, np.array([1, 500, 9000])), atol=1e-12
    )


@given(
    st.sampled_from(["linear", "ntk", "yarn", "llama3"]), st.floats(1.0, 64.0), st.integers(2, 64)
)
def test_frequencies_positive_and_decreasing(kind, factor, pairs):
    rule = {
        "linear": Linear(factor),
        "ntk": NTK(factor),
        "yarn": YaRN(factor, 4096),
        "llama3": Llama3(factor, 1.0, 4.0, 8192),
    }[kind]
    f = rope_with(rule, d=2 * pairs).inv_freq
    assert (f > 0).all() and (np.diff(f) <= 0).all()


def test_scaling_through_module_functions_and_multi_axis():
    x = np.random.default_rng(4).standard_normal((4, 3, 32)).astype(np.float32)
    y = ar.rotate(x, scaling=Linear(4.0))
    assert_matches(y, oracle(x, freqs=inv_freq(32) / 4), x)
    axial = ar.RoPE.axial((16, 16), scaling=Linear(2.0))
    np.testing.assert_allclose(axial.inv_freq, np.concatenate([inv_freq(16), inv_freq(16)]) / 2)


def test_llama3_with_equal_factors_has_no_band_between():
    # Llama 4 Scout's rope_scaling: low_freq_factor = high_freq_factor = 1
    orig, factor = 8192, 16.0
    plain = inv_freq(128, 5e5)
    wavelen = 2 * np.pi / plain
    want = np.where(wavelen > orig, plain / factor, plain)
    got = ar.RoPE(128, base=5e5, scaling=Llama3(factor, 1.0, 1.0, orig)).inv_freq
    np.testing.assert_allclose(got, want, rtol=1e-15)
    assert (got != plain).any() and (got == plain).any()


def test_rule_errors():
    with pytest.raises(RopeValueError, match="factor must be finite and > 0, got -2"):
        Linear(-2)
    with pytest.raises(RopeValueError, match=r"high_freq_factor \(1.0\) must be >= low_freq"):
        Llama3(8, 4, 1, 8192)
    with pytest.raises(RopeValueError, match="one value per pair, got 3 and 2"):
        LongRoPE((1, 1, 1), (1, 1), 4096)
    with pytest.raises(RopeValueError, match="one factor per rotated pair: this RoPE rotates 8"):
        ar.RoPE(16, scaling=LongRoPE((1, 1, 1), (1, 1, 1), 4096))
    with pytest.raises(ar.RopeTypeError, match="scaling must be a rule"):
        ar.RoPE(16, scaling="yarn")
    with pytest.raises(ar.RopeTypeError, match="original_max_positions must be an int"):
        YaRN(4, 4096.5)
    # rules whose formulas divide by log(base) or log(original_max_positions), where it is 0
    with pytest.raises(RopeValueError, match="YaRN places its ramp by log"):
        ar.RoPE(4, base=1.0, scaling=YaRN(2, 16))
    with pytest.raises(RopeValueError, match="needs original_max_positions > 1"):
        LongRoPE((1, 1), (1, 1), 1, factor=2.0)
    ar.RoPE(4, scaling=LongRoPE((1, 1), (1, 1), 1, factor=2.0, attention_factor=1.0))
    # frequencies that overflow, or a float of an int too large for one
    x = np.ones((3, 64), np.float32)
    makers = [
        lambda: ar.RoPE(64, scaling=NTK(1e308)),
        lambda: ar.RoPE(64, base=5e-324),
        lambda: ar.RoPE(64, scaling=Linear(5e-324)),
        lambda: ar.RoPE(64, scaling=YaRN(2.0, 4096, beta_slow=1e-320)),
        lambda: ar.RoPE(64, scaling=Llama3(8.0, 1.0, 4.0, 10**400)),
        lambda: ar.RoPE(64, scaling=DynamicNTK(2.0, 4)).rotate(x, np.arange(3), seq_len=10**400),
    ]
    if importlib.util.find_spec("torch") is not None:  # transformers' angles are torch's
        makers.append(lambda: ar.RoPE(64, scaling=NTK(1e308), angles="transformers"))
    for make in makers:
        with pytest.raises(RopeValueError, match="gives no finite frequencies"):
            make()


# ---------------------------------------------------------------- from_hf_config

LLAMA2_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": None,
}
LLAMA31_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
QWEN2_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
}
MISTRAL_7B = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
}
# Phi-3-mini-128k: 48 pairs per factor list (values shaped like the published ones).
PHI3_128K = {
    "model_type": "phi3",
    "hidden_size": 3072,
    "num_attention_heads": 32,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0 + 0.002 * i for i in range(48)],
        "long_factor": [1.0 + 1.2 * i for i in range(48)],
    },
}
DEEPSEEK_V2 = {
    "model_type": "deepseek_v2",
    "hidden_size": 5120,
    "num_attention_heads": 128,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
}
GPT_NEOX_20B = {
    "model_type": "gpt_neox",
    "hidden_size": 6144,
    "num_attention_heads": 64,
    "rotary_pct": 0.25,
    "rotary_emb_base": 10000,
    "max_position_embeddings": 2048,
}
PHI2 = {
    "model_type": "phi",
    "hidden_size": 2560,
    "num_attention_heads": 32,
    "partial_rotary_factor": 0.4,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
}
QWEN2_VL = {
    "model_type": "qwen2_vl",
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
}


@pytest.mark.parametrize(
    "config, head_dim, rotary_dim, style, base, rule, attention",
    [
        (LLAMA2_7B, 128, 128, "half", 10000.0, None, 1.0),
        (LLAMA31_8B, 128, 128, "half", 500000.0, Llama3(8.0, 1.0, 4.0, 8192), 1.0),
        (QWEN2_7B, 128, 128, "half", 1e6, None, 1.0),
        (MISTRAL_7B, 128, 128, "half", 10000.0, None, 1.0),
        (
            PHI3_128K,
            96,
            96,
            "half",
            10000.0,
            "longrope",
            math.sqrt(1 + math.log(32) / math.log(4096)),
        ),
        (
            DEEPSEEK_V2,
            64,
            64,
            "interleaved",
            10000.0,
            YaRN(40, 4096, mscale=0.707, mscale_all_dim=0.707),
            1.0,
        ),
        (GPT_NEOX_20B, 96, 24, "half", 10000.0, None, 1.0),
        (PHI2, 80, 32, "half", 10000.0, None, 1.0),
    ],
    ids=[
        "llama2",
        "llama3.1",
        "qwen2",
        "mistral",
        "phi3-128k",
        "deepseek-v2",
        "gpt-neox-20b",
        "phi2",
    ],
)
def test_from_hf_config(tmp_path, config, head_dim, rotary_dim, style, base, rule, attention):
    for source in (config, _write(tmp_path, config), _Attrs(config)):
        rope = ar.RoPE.from_hf_config(source)
        assert (rope.head_dim, rope.rotary_dim, rope.style, rope.base) == (
            head_dim,
            rotary_dim,
            style,
            base,
        )
        assert rope.attention_scaling == pytest.approx(attention)
        if rule is None:
            assert rope.scaling is None
            np.testing.assert_allclose(rope.inv_freq, inv_freq(rotary_dim, base), rtol=1e-14)
        elif rule == "longrope":
            short = np.array(config["rope_scaling"]["short_factor"])
            np.testing.assert_allclose(rope.inv_freq, inv_freq(96) / short, rtol=1e-14)
        else:
            assert rope.scaling == rule
    assert ar.RoPE.from_hf_config(config, style="interleaved").style == "interleaved"


def test_from_hf_config_multimodal_sections():
    rope = ar.RoPE.from_hf_config(QWEN2_VL)
    assert rope.n_axes == 3 and rope.style == "half"
    assert list(np.bincount(rope._spec.pair_axis)) == [16, 24, 24]
    qwen3 = dict(
        QWEN2_VL,
        model_type="qwen3_vl",
        rope_scaling={
            "rope_type": "default",
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    )
    assert list(ar.RoPE.from_hf_config(qwen3)._spec.pair_axis[:6]) == [0, 1, 2, 0, 1, 2]


def test_from_hf_config_rope_parameters_form():
    config = dict(LLAMA31_8B)
    config["rope_parameters"] = dict(config.pop("rope_scaling"), rope_theta=500000.0)
    del config["rope_theta"]
    rope = ar.RoPE.from_hf_config(config)
    assert rope.base == 500000.0 and rope.scaling == Llama3(8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                    "wavelength": 3,
                }
            },
            r"unknown field\(s\) for rope type 'llama3'",
        ),
        ({"rope_scaling": {"rope_type": "ntk-by-parts", "factor": 2}}, "unknown rope type"),
        ({"rope_scaling": {"rope_type": "yarn", "type": "linear", "factor": 2}}, "disagree"),
        ({"rope_scaling": {"rope_type": "linear"}}, "has no 'factor'"),
        ({"rope_theta": None, "model_type": "qwen2"}, "no rope_theta"),
    ],
)
def test_from_hf_config_errors(change, message):
    with pytest.raises(RopeValueError, match=message):
        ar.RoPE.from_hf_config(dict(LLAMA2_7B, **change))


def test_from_hf_config_layer_type_errors():
    flat = dict(LLAMA2_7B, layer_types=["full_attention"])
    with pytest.raises(RopeValueError, match="layer_type 'sliding_attention' is not a layer"):
        ar.RoPE.from_hf_config(flat, layer_type="sliding_attention")
    nested = dict(LLAMA2_7B, rope_parameters={"full_attention": {"rope_theta": 1e4}, "x": None})
    with pytest.raises(RopeValueError, match="one RoPE per layer type"):
        ar.RoPE.from_hf_config(nested)
    with pytest.raises(RopeValueError, match="must be one of 'full_attention', 'x', got 'y'"):
        ar.RoPE.from_hf_config(nested, layer_type="y")
    with pytest.raises(RopeValueError, match="layer type 'x' of this config has no RoPE"):
        ar.RoPE.from_hf_config(nested, layer_type="x")
    assert ar.RoPE.from_hf_layers(nested)["x"] is None
    with pytest.raises(RopeValueError, match="has no 'vision' part"):
        ar.RoPE.from_hf_config(LLAMA2_7B, part="vision")
    with pytest.raises(ar.RopeTypeError, match="part must be a non-empty str"):
        ar.RoPE.from_hf_config(LLAMA2_7B, part="")


def _write(tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


class _Attrs:
    def __init__(self, config):
        self.__dict__.update(config)
