"""RoPE(angles="transformers") against transformers' own rotary module, bit for bit.

Each rope type of transformers' ROPE_INIT_FUNCTIONS is built in a Llama config and driven
through LlamaRotaryEmbedding and apply_rotary_pos_emb, at positions drawn from the whole range
[0, 2**31): arrayrope's float32 rotation must equal transformers' in every bit, on every route
(a cached table, rows past it, a decode step past it, a call large enough for the parallel
kernels). tests/test_hf_families.py checks every family whose own tables give its q and k.
"""

import pickle
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayrope as ar

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from transformers.models.llama import modeling_llama  # noqa: E402

HEAD_DIM = 64
RULES = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn_deepseek": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 24,
        "beta_slow": 2,
    },  # fmt: skip
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },  # fmt: skip
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 4096,
        "factor": 8.0,
        "short_factor": [1.0 + i / 16 for i in range(HEAD_DIM // 2)],
        "long_factor": [1.0 + i for i in range(HEAD_DIM // 2)],
    },  # fmt: skip
}


def _config(rule, base=500000.0, partial=None):
    params = {"rope_type": "default", "rope_theta": base, **RULES[rule]}
    if partial is not None:
        params["partial_rotary_factor"] = partial
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaConfig(
            hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=32768, rope_parameters=params,
        )  # fmt: skip


def _theirs(config, q, k, pos):
    """transformers' rotated q and k (float32 tensors) at the int64 positions ``pos`` (B, T).
    A fresh module each call: dynamic RoPE's module remembers the longest length it has seen,
    where arrayrope reads each call alone."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = modeling_llama.LlamaRotaryEmbedding(config)
        cos, sin = module(torch.from_numpy(q), torch.from_numpy(pos))
        q_rot, k_rot = modeling_llama.apply_rotary_pos_emb(
            torch.from_numpy(q), torch.from_numpy(k), cos, sin
        )
    return q_rot.numpy(), k_rot.numpy()


def _bits(a):
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rule=st.sampled_from(sorted(RULES)),
    pos=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=6),
    near=st.sampled_from([0, 1000, 65530, 1 << 20, 2**31 - 8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_rotation_equals_transformers_bit_for_bit(rule, pos, near, seed):
    config = _config(rule)
    rope = ar.RoPE.from_hf_config(config, angles="transformers")
    # positions from the whole range, and a run of them near a table edge or the end
    pos = np.array([pos + list(range(near, near + 5))], dtype=np.int64)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 4, pos.shape[1], HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((1, 2, pos.shape[1], HEAD_DIM)).astype(np.float32)
    want_q, want_k = _theirs(config, q, k, pos)
    out = np.full_like(q, np.nan)  # poisoned
    got_q, got_k = rope.rotate_qk(q, k, pos[0], out=(out, np.empty_like(k)))
    assert np.array_equal(_bits(got_q), _bits(want_q)), f"{rule}: q differs"
    assert np.array_equal(_bits(got_k), _bits(want_k)), f"{rule}: k differs"


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_route_past_the_table(rule):
    config = _config(rule)
    rope = ar.RoPE.from_hf_config(config, angles="transformers")
    rng = np.random.default_rng(3)
    # a decode step past the table (an int, then a one-entry array)
    q = rng.standard_normal((1, 4, 1, HEAD_DIM)).astype(np.float32)
    for m in (70_000, 123_456_789):
        want, _ = _theirs(config, q, q, np.array([[m]]))
        assert np.array_equal(_bits(rope.rotate(q, m)), _bits(want))
        assert np.array_equal(_bits(rope.rotate(q, np.array([m]))), _bits(want))
    # a prefill past the table (its rows made by torch a block at a time)
    pos = np.arange(1_000_000, 1_004_096, dtype=np.int64)[None]
    q = rng.standard_normal((1, 4, pos.shape[1], HEAD_DIM)).astype(np.float32)
    want, _ = _theirs(config, q, q, pos)
    assert np.array_equal(_bits(rope.rotate(q, pos[0])), _bits(want))
    # in place, from the cached table
    pos = np.arange(0, 3000, dtype=np.int64)[None]
    q = rng.standard_normal((1, 4, pos.shape[1], HEAD_DIM)).astype(np.float32)
    want, _ = _theirs(config, q, q, pos)
    assert rope.rotate(q, pos[0], out=q) is q
    assert np.array_equal(_bits(q), _bits(want))


def test_partial_rotary_and_float64():
    config = _config("linear", partial=0.5)  # (Llama's default rope ignores partial rotary)
    rope = ar.RoPE.from_hf_config(config, angles="transformers")
    assert rope.rotary_dim == HEAD_DIM // 2
    rng = np.random.default_rng(5)
    pos = rng.integers(0, 2**31, (1, 9))
    q = rng.standard_normal((1, 4, 9, HEAD_DIM)).astype(np.float32)
    theirs = modeling_llama.LlamaRotaryEmbedding(config)
    cos, sin = theirs(torch.from_numpy(q), torch.from_numpy(pos))
    part, rest = (
        torch.from_numpy(q)[..., : HEAD_DIM // 2],
        torch.from_numpy(q)[..., HEAD_DIM // 2 :],
    )
    rotated, _ = modeling_llama.apply_rotary_pos_emb(part, part, cos, sin)
    want = torch.cat([rotated, rest], -1).numpy()
    assert np.array_equal(_bits(rope.rotate(q, pos[0])), _bits(want))
    # float64: transformers' float32 tables, widened, and the rotation in float64
    q64 = q.astype(np.float64)
    cos, sin = theirs(torch.from_numpy(q64), torch.from_numpy(pos))
    rotated, _ = modeling_llama.apply_rotary_pos_emb(
        torch.from_numpy(q64[..., : HEAD_DIM // 2]), torch.from_numpy(q64[..., : HEAD_DIM // 2]),
        cos, sin,
    )  # fmt: skip
    want = np.concatenate([rotated.numpy(), q64[..., HEAD_DIM // 2 :]], -1)
    assert np.array_equal(_bits(rope.rotate(q64, pos[0])), _bits(want))


@settings(deadline=None)
@given(pos=st.lists(st.floats(0, 2**31 - 1), min_size=1, max_size=8), seed=st.integers(0, 99))
def test_real_positions_read_as_float32(pos, seed):
    # transformers' module reads position ids as float32, reals too: so does this mode (past
    # 2**24 float32 rounds integers as well)
    config = _config("default")
    rope = ar.RoPE.from_hf_config(config, angles="transformers")
    pos = np.array([pos], dtype=np.float64)
    q = np.random.default_rng(seed).standard_normal((1, 4, pos.shape[1], HEAD_DIM))
    q = q.astype(np.float32)
    want, _ = _theirs(config, q, q, pos)
    assert np.array_equal(_bits(rope.rotate(q, pos[0])), _bits(want))


def test_dynamic_grows_past_max_position_embeddings():
    # as transformers' module: the base grows past max_position_embeddings, whatever an
    # original_max_position_embeddings in the parameters says (transformers ignores it there)
    config = _config("dynamic")
    config.rope_parameters["original_max_position_embeddings"] = 4096
    q = np.random.default_rng(2).standard_normal((1, 4, 3, HEAD_DIM)).astype(np.float32)
    for pos in ([[5000, 6000, 7000]], [[40_000, 50_000, 60_000]]):
        pos = np.array(pos)
        want, _ = _theirs(config, q, q, pos)
        rope = ar.RoPE.from_hf_config(config, angles="transformers")
        assert rope.scaling.original_max_positions == config.max_position_embeddings
        assert np.array_equal(_bits(rope.rotate(q, pos[0])), _bits(want))


def test_exact_stays_the_default_and_differs():
    exact, hf = ar.RoPE(64, style="half"), ar.RoPE(64, style="half", angles="transformers")
    assert exact.angles == "exact" and "angles" not in repr(exact)
    assert "angles='transformers'" in repr(hf)
    assert hf.inv_freq.dtype == np.float64
    assert np.array_equal(hf.inv_freq, hf.inv_freq.astype(np.float32))  # float32 values
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    assert not np.array_equal(exact.rotate(x, 10**6), hf.rotate(x, 10**6))


def test_pickled_rope_keeps_its_angles():
    rope = ar.RoPE.from_hf_config(_config("yarn"), angles="transformers")
    again = pickle.loads(pickle.dumps(rope))
    assert again.angles == "transformers"
    x = np.random.default_rng(1).standard_normal((2, 3, HEAD_DIM)).astype(np.float32)
    assert np.array_equal(_bits(again.rotate(x, 99_999)), _bits(rope.rotate(x, 99_999)))
    # a pickle of the earlier form, without angles (or without pick too): exact angles
    restore, (config,) = ar.RoPE(HEAD_DIM, scaling=ar.scaling.Linear(2.0)).__reduce__()
    for earlier in (config[:9], config[:8]):
        old = restore(earlier)
        assert old.angles == "exact" and old.scaling == ar.scaling.Linear(2.0)


@pytest.mark.parametrize("bad", ["float32", "Transformers", 1, None])
def test_unknown_angles_refused(bad):
    with pytest.raises(ar.RopeValueError, match="angles must be 'exact' or 'transformers'"):
        ar.RoPE(8, angles=bad)


def test_needs_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(ar.BackendUnavailableError, match="pip install torch"):
        ar.RoPE(8, angles="transformers")


def test_cos_sin_are_transformers_tables():
    config = _config("yarn")
    rope = ar.RoPE.from_hf_config(config, angles="transformers")
    pos = np.array([[0, 7, 40_000, 2**31 - 1]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = modeling_llama.LlamaRotaryEmbedding(config)
    x = torch.zeros(1, 4, HEAD_DIM)
    want_cos, want_sin = (
        t.numpy()[0, :, : HEAD_DIM // 2] for t in module(x, torch.from_numpy(pos))
    )
    cos, sin = rope.cos_sin(pos[0])
    assert np.array_equal(_bits(cos), _bits(want_cos)) and np.array_equal(
        _bits(sin), _bits(want_sin)
    )
