"""RoPE.from_hf_config against Hugging Face transformers' own rotary modules.

For each family arrayrope reads, the model's config class builds transformers' rotary module and
applies it as the model does; arrayrope, configured from the same config (the object, its
config.json, and the model folder), must give the same queries and keys. transformers computes
its angles in float32, so the bound is float32's at these positions: semantic slips (a style,
a frequency, a scaling factor) are off by order one.
"""

import numpy as np
import pytest

import arrayrope as ar

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")


def _same(got, want, x, positions):
    scale = float(np.abs(x).max())
    bound = scale * (1e-5 + 4e-7 * float(np.max(positions)))  # float32 angles: ~eps * m
    err = float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def _hf_half(config, module_class, q, k, position_ids):
    """transformers' rotate_half models: cos/sin from the model's rotary module, applied by the
    model's own apply_rotary_pos_emb (GPT-NeoX's rotates the first features only)."""
    import sys

    apply_rotary_pos_emb = sys.modules[module_class.__module__].apply_rotary_pos_emb
    rotary = module_class(config)
    cos, sin = rotary(q, position_ids)
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)


def _configs(config, tmp_path):
    """The same config as an object, a config.json path and a model folder."""
    folder = tmp_path / "model"
    config.save_pretrained(folder)
    return [config, folder / "config.json", folder]


def _check_half(config, module_class, tmp_path, length, heads=4, kv_heads=2, batch=2, seed=0):
    rng = np.random.default_rng(seed)
    head_dim = config.hidden_size // config.num_attention_heads
    q = rng.standard_normal((batch, heads, length, head_dim)).astype(np.float32)
    k = rng.standard_normal((batch, kv_heads, length, head_dim)).astype(np.float32)
    start = rng.integers(0, 64, size=(batch, 1))
    position_ids = start + np.arange(length)[None]  # (B, T): each sequence its own offset
    want_q, want_k = _hf_half(
        config,
        module_class,
        torch.from_numpy(q),
        torch.from_numpy(k),
        torch.from_numpy(position_ids),
    )
    for source in _configs(config, tmp_path):
        rope = ar.RoPE.from_hf_config(source)
        got_q, got_k = rope.rotate_qk(q, k, position_ids, head_axis=1)
        _same(got_q, want_q.numpy(), q, position_ids)
        _same(got_k, want_k.numpy(), k, position_ids)
    return rope


def test_llama(tmp_path):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    rope = _check_half(config, LlamaRotaryEmbedding, tmp_path, length=40)
    assert rope.style == "half" and rope.scaling is None


@pytest.mark.parametrize(
    "parameters, length",
    [
        ({"rope_type": "linear", "factor": 4.0}, 40),
        ({"rope_type": "dynamic", "factor": 2.0}, 300),  # past the original 256
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            100,
        ),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 100),
    ],
    ids=lambda v: v["rope_type"] if isinstance(v, dict) else str(v),
)
def test_llama_scaling_rules(parameters, length, tmp_path):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters={"rope_theta": 50000.0, **parameters},
    )
    rope = _check_half(config, LlamaRotaryEmbedding, tmp_path, length=length)
    assert rope.scaling is not None


def test_phi3_longrope_both_sets(tmp_path):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    pairs = 32
    config = Phi3Config(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        original_max_position_embeddings=128,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": list(np.linspace(1.0, 2.0, pairs)),
            "long_factor": list(np.linspace(1.0, 8.0, pairs)),
        },
    )
    for length in (100, 200):  # the short factors, then past the original length the long ones
        _check_half(config, Phi3RotaryEmbedding, tmp_path / str(length), length=length)


def test_gpt_neox_partial_rotary(tmp_path):
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    config = GPTNeoXConfig(hidden_size=256, num_attention_heads=4, rotary_pct=0.25)
    rope = _check_half(config, GPTNeoXRotaryEmbedding, tmp_path, length=30, kv_heads=4)
    assert rope.rotary_dim == 16


def test_gptj_absolute_rotary_dim_and_attribute_aliases(tmp_path):
    from transformers import GPTJConfig
    from transformers.models.gptj.modeling_gptj import (
        apply_rotary_pos_emb,
        create_sinusoidal_positions,
    )

    config = GPTJConfig(n_embd=256, n_head=4, rotary_dim=16, n_positions=512)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 30, 4, 64)).astype(np.float32)  # GPT-J keeps (B, T, H, d)
    position_ids = np.arange(30)[None].repeat(2, 0) + np.array([[0], [7]])
    sincos = create_sinusoidal_positions(512, 16)[torch.from_numpy(position_ids)]
    sin, cos = torch.split(sincos, 8, dim=-1)
    t = torch.from_numpy(x.copy())
    t[..., :16] = apply_rotary_pos_emb(t[..., :16], sin, cos)
    for source in _configs(config, tmp_path):
        rope = ar.RoPE.from_hf_config(source)
        assert (rope.head_dim, rope.rotary_dim, rope.style) == (64, 16, "interleaved")
        _same(rope.rotate(x, position_ids, head_axis=2), t.numpy(), x, position_ids)


def test_conflicting_fields_are_errors():
    base = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4}
    with pytest.raises(ar.RopeValueError, match="rope_theta=50000.*rotary_emb_base=10000"):
        ar.RoPE.from_hf_config({**base, "rope_theta": 50000.0, "rotary_emb_base": 10000.0})
    with pytest.raises(ar.RopeValueError, match="hidden_size=256 and n_embd=128"):
        ar.RoPE.from_hf_config({**base, "n_embd": 128})
    # GPT-J reads rotary_dim and no partial rotary factor, as its code does
    gptj = {**base, "model_type": "gptj", "rotary_dim": 32, "partial_rotary_factor": 0.25}
    assert ar.RoPE.from_hf_config(gptj).rotary_dim == 32
    # a field the family's code does not read is not read here either
    assert ar.RoPE.from_hf_config({**base, "rotary_dim": 32}).rotary_dim == 64


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "qwen2_vl"])
def test_apply_cos_sin_of_transformers_tables_is_bit_for_bit(family):
    """transformers' own float32 cos and sin, applied by apply_cos_sin_qk, give its q and k bit
    for bit: the route for matching a reference model's logits exactly."""
    if family == "llama":
        from transformers import LlamaConfig as Config
        from transformers.models.llama import modeling_llama as modeling

        config, rotary = Config(hidden_size=256, num_attention_heads=4), "LlamaRotaryEmbedding"
    elif family == "gpt_neox":
        from transformers import GPTNeoXConfig as Config
        from transformers.models.gpt_neox import modeling_gpt_neox as modeling

        config = Config(hidden_size=256, num_attention_heads=4, rotary_pct=0.25)
        rotary = "GPTNeoXRotaryEmbedding"
    else:
        from transformers import Qwen2VLTextConfig as Config
        from transformers.models.qwen2_vl import modeling_qwen2_vl as modeling

        sections = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}
        config = Config(hidden_size=256, num_attention_heads=4, rope_parameters=sections)
        rotary = "Qwen2VLRotaryEmbedding"
    rng = np.random.default_rng(5)
    q = torch.from_numpy(rng.standard_normal((2, 4, 30, 64)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((2, 4, 30, 64)).astype(np.float32))
    shape = (3, 2, 30) if family == "qwen2_vl" else (2, 30)
    position_ids = torch.from_numpy(rng.integers(0, 100000, size=shape))
    cos, sin = getattr(modeling, rotary)(config)(q, position_ids)
    want_q, want_k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    rotary_dim = cos.shape[-1]
    got_q, got_k = ar.apply_cos_sin_qk(
        q.numpy(), k.numpy(), cos.numpy(), sin.numpy(), style="half", rotary_dim=rotary_dim,
        head_axis=1,
    )  # fmt: skip
    assert np.array_equal(got_q.view(np.uint32), want_q.numpy().view(np.uint32))
    assert np.array_equal(got_k.view(np.uint32), want_k.numpy().view(np.uint32))
