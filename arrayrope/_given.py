"""Rotation by cos and sin tables the caller gives (``apply_cos_sin``, in _api): the kernels of
every other call, reading the caller's rows instead of arrayrope's, on NumPy and CuPy arrays.

A table of shape C + (w,) holds one row per entry of C, which broadcasts against x's leading
shape as positions do; each x row reads its entry's row, so the kernels see an int64 index per
entry (0..R-1) where they would see a position. w is the rotated width (transformers' layout:
each pair's value at both of its features) or half of it (one value per pair, as flash-attn,
vLLM and FlashInfer keep them).
"""

import numpy as np

from . import _arrays, _dispatch, _plan, _positions
from ._arrays import CUPY, NUMPY
from ._cache import Bounded
from ._errors import RopeTypeError, RopeValueError
from ._spec import Spec, check_inverse, frozen, int_arg, segments, style_arg, with_head_axis

# Specs by (head_dim, rotary_dim, style), and plans by call layout: a bounded cache each.
_specs = Bounded(64)
_plans = Bounded(256)


class _Caller:
    """What a plan needs of an engine: the spec (no frequency sets: tables come per call)."""

    __slots__ = ("spec",)

    def __init__(self, spec):
        self.spec = spec


def _spec(head_dim, rotary_dim, style):
    key = (head_dim, rotary_dim, style)
    found = _specs.get(key)
    if found is None:
        pair_axis = np.zeros(rotary_dim // 2, np.int64)
        found = _specs.put(
            key,
            Spec(
                head_dim=head_dim,
                rotary_dim=rotary_dim,
                style=style,
                half_style=style == "half",
                n_axes=1,
                pair_axis=frozen(pair_axis),
                segments=frozen(segments(pair_axis)),
                dynamic=False,
            ),
        )
    return found


class GivenPlan(_plan.GeneralPlan):
    """The general plan of a call's layout, run on the caller's table rows."""

    def run_given(self, xs, cos, sin, idx, inverse, outs):
        if self.family == CUPY:
            with xs[0].device:
                return self._run_given(xs, cos, sin, idx, inverse, outs)
        return self._run_given(xs, cos, sin, idx, inverse, outs)

    def _run_given(self, xs, cos, sin, idx, inverse, outs):
        if self.device is not None and self.device.begin(self.xp, self._device()):
            raise RopeValueError(
                "apply_cos_sin cannot be captured in a CUDA graph: its tables are the call's"
            )
        results, in_place = self._results(xs, outs)
        operands, write_back = [], []
        for x, out, same in zip(xs, results, in_place):
            if x.size:
                operands.append(self.operand(x, out, idx, same, write_back))
        if operands:
            self.launch(self.spec, operands, cos, sin, inverse)
        for temp, out in write_back:
            _arrays.assign(out, temp)
        return results


def _table(name, t, x, rotary_dim, style):
    """The caller's table as the kernels read it: (R, rotary_dim // 2) in the compute dtype of
    x, one row per entry of its leading shape."""
    family = _arrays.family(x)
    if _arrays.family(t) != family:
        raise RopeTypeError(
            f"{name} must be an array of x's kind ({_arrays.describe(x)}), got "
            f"{_arrays.describe(t)}"
        )
    if family == CUPY and t.device != x.device:
        raise RopeValueError(f"{name} is on device {t.device.id}, x on device {x.device.id}")
    if t.ndim == 0 or _arrays.compute_dtype(t.dtype) is None:
        got = "a 0-d array" if t.ndim == 0 else f"dtype {t.dtype}"
        raise RopeTypeError(f"{name} must be float16, bfloat16, float32 or float64, got {got}")
    pairs = rotary_dim // 2
    if t.shape[-1] == rotary_dim:  # each pair's value at both of its features
        first, second = (
            (t[..., :pairs], t[..., pairs:]) if style == "half" else (t[..., 0::2], t[..., 1::2])
        )
        if family == NUMPY and not np.array_equal(first, second, equal_nan=True):
            halves = (
                "[..., :r/2] and [..., r/2:]" if style == "half" else "[..., 0::2] and [..., 1::2]"
            )
            raise RopeValueError(
                f"{name} of width rotary_dim ({rotary_dim}) must hold each pair's value at both "
                f"of its features ({name}{halves} equal, for style={style!r}); give one value "
                f"per pair as width {pairs}, or the style the table was made for"
            )
        t = first
    xp = _arrays.namespace(family)
    dtype = _arrays.compute_dtype(x.dtype)
    return xp.ascontiguousarray(t.reshape(-1, pairs), dtype=dtype)


class _Prepared:
    """A call whose layout has been checked and planned: what each call of that layout still
    does (the tables' rows, the overlap of outs with them, the launch)."""

    __slots__ = ("plan", "idx", "rotary_dim", "style")

    def __init__(self, plan, idx, rotary_dim, style):
        self.plan, self.idx, self.rotary_dim, self.style = plan, idx, rotary_dim, style

    def run(self, xs, cos, sin, inverse, outs):
        cos = _table("cos", cos, xs[0], self.rotary_dim, self.style)
        sin = _table("sin", sin, xs[0], self.rotary_dim, self.style)
        if outs is not None:
            # a table the caller's memory still holds, which an out would overwrite as it is read
            family = self.plan.family
            cos, sin = (
                t.copy()
                if any(o.size and _arrays.overlap_kind(o, t, family) != "none" for o in outs)
                else t
                for t in (cos, sin)
            )
        results = self.plan.run_given(xs, cos, sin, self.idx, inverse, outs)
        return tuple(outs) if outs is not None else results


# Prepared calls of NumPy arrays by the layout of every argument: a decode step's way.
_prepared = Bounded(256)
_NDARRAY = np.ndarray


def _numpy_key(xs, cos, sin, outs, style, rotary_dim, head_axis, backend):
    if type(cos) is not _NDARRAY or type(sin) is not _NDARRAY:
        return None
    # the types too: 8.0 and True hash as 8 and 1, and must reach the checks below
    key = [style, rotary_dim, type(rotary_dim), head_axis, type(head_axis), backend, cos.dtype,
           cos.shape, cos.strides, sin.dtype, sin.shape, sin.strides]  # fmt: skip
    for x in xs:
        if type(x) is not _NDARRAY:
            return None
        key += (x.dtype, x.shape, x.strides, x.flags.num)
    if outs is not None:
        for out in outs:
            if type(out) is not _NDARRAY:
                return None
            same = [j for j, x in enumerate(xs) if out is x]
            key += (same[0],) if same else (out.dtype, out.shape, out.strides, out.flags.num)
    return tuple(key)


def check_width(cos, d, rotary_dim, name):
    """Refuse tables narrower than x without a rotary_dim: transformers' layout of a partial
    rotation (width rotary_dim) and one value per pair of a whole one (width d / 2) look
    alike."""
    (width,) = getattr(cos, "shape", (d,))[-1:] or (d,)
    if rotary_dim is None and width != d:
        fits = []
        if 2 * width <= d:
            whole = "over the whole head" if 2 * width == d else "of a partial rotation"
            fits.append(f"{2 * width} for one value per pair {whole}")
        if width % 2 == 0 and 0 < width < d:
            fits.append(f"{width} for transformers' layout of a partial rotation")
        if not fits:
            raise RopeValueError(
                f"cos and sin of width {width} fit no rotation of {name} of {d} features: a "
                "table holds rotary_dim / 2 values per row (one per pair) or rotary_dim, with "
                f"rotary_dim even and at most {d}"
            )
        raise RopeValueError(
            f"cos and sin of width {width} for {name} of {d} features need rotary_dim: "
            + ", or ".join(fits)
        )


def run(xs, cos, sin, style, rotary_dim, inverse, outs, head_axis, backend, names):
    """The rotated ``xs`` (NumPy or CuPy: one operand, or q and k) by the native tables ``cos``
    and ``sin``, into ``outs`` where given; see ``arrayrope.apply_cos_sin``."""
    if inverse is not False and inverse is not True:
        inverse = check_inverse(inverse)
    key = _numpy_key(xs, cos, sin, outs, style, rotary_dim, head_axis, backend)
    if key is not None:
        try:
            prepared = _prepared.get(key)
        except TypeError:  # an unhashable argument: the checks below name it
            prepared = key = None
        if prepared is not None:
            return prepared.run(xs, cos, sin, inverse, outs)
    style = style_arg(style)
    x = xs[0]
    _arrays.check_float(names[0], x, x.shape[-1] if x.ndim else 0)
    d = x.shape[-1]
    if rotary_dim is None and d % 2:
        raise RopeValueError(f"{names[0]}.shape[-1] must be even, got {d}")
    check_width(cos, d, rotary_dim, names[0])
    rotary_dim = d if rotary_dim is None else int_arg("rotary_dim", rotary_dim, minimum=2)
    if rotary_dim % 2 or rotary_dim > d:
        raise RopeValueError(f"rotary_dim must be even and <= head_dim ({d}), got {rotary_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        if _arrays.family(t) != _arrays.family(x):
            raise RopeTypeError(
                f"{name} must be an array of x's kind ({_arrays.describe(x)}), got "
                f"{_arrays.describe(t)}"
            )
    if cos.shape != sin.shape:
        raise RopeValueError(f"cos and sin must have one shape, got {cos.shape} and {sin.shape}")
    if cos.ndim == 0 or cos.shape[-1] not in (rotary_dim, rotary_dim // 2):
        raise RopeValueError(
            f"cos and sin must end in rotary_dim ({rotary_dim}: each pair's value at both of its "
            f"features) or rotary_dim / 2 ({rotary_dim // 2}: one value per pair), got shape "
            f"{cos.shape}"
        )
    lead = tuple(cos.shape[:-1])
    if head_axis is not None:
        lead = tuple(with_head_axis(np.empty(lead, np.int8), head_axis, x, 1, "cos").shape)
    probe = np.empty(lead, np.int64)  # the layout of the kernels' row indices
    leads = [a.shape[:-1] for a in xs]
    if not all(_positions.broadcasts(lead, shape) for shape in leads):
        raise RopeValueError(
            f"cos and sin of shape {cos.shape} have the leading shape {lead}, which does not "
            f"broadcast to the leading shape {' and '.join(map(str, leads))}"
        )
    _positions.with_axes(probe, 1, leads, "cos")
    spec = _spec(d, rotary_dim, style)
    kind = _positions.ARRAY
    plan_key = (spec,) + _dispatch.plan_key(xs, kind, probe, outs, backend)
    plan = _plans.get(plan_key)
    if plan is None:
        engine = _Caller(spec)
        family, backend = _plan.checked(engine, xs, outs, kind, probe, backend)
        plan = _plans.put(plan_key, GivenPlan(engine, xs, outs, kind, backend, family))
    rows = int(np.prod(cos.shape[:-1], dtype=np.int64))
    idx = plan.xp.arange(rows, dtype=np.int64).reshape(lead + (1,))
    prepared = _Prepared(plan, idx, rotary_dim, style)
    if key is not None:
        _prepared.put(key, prepared)
    return prepared.run(xs, cos, sin, inverse, outs)
