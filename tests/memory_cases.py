"""Kernel routes through the public API on operands that touch inaccessible pages.

Used three ways: by ``test_memory_bounds.py`` (guard pages, each route configuration in its own
subprocess), by ``bench/memcheck.py`` (the same worker under Valgrind's memcheck, operands on the
heap) and by hand:

    python tests/memory_cases.py < cases.json      # a JSON list of case specs

A case spec is a small dict (see :func:`standard_cases` and :func:`random_case`): the RoPE, the
operation, the operands' dtype, shapes, layouts and which side of them touches a guard page, the
positions. The worker prints ``BEGIN <i>`` before case i and ``OK <i>`` or ``FAIL <i> <why>``
after it, flushing each line, so a case that kills the process is the last one begun. Every
result is checked against the float64 oracle, every pass-through feature bit for bit, and every
input that is not written must keep its bits.
"""

import json
import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from guarded import guarded, span  # noqa: E402
from oracles import BF16, assert_matches, oracle, qwen3_oracle  # noqa: E402

DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
# The route configurations each worker runs under, steered by the library's switches: decode and
# prefill sizes on one thread (the defaults), every input on the parallel kernels with streaming
# stores and with plain stores, and streaming again with the table calls' rows taken two
# positions at a time through every head (see BLOCK_ROWS).
CONFIGS = {
    "one thread (default switches)": {},
    "parallel, streaming stores": {"ARRAYROPE_SERIAL_BELOW": "0", "ARRAYROPE_STREAM_ABOVE": "0"},
    "parallel, plain stores": {
        "ARRAYROPE_SERIAL_BELOW": "0",
        "ARRAYROPE_STREAM_ABOVE": str(1 << 62),
    },
    "parallel, streaming stores, table blocks of two positions": {
        "ARRAYROPE_SERIAL_BELOW": "0",
        "ARRAYROPE_STREAM_ABOVE": "0",
        "MEMORY_CASES_BLOCK_ROWS": "2",
    },
}
# Where set, the table calls of the CPU backend take their rows in blocks of this many
# positions through every head (backends.cpu.launch blocks hundreds, past these cases' sizes).
BLOCK_ROWS = int(os.environ.get("MEMORY_CASES_BLOCK_ROWS", "0"))
EDGE = 40  # max_positions of the RoPEs whose cache edge the "edge" and "past" positions probe


def _dtype(name):
    return BF16 if name == "bfloat16" else np.dtype(name)


def _strides(shape, itemsize, layout):
    """Byte strides of ``layout``: "contiguous" (C order), "reversed" (every leading axis
    walked backwards), "gap" (one spare element after each row: rows start off the 16-byte
    grid) or "misaligned" (C order; the start is moved off the element grid by the caller)."""
    d = shape[-1]
    row = d + (1 if layout == "gap" else 0)
    strides = [itemsize]
    step = row * itemsize
    for n in reversed(shape[:-1]):
        strides.insert(0, step)
        step *= n
    if layout == "reversed":
        strides = [-s for s in strides[:-1]] + [itemsize]
    return tuple(strides)


# "guard": operands in guarded pages; "heap": in NumPy allocations of exactly their span, which
# Valgrind's memcheck surrounds with red zones (bench/memcheck.py).
ALLOCATION = os.environ.get("MEMORY_CASES_ALLOCATION", "guard")


def _on_heap(shape, dtype, strides, shift):
    """An array of ``shape`` and byte ``strides`` at ``shift`` bytes into a heap block that
    holds exactly its span."""
    low, high = span(shape, strides, dtype.itemsize)
    block = np.empty(high - low + shift, np.uint8)
    return np.ndarray(shape, dtype, buffer=block, offset=shift - low, strides=strides)


def make_array(rng, shape, dtype, layout, side, values=True):
    """An operand of ``shape`` in ``layout`` (guarded, or on the heap: see ALLOCATION); random
    values unless ``values`` is False (then nan)."""
    shift = 0
    if layout == "misaligned":
        side, shift = "before", max(1, dtype.itemsize // 2)
    strides = _strides(shape, dtype.itemsize, layout)
    if ALLOCATION == "heap":
        a = _on_heap(shape, dtype, strides, shift)
    else:
        a = guarded(shape, dtype, strides, side=side, shift=shift)
    if values:
        a[...] = rng.standard_normal(shape).astype(dtype)
    else:
        a[...] = np.nan
    return a


def _rope(ar, spec):
    kind = spec["kind"]
    if kind == "plain":
        return ar.RoPE(
            spec["head_dim"],
            rotary_dim=spec["rotary_dim"],
            style=spec["style"],
            max_positions=spec.get("max_positions"),
        )
    if kind == "axial":
        return ar.RoPE.axial(spec["dims"], style="interleaved")
    return ar.RoPE.sectioned(spec["head_dim"], spec["sections"], assign="interleaved")


def _positions(rng, spec, lead, n_axes, side):
    """(pos as passed, pos as the oracle reads it) for a leading shape ``lead``."""
    kind = spec["kind"]
    if kind == "none":
        return None, None
    if kind == "int":
        return spec["value"], spec["value"]
    if kind in ("edge", "past"):
        low = EDGE - 3 if kind == "edge" else EDGE
        shape = (lead[-1],) if lead else ()
        values = rng.integers(low, low + 3, size=shape)
        if kind == "edge":
            values[..., -1:] = EDGE - 1  # the cache's last row
    else:  # one position per token, broadcast over the head axis where there is one
        shape = lead[:-2] + (1, lead[-1]) if len(lead) >= 2 else lead
        if kind == "float":
            values = rng.random(shape) * 1000.0
        else:
            values = rng.integers(0, 4096, size=shape)
    if n_axes > 1:
        values = rng.integers(0, 64, size=tuple(values.shape) + (n_axes,))
    if ALLOCATION == "heap":
        pos = _on_heap(values.shape, values.dtype, values.strides, 0)
    else:
        pos = guarded(values.shape, values.dtype, side=side)
    pos[...] = values
    return pos, values


def _expected(spec, x, pos, inverse):
    rope = spec["rope"]
    if rope["kind"] == "plain":
        return oracle(x, pos, style=rope["style"], rotary_dim=rope["rotary_dim"], inverse=inverse)
    if rope["kind"] == "axial":
        out, start = [], 0
        for a, n in enumerate(rope["dims"]):
            part = oracle(x[..., start : start + n], pos[..., a], inverse=inverse)
            out.append(part)
            start += n
        return np.concatenate(out, axis=-1)
    sign = -1 if inverse else 1
    return qwen3_oracle(x, sign * np.asarray(pos), rope["sections"], 10000.0)


def _check_result(result, expected, x, rotary_dim):
    assert result.shape == x.shape and result.dtype == x.dtype, (result.shape, result.dtype)
    assert_matches(result, expected, x)
    tail = np.ascontiguousarray(result[..., rotary_dim:]).view(np.uint8)
    assert (tail == np.ascontiguousarray(x[..., rotary_dim:]).view(np.uint8)).all(), "tail bits"


def run_case(spec):
    """Run one case; raises AssertionError (or the library's error) where it fails."""
    import arrayrope as ar

    rng = np.random.default_rng(spec["seed"])
    dtype = _dtype(spec["dtype"])
    side = spec["side"]
    rope_spec = spec["rope"]
    rope = _rope(ar, rope_spec)
    rotary_dim = rope.rotary_dim
    inverse = spec["inverse"]
    op = spec["op"]
    x = make_array(rng, spec["shape"], dtype, spec["layout"], side)
    if spec.get("touch_past_end"):  # the guard's own test: one element past x's last byte
        flat = np.lib.stride_tricks.as_strided(x, shape=(x.size + 1,), strides=(x.itemsize,))
        float(flat[-1])
    shared = rope_spec["kind"] == "plain" and rope_spec.get("max_positions") is None
    kw = {"style": rope.style, "rotary_dim": rotary_dim}

    if op in ("alloc", "out", "inplace"):
        pos, oracle_pos = _positions(rng, spec["pos"], x.shape[:-1], rope.n_axes, side)
        before = x.copy()
        expected = _expected(spec, before, oracle_pos, inverse)
        if op == "alloc":
            out = None
        elif op == "inplace":
            out = x
        else:
            out = make_array(rng, x.shape, dtype, spec["out_layout"], side, values=False)
        if shared and spec["seed"] % 2:  # the module-level function, half the time
            result = ar.rotate(x, pos, inverse=inverse, out=out, **kw)
        else:
            result = rope.rotate(x, pos, inverse=inverse, out=out)
        if out is not None:
            assert result is out
        if op != "inplace":
            assert (x.view(np.uint8) == before.view(np.uint8)).all(), "x was written"
        _check_result(result, expected, before, rotary_dim)
        return

    if op == "into_cache":
        _into_cache(rope, spec, rng, dtype, side)
        return

    # rotate_qk: k with fewer heads (grouped-query attention), or q and k as views of one
    # fused QKV buffer, rotated in place.
    if op == "qk_fused":
        b, h, t, d = spec["shape"]
        kv = max(1, h // 2)
        fused = make_array(rng, (b, t, h + 2 * kv, d), dtype, spec["layout"], side)
        q = fused[:, :, :h].transpose(0, 2, 1, 3)
        k = fused[:, :, h + kv :].transpose(0, 2, 1, 3)  # k last: its final row touches the guard
        outs = (q, k)
    else:
        q = x
        shape = list(spec["shape"])
        if len(shape) >= 3:
            shape[-3] = max(1, shape[-3] // 2)
        k = make_array(rng, tuple(shape), dtype, spec["layout"], side)
        if op == "qk_out":
            outs = tuple(
                make_array(rng, a.shape, dtype, spec["out_layout"], side, values=False)
                for a in (q, k)
            )
        else:
            outs = None
    lead = q.shape[:-1] if q.ndim >= k.ndim else k.shape[:-1]
    pos, oracle_pos = _positions(rng, spec["pos"], lead, rope.n_axes, side)
    q0, k0 = q.copy(), k.copy()
    untouched = fused[:, :, h : h + kv].copy() if op == "qk_fused" else None
    if shared and spec["seed"] % 2:
        result = ar.rotate_qk(q, k, pos, inverse=inverse, out=outs, **kw)
    else:
        result = rope.rotate_qk(q, k, pos, inverse=inverse, out=outs)
    if pos is None:
        pq = pk = None
    else:
        pq = pk = oracle_pos
    for got, before, p in zip(result, (q0, k0), (pq, pk)):
        _check_result(got, _expected(spec, before, p, inverse), before, rotary_dim)
    if untouched is not None:
        v = fused[:, :, h : h + kv]
        assert (v.view(np.uint8) == untouched.view(np.uint8)).all(), "v was written"
    if outs is None:
        assert (q.view(np.uint8) == q0.view(np.uint8)).all(), "q was written"
        assert (k.view(np.uint8) == k0.view(np.uint8)).all(), "k was written"


def _into_cache(rope, spec, rng, dtype, side):
    """RoPE.rotate_into_cache: q, k and v of ``spec["shape"][0]`` tokens, views of one fused
    projection in ``layout``; both caches guarded, their first and last slots written, so a
    cache row sits flush against the guard; rotate_qk and a NumPy scatter of copies on plain
    allocations judge every bit of the second of two calls (the cache's rows written twice
    over with the same values). With QK-norm (one seed in two), q's result goes into a guarded
    ``out`` too, and the same call with plain stores on plain copies judges every bit (the
    vector steps, streaming or not, and the row loop normalize with the same bits)."""
    n, d, seed = spec["shape"][0], spec["shape"][-1], spec["seed"]
    hq, hkv = 3, 1 + seed % 2  # each from its own bits of the seed
    layout, block = ("NHD", "HND")[seed // 2 % 2], 1 + seed // 4 % 4
    fused = make_array(rng, (n, hq + 2 * hkv, d), dtype, spec["layout"], side)
    q, k, v = fused[:, :hq], fused[:, hq : hq + hkv], fused[:, hq + hkv :]
    blocks = -(-(n + 2) // block)
    shape = (blocks, block, hkv, d) if layout == "NHD" else (blocks, hkv, block, d)
    caches = [make_array(rng, shape, dtype, spec["out_layout"], side) for _ in "kv"]
    last = blocks * block - 1
    slots = rng.permutation(np.arange(1, last))[:n]
    edges = [last, 0] if seed // 16 % 2 else [0, last]  # a lone token takes either edge
    slots[: min(n, 2)] = edges[: min(n, 2)]
    slots[2:][rng.random(max(n - 2, 0)) < 0.2] = -1  # padding, the edge slots kept
    given = spec["pos"] if spec["pos"]["kind"] != "none" else {"kind": "array"}  # pos required
    pos, oracle_pos = _positions(rng, given, (n,), rope.n_axes, side)
    copies = [a.copy() for a in (fused, *caches)]
    norms = {}
    if seed // 32 % 2:
        weight = rng.uniform(0.5, 1.5, d).astype(np.float32)
        norms = {"q_norm": weight, "k_norm": weight,
                 "out": make_array(rng, q.shape, dtype, spec["out_layout"], side)}  # fmt: skip
    for _ in range(2):  # a layout's second call takes the decode loop's short way (_kv_step)
        got = rope.rotate_into_cache(q, k, v, pos, *caches, slots, cache_layout=layout, **norms)
    assert (fused.view(np.uint8) == copies[0].view(np.uint8)).all(), "the projection was written"
    if norms:
        from arrayrope.backends.cpu import _config

        plain = [a.copy() for a in copies]
        pq, pk, pv = plain[0][:, :hq], plain[0][:, hq : hq + hkv], plain[0][:, hq + hkv :]
        options = {**norms, "out": None, "cache_layout": layout}
        with _config.override(stream_above=1 << 62):
            want = rope.rotate_into_cache(pq, pk, pv, pos, *plain[1:], slots, **options)
        assert got is norms["out"]
        assert (got.view(np.uint8) == want.view(np.uint8)).all(), "q's rotation"
        for cache, expected in zip(caches, plain[1:]):
            assert (cache.view(np.uint8) == expected.view(np.uint8)).all(), "the cache's rows"
        return
    per_token = oracle_pos if np.ndim(oracle_pos) == 0 else np.asarray(oracle_pos)[:, None]
    want_q, want_k = rope.rotate_qk(q.copy(), k.copy(), per_token)
    assert (got.view(np.uint8) == want_q.view(np.uint8)).all(), "q's rotation"
    used = slots >= 0
    for cache, before, rows in zip(caches, copies[1:], (want_k, copies[0][:, hq + hkv :])):
        if layout == "HND":
            cache, before = cache.transpose(0, 2, 1, 3), before.transpose(0, 2, 1, 3)
        expected = before.reshape(-1, hkv, d).copy()
        expected[slots[used]] = rows[used]
        assert (cache.reshape(-1, hkv, d).view(np.uint8) == expected.view(np.uint8)).all(), (
            "the cache's rows"
        )


def describe(spec):
    """A one-line name for a case."""
    r = spec["rope"]
    rope = r["kind"] if r["kind"] != "plain" else f"d={r['head_dim']} rd={r['rotary_dim']}"
    if r.get("max_positions"):
        rope += f" max_positions={r['max_positions']}"
    return (
        f"{spec['op']} {spec['dtype']} {r.get('style', '')} {rope} shape={tuple(spec['shape'])} "
        f"layout={spec['layout']} out={spec.get('out_layout', '-')} side={spec['side']} "
        f"pos={spec['pos']['kind']} inverse={spec['inverse']} seed={spec['seed']}"
    )


_OPS = ("alloc", "out", "inplace", "qk", "qk_out", "qk_fused", "into_cache")
_LAYOUTS = ("contiguous", "reversed", "gap", "misaligned")
_POS = ("none", "int", "array", "edge", "past", "float")


def _position_spec(kind, index):
    return {"kind": kind, "value": (index * 7919) % 5000} if kind == "int" else {"kind": kind}


def standard_cases(large=False):
    """The fixed matrix: every dtype, both styles, four (head_dim, rotary_dim) pairs (whole,
    an odd number of pairs with a one-pair tail, a few pairs with a tail, one pair), every
    operation, layout, side of the guard and kind of position, in a rotation that covers each
    value with every other at least once per dtype; plus multi-axis layouts. ``large`` adds
    inputs big enough for several parallel tasks and streaming blocks."""
    dims = ((64, 64), (64, 62), (10, 6), (6, 2))
    shapes = ((1, 3, 1), (2, 3, 5), (1, 3, 7))
    cases = []
    index = 0
    for dtype in DTYPE_NAMES:
        for style in ("interleaved", "half"):
            for d, rd in dims:
                for op in _OPS:
                    for side in ("after", "before"):
                        layout = _LAYOUTS[index % len(_LAYOUTS)]
                        pos = _POS[(index // 2) % len(_POS)]
                        lead = shapes[index % len(shapes)]
                        if op == "qk_fused" and len(lead) < 3:
                            lead = (2, 3, 4)
                        if op == "qk_fused" and layout in ("reversed", "gap"):
                            layout = "contiguous"
                        if op == "into_cache":  # tokens
                            lead = ((1, 5, 17)[index % 3],)
                        rope = {"kind": "plain", "head_dim": d, "rotary_dim": rd, "style": style}
                        if pos in ("edge", "past"):
                            rope["max_positions"] = EDGE
                        cases.append(
                            {
                                "rope": rope,
                                "op": op,
                                "dtype": dtype,
                                "shape": list(lead) + [d],
                                "layout": layout,
                                "out_layout": _LAYOUTS[(index + 1) % 3],
                                "side": side,
                                "pos": _position_spec(pos, index),
                                "inverse": index % 3 == 0,
                                "seed": index,
                            }
                        )
                        index += 1
    multi = (
        {"kind": "axial", "dims": [8, 4, 4], "style": "interleaved"},
        {"kind": "sectioned", "head_dim": 16, "sections": [4, 2, 2], "style": "half"},
    )
    for rope in multi:
        head_dim = 16
        for dtype in DTYPE_NAMES:
            for op in ("alloc", "out", "inplace", "qk"):
                for side in ("after", "before"):
                    cases.append(
                        {
                            "rope": rope,
                            "op": op,
                            "dtype": dtype,
                            "shape": [2, 3, 5, head_dim] if index % 2 else [2, 12, 9, head_dim],
                            "layout": _LAYOUTS[index % 3],
                            "out_layout": "contiguous",
                            "side": side,
                            "pos": {"kind": "array"},
                            "inverse": index % 2 == 0,
                            "seed": index,
                        }
                    )
                    index += 1
    if large:
        for dtype in DTYPE_NAMES:
            for style in ("interleaved", "half"):
                for op in ("alloc", "out", "inplace", "qk", "into_cache"):
                    cases.append(
                        {
                            "rope": {
                                "kind": "plain",
                                "head_dim": 128,
                                # whole, pair blocks on the 16-byte grid, and off it
                                "rotary_dim": (128, 96, 50)[index // 2 % 3],
                                "style": style,
                            },
                            "op": op,
                            "dtype": dtype,
                            "shape": [300, 128] if op == "into_cache" else [1, 8, 300, 128],
                            "layout": ("contiguous", "reversed", "gap")[index % 3],
                            "out_layout": ("contiguous", "gap")[index % 2],
                            "side": ("after", "before")[index % 2],
                            "pos": {"kind": ("none", "array", "float")[index % 3]},
                            "inverse": index % 2 == 0,
                            "seed": index,
                        }
                    )
                    index += 1
    return cases


def case_strategy():
    """A hypothesis strategy of case specs: any route, dtype, layout and side, sizes from a
    decode step to a few parallel tasks."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw):
        kind = draw(st.sampled_from(["plain"] * 6 + ["axial", "sectioned"]))
        op = draw(st.sampled_from(_OPS))
        if kind == "plain":
            pairs = draw(st.integers(1, 80))
            tail = draw(st.sampled_from([0, 0, 1, 2, 5]))
            style = draw(st.sampled_from(["interleaved", "half"]))
            rope = {"kind": kind, "head_dim": 2 * (pairs + tail), "rotary_dim": 2 * pairs}
            rope["style"] = style
            pos = draw(st.sampled_from(_POS))
            if pos in ("edge", "past"):
                rope["max_positions"] = EDGE
            d = rope["head_dim"]
        else:
            if kind == "axial":
                rope = {"kind": kind, "dims": [8, 4, 4], "style": "interleaved"}
            else:
                rope = {"kind": kind, "head_dim": 16, "sections": [4, 2, 2], "style": "half"}
            pos, d = "array", 16
        if op == "qk_fused":
            lead = [draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 9))]
            layout = draw(st.sampled_from(["contiguous", "misaligned"]))
        else:
            lead = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
            if draw(st.integers(0, 9)) == 0:
                lead[-1] = draw(st.integers(100, 400))  # several parallel tasks
            layout = draw(st.sampled_from(_LAYOUTS))
        return {
            "rope": rope,
            "op": op,
            "dtype": draw(st.sampled_from(DTYPE_NAMES)),
            "shape": lead + [d],
            "layout": layout,
            "out_layout": draw(st.sampled_from(_LAYOUTS[:3])),
            "side": draw(st.sampled_from(["after", "before"])),
            "pos": _position_spec(pos, draw(st.integers(0, 10**6))),
            "inverse": draw(st.booleans()),
            "seed": draw(st.integers(0, 2**32 - 1)),
        }

    return cases()


def corpus(size, seed=0):
    """``size`` case specs drawn from :func:`case_strategy`, the same for the same seed."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as seeded

    found = []

    @settings(
        max_examples=2 * size,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @seeded(seed)
    @given(case_strategy())
    def collect(spec):
        found.append(spec)

    collect()
    unique = {json.dumps(c, sort_keys=True): c for c in found}
    return list(unique.values())[:size]


def _small_table_blocks(rows):
    """Table calls blocked ``rows`` positions at a time, whatever their table's row size."""
    from arrayrope.backends import cpu

    chunked = cpu._chunked
    cpu._TABLE_BLOCK_BYTES = 0  # every call with two positions or more tries

    def blocked(operand, size, filled=True):
        return chunked(operand, size if filled else rows, filled)

    cpu._chunked = blocked


def main():
    cases = json.load(sys.stdin)
    if BLOCK_ROWS:
        _small_table_blocks(BLOCK_ROWS)
    failed = 0
    for i, spec in enumerate(cases):
        print(f"BEGIN {i}", flush=True)
        try:
            run_case(spec)
        except Exception as error:  # noqa: BLE001  (reported, with the case, to the parent)
            failed += 1
            why = "".join(traceback.format_exception_only(type(error), error)).strip()
            print(f"FAIL {i} {why.splitlines()[-1] if why else type(error).__name__}", flush=True)
        else:
            print(f"OK {i}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
