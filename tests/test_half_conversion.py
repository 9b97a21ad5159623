"""The in-register half-type conversions of the CPU kernels, against NumPy and ml_dtypes.

Both float16 paths are checked: F16C instructions (where the CPU has them) and the bit
arithmetic that other CPUs use, on every float16 value and on float32 values around every
rounding boundary.
"""

import numpy as np
import pytest
from conftest import BF16

convert = pytest.importorskip(
    "arrayrope.backends.cpu._convert", reason="the CPU kernels need Numba"
)
from numba import njit  # noqa: E402

ALL_F16 = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.int16)


@njit
def _widen_soft(bits, out):
    for i in range(bits.size):
        out[i] = convert.f16_to_f32(bits[i])


@njit
def _narrow_soft(values, out):
    for i in range(values.size):
        out[i] = convert.f32_to_f16(values[i])


@njit
def _widen_bf16(bits, out):
    for i in range(bits.size):
        out[i] = convert.bf16_to_f32(bits[i])


@njit
def _narrow_bf16(values, out):
    for i in range(values.size):
        out[i] = convert.f32_to_bf16(values[i])


@njit
def _round_trip_loaded(bits, out):
    # through the overloads the kernels use (hardware F16C where available)
    for i in range(bits.size):
        convert.store(out, np.uint64(i), convert.load(bits, np.uint64(i)))


def _float32_samples():
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    # every float16 value, and the float32 values just around each midpoint between neighbours
    f16 = ALL_F16.view(np.float16).astype(np.float32)
    f16 = f16[np.isfinite(f16)]
    mids = (np.sort(f16.astype(np.float64))[:-1] + np.sort(f16.astype(np.float64))[1:]) / 2
    mids = mids.astype(np.float32)
    near = np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])
    edges = np.array(
        [
            65504,
            65519.996,
            65520,
            65536,
            1e9,
            2**-14,
            2**-24,
            2**-25,
            3 * 2**-26,
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
        ],
        dtype=np.float32,
    )
    return np.concatenate([random_bits.view(np.float32), f16, near, edges])


def _same(got, expected):
    """Bit-equal, except that any nan matches any nan (payloads are not part of the contract)."""
    nan = np.isnan(expected)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint8), expected[~nan].view(np.uint8))


def test_software_float16_widening_is_exact_for_every_value():
    out = np.empty(ALL_F16.size, np.float32)
    _widen_soft(ALL_F16, out)
    _same(out, ALL_F16.view(np.float16).astype(np.float32))


def test_software_float16_narrowing_rounds_half_to_even_like_numpy():
    values = _float32_samples()
    out = np.empty(values.size, np.int16)
    _narrow_soft(values, out)
    with np.errstate(over="ignore"):  # the samples include values that overflow to inf
        expected = values.astype(np.float16)
    _same(out.view(np.float16), expected)


def test_bfloat16_conversions_match_ml_dtypes():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(bits.size, np.float32)
    _widen_bf16(bits, out)
    _same(out, bits.view(BF16).astype(np.float32))
    values = _float32_samples()
    narrowed = np.empty(values.size, np.uint16)
    _narrow_bf16(values, narrowed)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and nan samples
        expected = values.astype(BF16).astype(np.float32)
    _same(narrowed.view(BF16).astype(np.float32), expected)


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_kernel_conversions_round_trip_every_value(kind):
    bits = ALL_F16 if kind == "float16" else ALL_F16.view(np.uint16)
    out = np.empty_like(bits)
    _round_trip_loaded(bits, out)
    dtype = np.float16 if kind == "float16" else BF16
    _same(out.view(dtype).astype(np.float32), bits.view(dtype).astype(np.float32))


def test_kernels_on_the_software_float16_path():
    # What CPUs without F16C run: the whole kernel, fast path and general path, in a fresh
    # process with the switch set (kernels compile there, uncached).
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np, arrayrope as ar\n"
        "from arrayrope.backends.cpu import _config, _decode, _rows\n"
        "assert not _config.HARDWARE_F16\n"
        "assert _decode.rows_kernel(np.dtype(np.int16)) is _decode.rotate_rows\n"
        "x = (np.random.default_rng(0).standard_normal((3, 5, 16)) * 300).astype(np.float16)\n"
        "for style in ('interleaved', 'half'):\n"
        "    ref = ar.rotate(x, 1000, style=style, backend='numpy')\n"
        "    rows = ar.rotate(x, 1000, style=style)\n"
        "    with _config.override(small_below=0):  # the general strategy's kernel\n"
        "        general = ar.rotate(x, 1000, style=style, out=np.empty_like(x))\n"
        "    assert (rows.view(np.uint16) == ref.view(np.uint16)).all(), style\n"
        "    assert (general.view(np.uint16) == ref.view(np.uint16)).all(), style\n"
        # no F16C instruction anywhere in the general row loop: without F16C they would be
        # calls Numba's JIT may not link (direct_path refuses such float16 outputs)
        "for kernel in (_rows.rotate_range, _decode.rotate_rows):\n"
        "    for code in kernel.inspect_asm().values():\n"
        "        assert 'vcvtph2ps' not in code and 'vcvtps2ph' not in code\n"
    )
    env = dict(os.environ, ARRAYROPE_SOFT_F16="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_vector_steps_round_bfloat16_results_once_at_every_scale(style):
    # The kernels' bfloat16 results are their float32 results rounded half to even, subnormals
    # included (a conversion instruction that flushes them to zero fails here): plain and
    # streaming stores, and the fused step. Rows at scales from 2**-140 to 2**99.
    import arrayrope as ar
    from arrayrope.backends.cpu import _config

    rng = np.random.default_rng(0)
    scale = 2.0 ** rng.integers(-140, 100, (2, 8, 64, 1))
    x = (rng.standard_normal((2, 8, 64, 128)) * scale).astype(np.float32).astype(BF16)
    pos = rng.integers(0, 5000, 64)
    rope = ar.RoPE(128, style=style)
    expected = rope.rotate(x.astype(np.float32), pos).astype(BF16)
    assert np.count_nonzero(np.abs(expected.astype(np.float32)) < 2.0**-126) > 1000
    with _config.override(stream_above=1 << 62):  # plain stores
        _same(rope.rotate(x, pos).astype(np.float32), expected.astype(np.float32))
    with _config.override(stream_above=0):  # streaming stores
        out = np.empty_like(x)
        rope.rotate(x, pos, out=out)
    _same(out.astype(np.float32), expected.astype(np.float32))
    tokens = x[0].transpose(1, 0, 2)  # (64 tokens, 8 heads, 128)
    q, k, v = tokens[:, :4], tokens[:, 4:6], tokens[:, 6:]
    k_cache, v_cache = np.zeros((4, 16, 2, 128), BF16), np.zeros((4, 16, 2, 128), BF16)
    got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, np.arange(64))
    want = expected[0].transpose(1, 0, 2)
    _same(got.astype(np.float32), want[:, :4].astype(np.float32))
    _same(k_cache.reshape(64, 2, 128).astype(np.float32), want[:, 4:6].astype(np.float32))


def test_plain_bfloat16_steps_round_with_the_conversion_instruction_where_compiled_for_it():
    # Where Numba compiles for AVX512-BF16 with 64-byte steps, the plain steps of 32 bfloat16
    # results (the half style's 64-byte step and chunk, the pair steps of 32 and 64 bytes)
    # round them with vcvtne2ps2bf16, whose flushed subnormals the branch beside it rounds
    # again (see test_plain_bfloat16_steps_keep_subnormal_results); streaming steps and other
    # CPUs round with integer arithmetic. Where the kernel says the CPU has the instruction
    # and nothing changes what Numba compiles for, it is taken.
    import os

    from numba import njit

    from arrayrope.backends.cpu._config import BF16_INSTRUCTION, VECTOR_BYTES
    from arrayrope.backends.cpu._simd import chunk_step, row_step

    try:
        with open("/proc/cpuinfo") as info:
            flags = info.read().split()
    except OSError:
        flags = []
    chosen = {"NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "NUMBA_ENABLE_AVX"} & set(os.environ)
    if "avx512_bf16" in flags and VECTOR_BYTES == 64 and not chosen:
        assert BF16_INSTRUCTION

    def asm_of(step):
        def call(x, o, cos, sin):
            zero = np.uint64(0)
            step(x, zero, o, zero, np.uint64(64), cos, sin, zero, zero, False)

        compiled = njit(cache=False)(call)
        bits, table = np.zeros(256, np.uint16), np.zeros(256, np.float32)
        compiled(bits, bits.copy(), table, table)
        return compiled.inspect_asm(compiled.signatures[-1])

    fast = [(True, 64), (False, 64), (False, 32)] if VECTOR_BYTES == 64 else []
    for half, width in fast:
        assert ("vcvtne2ps2bf16" in asm_of(row_step(half, width, False))) == BF16_INSTRUCTION
    chunk = chunk_step(True, "first", 64, False)
    assert ("vcvtne2ps2bf16" in asm_of(chunk)) == (BF16_INSTRUCTION and VECTOR_BYTES == 64)
    for half, width in [(True, 32), (True, 16), (False, 16)]:
        assert "vcvtne2ps2bf16" not in asm_of(row_step(half, width, False))
    for half in (True, False):
        assert "vcvtne2ps2bf16" not in asm_of(row_step(half, 64, True))


@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("d, rotary_dim", [(96, 96), (80, 80), (256, 102)])
def test_plain_bfloat16_steps_keep_subnormal_results(style, d, rotary_dim):
    # Plain stores of bfloat16 results at every step width that may round with vcvtne2ps2bf16
    # (d = 96: a 64- and a 32-byte step; 80: 32 and 16 bytes in pairs; 102 of 256: chunks of
    # 64 bytes with pair blocks off the 16-byte grid), rows at scales from 2**-140 to 2**99:
    # the results are the float32 results rounded half to even, subnormals included.
    import arrayrope as ar
    from arrayrope.backends.cpu import _config

    rng = np.random.default_rng(d + rotary_dim)
    scale = 2.0 ** rng.integers(-140, 100, (2, 8, 64, 1))
    x = (rng.standard_normal((2, 8, 64, d)) * scale).astype(np.float32).astype(BF16)
    pos = rng.integers(0, 5000, 64)
    rope = ar.RoPE(d, style=style, rotary_dim=rotary_dim)
    expected = rope.rotate(x.astype(np.float32), pos).astype(BF16).astype(np.float32)
    assert np.count_nonzero(np.abs(expected) < 2.0**-126) > 500
    for small_below in (0, 1 << 40):  # the launched kernels, then the small path
        with _config.override(stream_above=1 << 62, small_below=small_below):
            _same(rope.rotate(x, pos).astype(np.float32), expected)
            y = x.copy()
            rope.rotate(y, pos, out=y)
            _same(y.astype(np.float32), expected)


def test_2_byte_kernels_compile_where_numba_turns_avx_off():
    # NUMBA_ENABLE_AVX=0 takes every AVX feature from what Numba compiles for: the conversion
    # instruction, whose operands need AVX-512 registers, and the 32-byte pieces of streaming
    # stores, which need AVX registers, must then stay out of the kernels (plain and streaming
    # stores, float16 and bfloat16).
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np, ml_dtypes, arrayrope as ar\n"
        "from arrayrope.backends.cpu import _config\n"
        "assert not _config.BF16_INSTRUCTION and not _config.WIDE_PIECES\n"
        "for dtype in (ml_dtypes.bfloat16, np.float16):\n"
        "    x = np.random.default_rng(0).standard_normal((1, 32, 64, 128)).astype(dtype)\n"
        "    want = ar.rotate(x, np.arange(64), backend='numpy')\n"
        "    for stream_above in (1 << 62, 0):\n"
        "        with _config.override(stream_above=stream_above, small_below=0):\n"
        "            got = ar.rotate(x, np.arange(64))\n"
        "        assert (got.view(np.uint16) == want.view(np.uint16)).all()\n"
        "print('ok')\n"
    )
    env = dict(os.environ, NUMBA_ENABLE_AVX="0", ARRAYROPE_NUMBA_CACHE="0")
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
