"""A small rotation written as torch operations, for torch.compile to fuse into the code around it.

Inside a compiled function one of arrayrope's operators is an opaque call from the code that
Inductor generates, and its Python dispatch costs more than the whole rotation of a decode step.
So where torch.compile (not torch.export, whose programs keep the operator) traces a call of at
most :data:`SMALL` elements on the CPU, with integer positions, on a one-axis RoPE with
arrayrope's own tables and backend "auto", the call is written here as torch operations that
compute the kernels' numbers: each position's row from the level tables by angle addition in
float64, as ``backends.cpu._angles`` makes the cache's rows, rounded once to the table dtype
(float64 for float64 x, else float32), and each pair rotated in that dtype, as the kernels do.
Larger calls keep the operator, whose kernels outrun a generated loop there.

A position in a tensor outside [0, 2**31) cannot raise arrayrope's error from generated code:
torch's asynchronous assertion raises a RuntimeError that names the range when the compiled
code runs. An int position outside it goes to the operator, which raises arrayrope's error.
"""

import collections

import torch

from . import _registry
from .backends.cpu import _angles

# Elements of x (q and k together) up to which a compiled call is lowered: a decode batch.
SMALL = 1 << 14

_Lowering = collections.namedtuple(
    "_Lowering", "levels inv_freq scale half_style rotary_dim head_dim"
)
_MESSAGE = "arrayrope: pos must hold integer positions in [0, 2**31)"


@torch._dynamo.assume_constant_result
def _plan(key, head_dim, backend, seq_len):
    """The constants a lowered call of engine ``key`` at ``head_dim`` (as ``float.hex``) reads,
    or None where the call keeps the operator. Dynamo runs this once per configuration, at
    compile time, and the compiled code holds what it returns."""
    if backend != "auto" or seq_len is not None:
        return None
    head_dim = int(float.fromhex(head_dim))
    try:
        engine = _registry.engine_for(key, head_dim)
    except Exception:  # noqa: BLE001 - the operator raises the error itself
        return None
    spec = engine.spec
    tables = engine.freq_set(None).tables
    if spec.n_axes != 1 or spec.dynamic or not tables.filled or spec.head_dim != head_dim:
        return None
    _, inv_freq, levels = tables.level_arrays()
    return _Lowering(
        torch.tensor(levels),  # copies: the compiled code may outlive the RoPE
        torch.tensor(inv_freq),
        tables.scale,
        spec.half_style,
        spec.rotary_dim,
        spec.head_dim,
    )


def rotated(key, xs, pos, pos_int, pos_float, inverse, backend, seq_len):
    """The new rotated tensors of ``xs`` (one, or q and k) as torch operations, or None where
    the call keeps the operator."""
    # Dynamo guards every global and builtin this reads on each call of the compiled code:
    # these tests are written with as few as they can be.
    x = xs[0]
    if pos_float is not None or x.device.type != "cpu" or x.ndim == 0:
        return None
    head_dim = x.shape[-1]
    size = x.numel()
    if len(xs) == 2:
        k = xs[1]
        if k.ndim == 0 or k.shape[-1] != head_dim or k.dtype != x.dtype:
            return None
        size += k.numel()
    if size > SMALL or not x.is_floating_point() or x.element_size() == 1:
        return None  # float8 x: the operator refuses it
    table_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    # a head size Dynamo holds as a symbol reaches _plan as a constant string (a model's head
    # size does not change)
    plan = _plan(key, float(head_dim).hex(), backend, seq_len)
    if plan is None:
        return None
    if pos is not None:
        if pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool:
            return None
    elif pos_int is not None:
        if not 0 <= pos_int < _angles.LIMIT:  # Dynamo guards on this: the operator says why
            return None
        pos = torch.full((), pos_int, dtype=torch.int64)
    results = []
    for a in xs:
        p = pos
        if p is None:  # 0..T-1 along axis -2 (position 0 for a 1-D x)
            p = torch.arange(a.shape[-2]) if a.ndim > 1 else torch.zeros((), dtype=torch.int64)
        # positions that broadcast to a's leading shape, with all its axes or one at most:
        # (B, T) against (B, H, T) is the operator's to refuse (``_positions.with_axes``)
        if 1 < p.ndim < a.ndim - 1 or a.numel() == 0:
            return None
        try:
            if torch.broadcast_shapes(p.shape, a.shape[:-1]) != a.shape[:-1]:
                return None
        except RuntimeError:
            return None
        cos, sin = _rows(plan, p, table_dtype)
        results.append(_rotate(plan, a, cos, sin, inverse))
    return tuple(results)


def _rows(plan, pos, dtype):
    """cos and sin of shape pos.shape + (pairs,) in ``dtype``: ``_angles._row``'s formula."""
    shape = pos.shape
    pos = pos.to(torch.int64).reshape(-1)  # a 0-d index would be read as a Python int
    torch._assert_async(((pos >= 0) & (pos < _angles.LIMIT)).all(), _MESSAGE)
    digit, bits = _angles.DIGIT, _angles.DIGIT_BITS
    h = pos >> (2 * bits)
    k = (pos >> bits) & (digit - 1)
    low = pos & (digit - 1)
    levels, theta = plan.levels, plan.inv_freq
    c1, s1 = levels[0, h + _angles.TOP_ROW], levels[1, h + _angles.TOP_ROW]
    c2, s2 = levels[0, k + _angles.MID_ROW], levels[1, k + _angles.MID_ROW]
    c3, s3 = levels[0, low], levels[1, low]
    # h = 0 reads cos 1 and sin 0 from the top level: the same products as the kernels' one
    # angle addition there
    c12 = c1 * c2 - s1 * s2
    s12 = s1 * c2 + c1 * s2
    c = c12 * c3 - s12 * s3
    s = s12 * c3 + c12 * s3
    fm, fh, fk, fl = (v.to(torch.float64)[..., None] for v in (pos, h, k, low))
    delta = ((fm * theta - fh * (theta * (digit * digit))) - fk * (theta * digit)) - fl * theta
    if dtype == torch.float64:
        half = 0.5 * delta * delta
        c, s = c - (s * delta + c * half), s + (c * delta - s * half)
    else:
        c, s = c - s * delta, s + c * delta
    pairs = plan.rotary_dim // 2
    cos = (c * plan.scale).to(dtype).reshape(*shape, pairs)
    sin = (s * plan.scale).to(dtype).reshape(*shape, pairs)
    return cos, sin


def _rotate(plan, x, cos, sin, inverse):
    """``x`` rotated by the rows, in their dtype and rounded once to x's."""
    n = plan.rotary_dim
    rot = x[..., :n].to(cos.dtype)
    if plan.half_style:
        a, b = rot[..., : n // 2], rot[..., n // 2 :]
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
    if inverse:
        sin = -sin
    new_a, new_b = a * cos - b * sin, b * cos + a * sin
    if plan.half_style:
        result = torch.cat((new_a, new_b), dim=-1)
    else:
        result = torch.stack((new_a, new_b), dim=-1).flatten(-2)
    result = result.to(x.dtype)
    if n < plan.head_dim:
        result = torch.cat((result, x[..., n:]), dim=-1)
    return result
