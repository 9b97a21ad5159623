"""arrayrope's PyTorch operators: schemas, kernels, fake kernels, vmap rules and autograd,
registered with ``torch.library`` when this module is imported (``_torch_ops`` says when a call
reaches them).

``arrayrope::rotate`` and ``arrayrope::rotate_qk`` make new results, with the transpose rotation
as their autograd formula; ``rotate_nograd`` / ``rotate_qk_nograd`` are the same without an
autograd kernel, for calls autograd does not record; ``rotate_`` / ``rotate_qk_`` rotate in place
and ``rotate_out`` / ``rotate_qk_out`` into given tensors. Each has a fake kernel and the
new-result ones a vmap rule; torch.func differentiates through two autograd Functions that say
the same formulas. Inside an operator the kernels run on plain views of the tensors' memory, as
an eager call does.

A RoPE reaches an operator as an integer: its engine's key in this process (``_dispatch``), or
for the module-level functions a negative key of their configuration (:func:`shared_key`).
Positions reach it as a tensor, an int or a float, whichever the caller gave.
"""

import numpy as np
import torch

from . import _registry
from ._errors import RopeTypeError, RopeValueError
from ._kv_step import EPS

_NAMESPACE = "arrayrope"
_NUMPY_DTYPES = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
}


def resolve_lazy_bits(name, a, written):
    """A torch tensor whose negative or conjugate bit is set (a lazy negation, as from
    ``z.conj().imag``), resolved into a tensor that holds its values: DLPack exports the
    memory without the bit, which would rotate the values of the opposite sign. One that is
    written is refused: writing the memory would not write the tensor's values."""
    if not (a.is_neg() or a.is_conj()):
        return a
    if written:
        raise RopeValueError(
            f"{name} has torch's negative or conjugate bit set (a lazy negation, as from "
            "z.conj().imag), so its memory holds other values than it: pass "
            f"{name}.resolve_neg() (a copy), or leave out unset"
        )
    return a.resolve_conj().resolve_neg()


def _positions(pos, pos_int, pos_float):
    if pos is not None:
        return _native(pos, "pos")
    return pos_int if pos_int is not None else pos_float


def _native(t, name="x", written=False):
    """A plain view of ``t``'s memory for the kernels: NumPy on the CPU, the tensor itself
    (adopted through DLPack on torch's stream) on a GPU. A lazy negation is resolved first
    (refused where ``t`` is written). Each test is one call into torch: a compiled decode
    step pays for this on every operand."""
    if t.requires_grad:
        t = t.detach()
    if t.is_neg() or t.is_conj():
        t = resolve_lazy_bits(name, t, written)
    if not t.is_cpu:
        return t
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:  # a cache of rotate_into_cache
        import ml_dtypes

        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def _run(key, xs, pos, pos_int, pos_float, inverse, outs, backend, seq_len, targets=None):
    """The kernels of engine ``key`` on plain views of ``xs``, into ``outs`` (which may be
    ``xs`` themselves), or into ``targets``, the plain views of new results (see
    :func:`_fresh`)."""
    engine = _engine(key, xs[0].shape[-1])
    p = _positions(pos, pos_int, pos_float)
    if len(xs) == 1:
        x, out = xs[0], outs[0]
        native = _native(x, "x", out is x)
        if targets is not None:
            target = targets[0]
        else:
            target = native if out is x else _native(out, "out", True)
        engine.rotate(native, p, inverse, target, backend, seq_len)  # a decode step's way
        return
    natives = tuple(_native(x, name, any(x is o for o in outs)) for x, name in zip(xs, "qk"))
    native_outs = targets or tuple(
        n if o is x else _native(o, "out", True) for o, x, n in zip(outs, xs, natives)
    )
    engine.run(natives, p, inverse, native_outs, backend, seq_len)


def _check(key, xs):
    """The checks a fake kernel can make: what the result's shape and dtype depend on (and,
    for a module-level call of a known head size, that its RoPE can be made)."""
    head_dim = xs[0].shape[-1]
    if key >= 0 or type(head_dim) is int:
        head_dim = _engine(key, head_dim).spec.head_dim
    for name, x in zip(("x",) if len(xs) == 1 else ("q", "k"), xs):
        if x.ndim == 0 or x.shape[-1] != head_dim:
            raise RopeValueError(
                f"{name}.shape[-1] must equal head_dim ({head_dim}), got "
                f"{x.shape[-1] if x.ndim else 'a 0-d tensor'}"
            )
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise RopeTypeError(
                f"{name} must be float16, bfloat16, float32 or float64, got dtype {x.dtype}"
            )


def refuse_negative(named):
    """Under torch.compile (not torch.export), refuse a tensor among ``named`` ({name: tensor or
    anything else}) with torch's negative bit, which torch.compile drops from the tensors a
    compiled function reads (pytorch/pytorch#145093, torch's own t * 2 too): the result would
    have the opposite sign. Checked in a graph node (see :func:`negative_node`), which Dynamo
    runs on fake tensors that keep the bit (an operator's fake kernel gets them resolved)."""
    if not torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return
    for name, t in named.items():
        if isinstance(t, torch.Tensor) and t.is_neg():
            raise RopeValueError(
                f"{name} has torch's negative bit (a lazy negation, as z.conj().imag makes), "
                "which torch.compile drops from the tensors a compiled function reads "
                f"(pytorch/pytorch#145093): the result would have the opposite sign. Pass "
                f"{name}.resolve_neg()"
            )


@torch.compiler.allow_in_graph
def negative_node(names, tensors):
    """A graph node that refuses, where Dynamo runs it on fake tensors (which keep torch's
    negative bit: see refuse_negative), any of ``tensors`` with the bit; its result (empty)
    is unused. For the calls that reach an operator with no node of their own."""
    refuse_negative(dict(zip(names, tensors)))
    return tensors[0].new_empty(0)


def _check_step(q):
    """What a fake rotate_into_cache can check: the result's shape and dtype."""
    if q.ndim != 3:
        raise RopeValueError(f"q must have shape (N, Hq, head_dim), got {tuple(q.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise RopeTypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")


def _step(q, k, v, pos, pos_int, pos_float, k_cache, v_cache, slots, out, tail):
    """RoPE.rotate_into_cache of the RoPE of key ``tail[0]`` on plain views of the tensors,
    ``out`` the view q's result is written to."""
    key, layout, q_norm, k_norm, norm_eps, k_scale, v_scale, seq_len = tail
    rope = _registry.engine_of(key).owner
    rope.rotate_into_cache(
        _native(q, "q"), _native(k, "k"), _native(v, "v"), _positions(pos, pos_int, pos_float),
        _native(k_cache, "k_cache", True), _native(v_cache, "v_cache", True),
        _native(slots, "slots"), out=out, cache_layout=layout,
        q_norm=None if q_norm is None else _native(q_norm, "q_norm"),
        k_norm=None if k_norm is None else _native(k_norm, "k_norm"),
        norm_eps=EPS if norm_eps is None or norm_eps == EPS else norm_eps, k_scale=k_scale,
        v_scale=v_scale,
        seq_len=seq_len,
    )  # fmt: skip


def _new(x):
    """A new contiguous tensor like ``x`` (see :func:`_fresh`)."""
    if x.device.type != "cpu" or isinstance(x, torch._subclasses.FakeTensor) or x.is_meta:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _fresh(x)[0]


def _fresh(x):
    """(a new contiguous tensor like the real tensor ``x``, the plain view of it the kernels
    write). On the CPU its memory comes from NumPy, which asks the kernel for huge pages for
    large arrays: a fresh torch allocation of a prefill's size costs more in page faults
    than the rotation."""
    if not x.is_cpu:
        new = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return new, new
    if x.dtype == torch.bfloat16:
        import ml_dtypes

        bits = np.empty(x.shape, np.int16)
        return torch.from_numpy(bits).view(torch.bfloat16), bits.view(ml_dtypes.bfloat16)
    memory = np.empty(x.shape, _NUMPY_DTYPES[x.dtype])
    return torch.from_numpy(memory), memory


# The arguments every operator ends with: positions (one of the three), the engine's key,
# inverse, backend and seq_len.
_TAIL = "Tensor? pos, SymInt? pos_int, float? pos_float, int key, bool inverse, str backend, " \
    "SymInt? seq_len"  # fmt: skip
# rotate_into_cache's arguments after q, k and v: positions, the caches, slots, the engine's key
# and the step's options
_STEP_OPTIONS = "int key, str cache_layout, Tensor? q_norm, Tensor? k_norm, float? norm_eps, " \
    "float? k_scale, float? v_scale, SymInt? seq_len"  # fmt: skip
_STEP_HEAD = "Tensor? pos, SymInt? pos_int, float? pos_float, Tensor(a!) k_cache, " \
    "Tensor(b!) v_cache, Tensor slots"  # fmt: skip
_STEP = f"{_STEP_HEAD}, {_STEP_OPTIONS}"
_STEP_OUT = f"{_STEP_HEAD}, Tensor(c!) out, {_STEP_OPTIONS}"
_SCHEMAS = {
    "rotate": f"rotate(Tensor x, {_TAIL}) -> Tensor",
    "rotate_": f"rotate_(Tensor(a!) x, {_TAIL}) -> ()",
    "rotate_out": f"rotate_out(Tensor x, Tensor(a!) out, {_TAIL}) -> ()",
    "rotate_qk": f"rotate_qk(Tensor q, Tensor k, {_TAIL}) -> (Tensor, Tensor)",
    "rotate_qk_": f"rotate_qk_(Tensor(a!) q, Tensor(b!) k, {_TAIL}) -> ()",
    "rotate_qk_out": f"rotate_qk_out(Tensor q, Tensor k, Tensor(a!) q_out, Tensor(b!) k_out, "
    f"{_TAIL}) -> ()",
    # RoPE.rotate_into_cache: the caches (and out) written, the rotated q new or in out
    "rotate_into_cache": f"rotate_into_cache(Tensor q, Tensor k, Tensor v, {_STEP}) -> Tensor",
    "rotate_into_cache_out": f"rotate_into_cache_out(Tensor q, Tensor k, Tensor v, "
    f"{_STEP_OUT}) -> ()",
    # rotate and rotate_qk without an autograd kernel, for calls autograd does not record: the
    # registered autograd kernel is Python, and a decode step would pay it on every call.
    "rotate_nograd": f"rotate_nograd(Tensor x, {_TAIL}) -> Tensor",
    "rotate_qk_nograd": f"rotate_qk_nograd(Tensor q, Tensor k, {_TAIL}) -> (Tensor, Tensor)",
}


def _define():
    """The operators, defined on a ``torch.library.Library`` with kernels for the CPU and CUDA
    dispatch keys (``torch.library.custom_op`` wraps each call in more Python, which a compiled
    decode step would pay)."""
    lib = torch.library.Library(_NAMESPACE, "DEF")
    for schema in _SCHEMAS.values():
        lib.define(schema)

    def rotate(x, pos, pos_int, pos_float, key, inverse, backend, seq_len):
        out, target = _fresh(x)
        _run(key, (x,), pos, pos_int, pos_float, inverse, (out,), backend, seq_len, (target,))
        return out

    def rotate_(x, pos, pos_int, pos_float, key, inverse, backend, seq_len):
        _run(key, (x,), pos, pos_int, pos_float, inverse, (x,), backend, seq_len)

    def rotate_out(x, out, pos, pos_int, pos_float, key, inverse, backend, seq_len):
        _run(key, (x,), pos, pos_int, pos_float, inverse, (out,), backend, seq_len)

    def rotate_qk(q, k, pos, pos_int, pos_float, key, inverse, backend, seq_len):
        (q_out, q_target), (k_out, k_target) = _fresh(q), _fresh(k)
        outs, targets = (q_out, k_out), (q_target, k_target)
        _run(key, (q, k), pos, pos_int, pos_float, inverse, outs, backend, seq_len, targets)
        return q_out, k_out

    def rotate_qk_(q, k, pos, pos_int, pos_float, key, inverse, backend, seq_len):
        _run(key, (q, k), pos, pos_int, pos_float, inverse, (q, k), backend, seq_len)

    def rotate_qk_out(q, k, q_out, k_out, pos, pos_int, pos_float, key, inverse, backend,
                      seq_len):  # fmt: skip
        _run(key, (q, k), pos, pos_int, pos_float, inverse, (q_out, k_out), backend, seq_len)

    def rotate_into_cache(q, k, v, pos, pos_int, pos_float, k_cache, v_cache, slots, *tail):
        out, target = _fresh(q)
        _step(q, k, v, pos, pos_int, pos_float, k_cache, v_cache, slots, target, tail)
        return out

    def rotate_into_cache_out(q, k, v, pos, pos_int, pos_float, k_cache, v_cache, slots, out,
                              *tail):  # fmt: skip
        _step(q, k, v, pos, pos_int, pos_float, k_cache, v_cache, slots, _native(out, "out"),
              tail)  # fmt: skip

    kernels = {
        "rotate_into_cache": rotate_into_cache,
        "rotate_into_cache_out": rotate_into_cache_out,
        "rotate": rotate,
        "rotate_": rotate_,
        "rotate_out": rotate_out,
        "rotate_qk": rotate_qk,
        "rotate_qk_": rotate_qk_,
        "rotate_qk_out": rotate_qk_out,
        "rotate_nograd": rotate,
        "rotate_qk_nograd": rotate_qk,
    }
    for name, kernel in kernels.items():
        lib.impl(name, kernel, "CPU")
        lib.impl(name, kernel, "CUDA")

    # Fake kernels: the checks that shapes and dtypes allow, and the results' metadata.
    def fake_rotate(x, pos, pos_int, pos_float, key, inverse, backend, seq_len):
        _check(key, (x,))
        return _new(x)

    def fake_rotate_qk(q, k, pos, pos_int, pos_float, key, inverse, backend, seq_len):
        _check(key, (q, k))
        return _new(q), _new(k)

    def fake_rotate_(x, *tail):
        _check(tail[-4], (x,))

    def fake_rotate_qk_(q, k, *tail):
        _check(tail[-4], (q, k))

    def fake_rotate_out(x, out, *tail):
        _check(tail[-4], (x,))

    def fake_rotate_qk_out(q, k, q_out, k_out, *tail):
        _check(tail[-4], (q, k))

    def fake_rotate_into_cache(q, *rest):
        _check_step(q)
        return _new(q)

    def fake_rotate_into_cache_out(q, *rest):
        _check_step(q)

    fakes = {
        "rotate_into_cache": fake_rotate_into_cache,
        "rotate_into_cache_out": fake_rotate_into_cache_out,
        "rotate": fake_rotate,
        "rotate_": fake_rotate_,
        "rotate_out": fake_rotate_out,
        "rotate_qk": fake_rotate_qk,
        "rotate_qk_": fake_rotate_qk_,
        "rotate_qk_out": fake_rotate_qk_out,
        "rotate_nograd": fake_rotate,
        "rotate_qk_nograd": fake_rotate_qk,
    }
    for name, fake in fakes.items():
        torch.library.register_fake(f"{_NAMESPACE}::{name}", fake, lib=lib)

    # vmap: the batch axis goes first on every operand; batched positions get axes of size 1
    # for the axes of x they lack, so that they still line up with x's leading shape.
    def batched(info, x, x_dim, pos, pos_dim, pos_int, pos_float, n_axes):
        x = x.movedim(x_dim, 0) if x_dim is not None else x.expand(info.batch_size, *x.shape)
        if pos_dim is not None:
            pos = pos.movedim(pos_dim, 0)
            per_example = pos.ndim - 1 - (n_axes > 1)
            missing = (x.ndim - 2) - per_example
            if missing > 0:
                pos = pos.reshape(pos.shape[:1] + (1,) * missing + pos.shape[1:])
        elif pos is None and pos_int is None and pos_float is None and x.ndim == 2:
            pos_int = 0  # None is position 0 for a 1-D x: the batch axis is not a time axis
        return x, pos, pos_int

    ops = torch.ops.arrayrope

    def rotate_vmap(info, in_dims, x, pos, pos_int, pos_float, key, inverse, backend, seq_len):
        n_axes = _engine(key, x.shape[-1]).spec.n_axes if key >= 0 else 1
        x, pos, pos_int = batched(info, x, in_dims[0], pos, in_dims[1], pos_int, pos_float,
                                  n_axes)  # fmt: skip
        return ops.rotate.default(x, pos, pos_int, pos_float, key, inverse, backend, seq_len), 0

    def rotate_qk_vmap(info, in_dims, q, k, pos, pos_int, pos_float, key, inverse, backend,
                       seq_len):  # fmt: skip
        n_axes = _engine(key, q.shape[-1]).spec.n_axes if key >= 0 else 1
        q_dim, k_dim, pos_dim = in_dims[:3]
        q, pos_q, int_q = batched(info, q, q_dim, pos, pos_dim, pos_int, pos_float, n_axes)
        k, pos_k, int_k = batched(info, k, k_dim, pos, pos_dim, pos_int, pos_float, n_axes)
        rest = (pos_float, key, inverse, backend, seq_len)
        if int_q == int_k and getattr(pos_q, "shape", None) == getattr(pos_k, "shape", None):
            return ops.rotate_qk.default(q, k, pos_q, int_q, *rest), (0, 0)
        q_rot = ops.rotate.default(q, pos_q, int_q, *rest)
        return (q_rot, ops.rotate.default(k, pos_k, int_k, *rest)), (0, 0)

    for suffix in ("", "_nograd"):
        torch.library.register_vmap(f"{_NAMESPACE}::rotate{suffix}", rotate_vmap, lib=lib)
        torch.library.register_vmap(f"{_NAMESPACE}::rotate_qk{suffix}", rotate_qk_vmap, lib=lib)
    return lib, ops


# Autograd: y = s R(m) x is linear in x, with transpose s R(-m): the backward of a rotation is
# the same rotation with inverse flipped (scaling rules included), and the tangent of a rotation
# is the rotation of the tangent. Positions get no gradient. rotate and rotate_qk carry this
# as their registered autograd (which autograd and the compilers use); torch.func's grad,
# vjp, jacrev and jvp and forward-mode AD differentiate through the Functions below, which say
# the same (vmap of them is generated from the operators' rules).
def _flipped(args):
    pos, pos_int, pos_float, key, inverse, backend, seq_len = args
    return pos, pos_int, pos_float, key, not inverse, backend, seq_len


class _Rotate(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, *tail):
        return torch.ops.arrayrope.rotate.default(x, *tail)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx, grad):
        return (_Rotate.apply(grad, *_flipped(ctx.args)),) + (None,) * 7

    @staticmethod
    def jvp(ctx, tangent, *_):
        return _Rotate.apply(tangent, *ctx.args)


class _RotateQK(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, *tail):
        return torch.ops.arrayrope.rotate_qk.default(q, k, *tail)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[2:]

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        flipped = _flipped(ctx.args)
        back = [None if g is None else _Rotate.apply(g, *flipped) for g in (grad_q, grad_k)]
        return tuple(back) + (None,) * 7

    @staticmethod
    def jvp(ctx, tangent_q, tangent_k, *_):
        return _Rotate.apply(tangent_q, *ctx.args), _Rotate.apply(tangent_k, *ctx.args)


def _register_autograd(lib):
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[-7])  # pos (the tensor, or None)
        ctx.rest = inputs[-6:]

    def rotate_backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        flipped = _flipped((pos,) + tuple(ctx.rest))
        return (torch.ops.arrayrope.rotate.default(grad, *flipped),) + (None,) * 7

    def rotate_qk_backward(ctx, grad_q, grad_k):
        (pos,) = ctx.saved_tensors
        flipped = _flipped((pos,) + tuple(ctx.rest))
        back = [
            None if g is None else torch.ops.arrayrope.rotate.default(g, *flipped)
            for g in (grad_q, grad_k)
        ]
        return tuple(back) + (None,) * 7

    for name, backward in (("rotate", rotate_backward), ("rotate_qk", rotate_qk_backward)):
        torch.library.register_autograd(
            f"{_NAMESPACE}::{name}", backward, setup_context=setup_context, lib=lib
        )


# Registered on import, which runs natively even when a trace is what imports this module.
_lib, ops = _define()
_register_autograd(_lib)


def shared_key(base, style, rotary_dim, scaling):
    """The key of a module-level call's configuration (``_registry``): negative, found when
    the operator runs at x's head size, which can be symbolic while torch traces. Numbers
    travel as their exact float hex strings: Dynamo may hold an int or float argument as a
    symbol, which a function run at compile time cannot take, and a string of it is a
    constant."""
    return _shared_key(_frozen(base), style, _frozen(rotary_dim), scaling)


_NUMBER = "arrayrope number"


def _frozen(value):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _NUMBER, isinstance(value, int), float(value).hex()
    return value


def _thawed(value):
    if isinstance(value, tuple) and len(value) == 3 and value[0] == _NUMBER:
        number = float.fromhex(value[2])
        return int(number) if value[1] else number
    return value


@torch._dynamo.assume_constant_result
def _shared_key(base, style, rotary_dim, scaling):
    """shared_key, checked and stored outside any trace (Dynamo runs this once per
    configuration, at compile time, and keeps the result)."""
    return _registry.config_key(_thawed(base), style, _thawed(rotary_dim), scaling)


_engine = _registry.engine_for
