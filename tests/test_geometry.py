"""The operand geometry the kernels walk: merging leading axes must not move a single row."""

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from arrayrope.backends._geometry import flat_view, geometry


def _row_offsets_by_axes(x, out, idx, flat=True):
    """(x, out, idx) element offsets of every row, in C order, from the arrays' own strides:
    into the flat views (``flat``), or from each array's element 0 (the CUDA C kernels)."""
    xo, oo, io = (flat_view(a)[1] if flat else 0 for a in (x, out, idx))
    rows = []
    for i in itertools.product(*(range(n) for n in x.shape[:-1])):
        rows.append(
            (
                xo + sum(k * s // x.itemsize for k, s in zip(i, x.strides)),
                oo + sum(k * s // out.itemsize for k, s in zip(i, out.strides)),
                io
                + sum(
                    0 if n == 1 else k * s // idx.itemsize
                    for k, n, s in zip(i, idx.shape, idx.strides)
                ),
            )
        )
    return rows


def _row_offsets_by_geometry(g, t):
    """The same offsets as the kernels find them: each row index decoded through ``g``."""
    nlead = g.shape[2] - 1
    rows = []
    for row in range(int(np.prod(g[t, 0, :nlead]))):
        offsets = [int(g[t, r, nlead]) for r in (1, 2, 3)]
        rem = row
        for ax in range(nlead - 1, -1, -1):
            i = rem % g[t, 0, ax]
            rem //= g[t, 0, ax]
            for r in (1, 2, 3):
                offsets[r - 1] += int(i * g[t, r, ax])
        rows.append(tuple(offsets))
    return rows


@st.composite
def operands(draw):
    """x a view with any leading strides (steps, reversals, transposes), out contiguous or a
    view, idx broadcast over some leading axes."""
    nlead = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=nlead, max_size=nlead)))
    base = np.zeros(tuple(2 * n for n in shape) + (4,), np.float32)
    steps = [draw(st.sampled_from([1, 2, -1])) for _ in shape]
    view = base[tuple(slice(None, None, s) if s > 0 else slice(None, None, -1) for s in steps)]
    view = view[tuple(slice(0, n) for n in shape)]
    order = draw(st.permutations(range(nlead)))
    x = np.transpose(view[..., :], tuple(order) + (nlead,))
    out = np.zeros(x.shape, np.float32) if draw(st.booleans()) else x
    kept = [draw(st.booleans()) for _ in x.shape[:-1]]
    idx_shape = tuple(n if k else 1 for n, k in zip(x.shape[:-1], kept)) + (1,)
    idx = np.arange(int(np.prod(idx_shape)), dtype=np.int64).reshape(idx_shape)
    return x, out, idx


@settings(max_examples=200, deadline=None)
@given(operands(), operands())
def test_merged_geometry_walks_every_row_where_the_strides_do(first, second):
    for ops, flat in itertools.product(([first], [first, second]), (True, False)):
        g = geometry(ops, flat=flat)
        assert g.shape[2] - 1 <= max(o[0].ndim - 1 for o in ops)
        for t, (x, out, idx) in enumerate(ops):
            assert _row_offsets_by_geometry(g, t) == _row_offsets_by_axes(x, out, idx, flat)
        if len(ops) == 1:
            assert not g[1, 0, :-1].any()  # the missing second operand has zero rows


def test_contiguous_heads_and_batch_merge_into_one_axis():
    x = np.zeros((2, 4, 16, 8), np.float32)
    idx = np.arange(16, dtype=np.int64).reshape(1, 1, 16, 1)
    g = geometry([(x, x, idx)], flat=True)
    np.testing.assert_array_equal(g[0, 0, :-1], [8, 16])  # (B*H, T)
