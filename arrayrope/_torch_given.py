"""apply_cos_sin for the torch code that torch traces, transforms or differentiates: the operator
``arrayrope::apply_cos_sin`` (kernels, fake kernel, autograd) and a Function for torch.func.

y is bilinear in x and the tables: per pair, y_a = c x_a - s x_b and y_b = c x_b + s x_a (s
negated for inverse). Its gradient for x is the same rotation with inverse flipped; for the
tables, the sums over the rows that read each entry of c x and s x's terms. A table in
transformers' layout (each pair's value at both of its features) is differentiated as
transformers' formula reads it: each feature's own entry takes that feature's term.
"""

import torch

from . import _given
from ._errors import RopeTypeError, RopeValueError
from ._torch_library import _NAMESPACE, _native, _new, negative_node

_SCHEMA = (
    "apply_cos_sin(Tensor x, Tensor cos, Tensor sin, str style, int rotary_dim, bool inverse, "
    "int? head_axis, str backend) -> Tensor"
)


def _kernel(x, cos, sin, style, rotary_dim, inverse, head_axis, backend):
    out = _new(x)
    _given.run(
        (_native(x),), _native(cos, "cos"), _native(sin, "sin"), style, rotary_dim, inverse,
        (_native(out, "out", True),), head_axis, backend, ("x",),
    )  # fmt: skip
    return out


def _fake(x, cos, sin, style, rotary_dim, inverse, head_axis, backend):
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise RopeTypeError(
                f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}"
            )
    if cos.shape != sin.shape:
        raise RopeValueError(f"cos and sin must have one shape, got {cos.shape} and {sin.shape}")
    if cos.ndim == 0 or cos.shape[-1] not in (rotary_dim, rotary_dim // 2):
        raise RopeValueError(
            f"cos and sin must end in rotary_dim ({rotary_dim}) or rotary_dim / 2 "
            f"({rotary_dim // 2}), got shape {tuple(cos.shape)}"
        )
    return _new(x)


def _pairs(style, rotary_dim, device):
    h = rotary_dim // 2
    if style == "interleaved":
        return torch.arange(0, rotary_dim, 2, device=device), torch.arange(
            1, rotary_dim, 2, device=device
        )
    return torch.arange(h, device=device), torch.arange(h, rotary_dim, device=device)


def _placed(t, head_axis):
    """A table's leading shape as it lines up with x's (the head axis inserted)."""
    return t if head_axis is None else t.unsqueeze(head_axis)


def _table_grads(grad, x, cos, sin, style, rotary_dim, inverse, head_axis):
    """The gradients of cos and sin: each entry's terms summed over the rows that read it."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    a, b = _pairs(style, rotary_dim, x.device)
    xa, xb = x[..., a].to(compute), x[..., b].to(compute)
    ga, gb = grad[..., a].to(compute), grad[..., b].to(compute)
    sign = -1.0 if inverse else 1.0
    c_terms, s_terms = (ga * xa, gb * xb), (-ga * xb * sign, gb * xa * sign)
    if cos.shape[-1] == rotary_dim:  # each feature its own entry, as transformers reads it
        if style == "half":
            c_rows, s_rows = torch.cat(c_terms, -1), torch.cat(s_terms, -1)
        else:
            c_rows, s_rows = (torch.stack(t, -1).flatten(-2) for t in (c_terms, s_terms))
    else:
        c_rows, s_rows = c_terms[0] + c_terms[1], s_terms[0] + s_terms[1]
    placed = _placed(cos, head_axis).shape
    grads = []
    for rows, t in ((c_rows, cos), (s_rows, sin)):
        summed = rows.sum_to_size(placed)
        grads.append(summed.reshape(t.shape).to(t.dtype))
    return grads


def _tangent(x, t_x, cos, sin, t_cos, t_sin, args):
    """The tangent of y: the rotation of x's tangent, plus x turned by the tables' tangents
    (bilinear), the latter in torch operations (a table's tangent need not be a rotation's)."""
    style, rotary_dim, inverse, head_axis, backend = args
    out = None
    if t_x is not None:
        out = torch.ops.arrayrope.apply_cos_sin.default(t_x, cos, sin, *args)
    if t_cos is None and t_sin is None:
        return out
    a, b = _pairs(style, rotary_dim, x.device)
    h = rotary_dim // 2
    zeros = torch.zeros_like(cos if t_cos is None else t_cos)
    dc, ds = (zeros if t is None else t for t in (t_cos, t_sin))
    dc, ds = _placed(dc, head_axis), _placed(ds, head_axis)
    if cos.shape[-1] == rotary_dim:  # per feature: first and second members of each pair
        first, second = (
            (slice(0, h), slice(h, None))
            if style == "half"
            else (slice(0, None, 2), slice(1, None, 2))
        )
        ca, cb, sa, sb = dc[..., first], dc[..., second], ds[..., first], ds[..., second]
    else:
        ca = cb = dc
        sa = sb = ds
    sign = -1.0 if inverse else 1.0
    xa, xb = x[..., a], x[..., b]
    ya, yb = ca * xa - sign * sa * xb, cb * xb + sign * sb * xa
    # the pairs' members back in their places, out of place (vmap and forward AD need that)
    if style == "half":
        rotated = torch.cat([ya, yb], -1)
    else:
        rotated = torch.stack([ya, yb], -1).flatten(-2)
    turned = torch.cat([rotated, torch.zeros_like(x[..., rotary_dim:])], -1).to(x.dtype)
    return turned if out is None else out + turned


class ApplyCosSin(torch.autograd.Function):
    """The operator for torch.func (grad, vjp, jacrev, jvp) and forward-mode AD."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, cos, sin, *args):
        return torch.ops.arrayrope.apply_cos_sin.default(x, cos, sin, *args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, cos, sin = inputs[:3]
        ctx.save_for_backward(x, cos, sin)
        ctx.save_for_forward(x, cos, sin)
        ctx.args = inputs[3:]

    @staticmethod
    def backward(ctx, grad):
        x, cos, sin = ctx.saved_tensors
        return _backward(ctx.needs_input_grad, grad, x, cos, sin, ctx.args) + (None,) * 5

    @staticmethod
    def jvp(ctx, t_x, t_cos, t_sin, *_):
        x, cos, sin = ctx.saved_tensors
        return _tangent(x, t_x, cos, sin, t_cos, t_sin, ctx.args)


def _backward(needs, grad, x, cos, sin, args):
    style, rotary_dim, inverse, head_axis, backend = args
    grad_x = grad_cos = grad_sin = None
    if needs[0]:
        grad_x = ApplyCosSin.apply(grad, cos, sin, style, rotary_dim, not inverse, head_axis,
                                   backend)  # fmt: skip
    if needs[1] or needs[2]:
        grad_cos, grad_sin = _table_grads(grad, x, cos, sin, style, rotary_dim, inverse, head_axis)
    return grad_x, grad_cos if needs[1] else None, grad_sin if needs[2] else None


def _define():
    lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    lib.define(_SCHEMA)
    lib.impl("apply_cos_sin", _kernel, "CPU")
    lib.impl("apply_cos_sin", _kernel, "CUDA")
    torch.library.register_fake(f"{_NAMESPACE}::apply_cos_sin", _fake, lib=lib)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:3])
        ctx.args = inputs[3:]

    def backward(ctx, grad):
        x, cos, sin = ctx.saved_tensors
        return _backward(ctx.needs_input_grad, grad, x, cos, sin, ctx.args) + (None,) * 5

    torch.library.register_autograd(
        f"{_NAMESPACE}::apply_cos_sin", backward, setup_context=setup_context, lib=lib
    )
    torch.library.register_vmap(f"{_NAMESPACE}::apply_cos_sin", _vmap, lib=lib)
    return lib


def _vmap(info, in_dims, x, cos, sin, style, rotary_dim, inverse, head_axis, backend):
    """The batch axis first on x and on batched tables; every table's head axis placed and its
    leading shape padded to x's, so that it still lines up with x."""
    x_dim, cos_dim, sin_dim = in_dims[:3]
    x = x.movedim(x_dim, 0) if x_dim is not None else x.expand(info.batch_size, *x.shape)
    lead = x.ndim - 1  # the batch axis and x's own leading axes
    tables = []
    for t, dim in ((cos, cos_dim), (sin, sin_dim)):
        batched = dim is not None
        if batched:
            t = t.movedim(dim, 0)
        if head_axis is not None:
            t = t.unsqueeze(int(batched) + head_axis % lead)  # x's axis, as x was
        own = t.shape[1:-1] if batched else t.shape[:-1]
        pad = (1,) * (lead - 1 - len(own))
        shape = (t.shape[0] if batched else 1,) + pad + tuple(own) + t.shape[-1:]
        tables.append(t.reshape(shape))
    tables = torch.broadcast_tensors(*tables)  # cos and sin of one shape, batched or not
    args = (style, rotary_dim, inverse, None, backend)
    return torch.ops.arrayrope.apply_cos_sin.default(x, *tables, *args), 0


_lib = _define()


def apply_cos_sin(xs, cos, sin, style, rotary_dim, inverse, outs, head_axis, backend):
    """``apply_cos_sin``'s contract (see _api._apply) for torch tensors, through the operator.

    q and k are two calls of the operator."""
    for name, t in zip(("cos", "sin"), (cos, sin)):
        if not isinstance(t, torch.Tensor):
            raise RopeTypeError(f"{name} must be a torch tensor like x, got {type(t).__name__}")
        if t.device != xs[0].device:
            raise RopeValueError(f"{name} is on {t.device} and x on {xs[0].device}")
    if torch.compiler.is_dynamo_compiling():
        named = {"x" if len(xs) == 1 else "q": xs[0], "cos": cos, "sin": sin}
        if len(xs) == 2:
            named["k"] = xs[1]
        for i, out in enumerate(outs or ()):
            named["out" if len(xs) == 1 else f"out[{i}]"] = out
        named = {n: t for n, t in named.items() if isinstance(t, torch.Tensor)}
        negative_node(tuple(named), tuple(named.values()))
    rotary_dim = xs[0].shape[-1] if rotary_dim is None else rotary_dim
    args = (style, int(rotary_dim), bool(inverse), head_axis, backend)
    transformed = not torch.compiler.is_compiling() and (
        torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0
    )
    results = []
    for i, x in enumerate(xs):
        out = None if outs is None else outs[i]
        if out is not None and _shares(out, x) and torch.is_grad_enabled():
            x = x.clone()  # autograd keeps x for the tables' gradients: not the memory out gets
        if transformed:
            y = ApplyCosSin.apply(x, cos, sin, *args)
        else:
            y = torch.ops.arrayrope.apply_cos_sin.default(x, cos, sin, *args)
        if out is not None:
            out.copy_(y)
            y = out
        results.append(y)
    return tuple(results)


def _shares(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
