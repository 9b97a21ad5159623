"""arrayrope's rotation for the torch code that torch itself traces, through its operators.

torch.compile, torch.export, the torch.func transforms (grad, vjp, jacrev, jvp, vmap), autograd,
and fake or meta tensors all need an operator torch knows: a Python function that reads a
tensor's memory is a graph break to Dynamo, a crash to a fake tensor, and invisible to a
transform. So a call reaches arrayrope's registered operators (``_torch_library``) when torch
is tracing or transforming, when autograd records it, or when a tensor is fake, meta or one of
torch's subclasses (:func:`wanted`); a plain tensor outside all of that takes the path every
array takes, with no operator in between. Exported programs hold a RoPE's key, so they run in
the process that made them. Under torch.compile each call is one node of Dynamo's graph
(:func:`_rotate_node`); where AOTAutograd traces a small call, the rotation is written as torch
operations instead of an operator (``_torch_lowered``), which the compiler fuses into its code.

This module imports torch: it is imported only once a torch tensor has been seen.
"""

import operator

import numpy as np
import torch

from . import _torch_lowered
from ._errors import RopeTypeError, RopeValueError
from ._kv_layout import check_layout
from ._spec import check_inverse
from ._torch_library import (  # noqa: F401 - shared_key: _api
    _Rotate,
    _RotateQK,
    negative_node,
    ops,
    refuse_negative,
    shared_key,
)

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


_compiling = torch.compiler.is_compiling
_dynamo_tracing = torch.compiler.is_dynamo_compiling
_exporting = torch.compiler.is_exporting
_transforms = torch._C._are_functorch_transforms_active
_dispatch_modes = torch._C._len_torch_dispatch_stack
_jit_tracing = torch._C._get_tracing_state
_grad = torch.is_grad_enabled
_forward_ad = torch.autograd.forward_ad
_REFUSED_POSITIONS = (torch.bfloat16, torch.bool)  # read here, not as torch.*: see rotate


def wanted(x, pos, out, k=None):
    """Whether a call on torch tensors (x, and k for rotate_qk; positions and outs, any of
    them None or not a tensor) must go through the operators: torch is compiling, exporting,
    transforming or tracing it, autograd records it, or one of the tensors is fake, meta or of
    a subclass. Written out: an eager decode step pays for every line here."""
    if _compiling() or _transforms() or _dispatch_modes() or _jit_tracing() is not None:
        return True
    if _forward_ad._current_level >= 0:  # dual tensors may carry tangents
        return True
    if type(x) is not _Tensor or x.is_meta or x.requires_grad and _grad():
        return True
    if k is not None and _special(k):
        return True
    if pos is not None and type(pos) is not int and _special(pos):
        return True
    if out is not None:
        return any(_special(o) for o in out) if isinstance(out, (tuple, list)) else _special(out)
    return False


def _untraced():
    """Whether nothing traces, transforms or records the call: no Dynamo, torch.func transform,
    dispatch mode, TorchScript trace or forward AD level."""
    return not (
        _dynamo_tracing()
        or _transforms()
        or _dispatch_modes()
        or _jit_tracing() is not None
        or _forward_ad._current_level >= 0
    )


def eager_view(x):
    """A NumPy view of the torch tensor ``x`` where a call on ``x`` alone (no out; an int
    position or none) takes the path every array takes: a plain CPU tensor of a type NumPy
    holds, with no lazy negation, that nothing traces, transforms or records. Else None.
    :func:`wanted` and the fast adopter in one, for an eager decode step. (Where AOTAutograd or
    torch.export trace, x is a fake or functional tensor, or a dispatch mode is on: Dynamo's
    own test is enough here.)"""
    if type(x) is not _Tensor or not _untraced():
        return None
    try:
        # numpy() refuses, for the general way, what this path must not take: a tensor that
        # requires grad (under no_grad too), a meta or device tensor, bfloat16, a negative or
        # conjugate bit
        return x.numpy()
    except (RuntimeError, TypeError):
        return None


def eager_views(arrays):
    """NumPy views of a call's arrays where each torch tensor among them takes the path every
    array takes (as :func:`eager_view` says, the global tests made once); NumPy arrays, ints and
    None as they are. None where one cannot, or another kind of array is among them. With grad
    off, a model's parameters (a QK-norm's weights) are read as the plain tensors they hold."""
    if not _untraced():
        return None
    views = []
    for a in arrays:
        if type(a) is _Parameter and not _grad():
            a = a.detach()
        if type(a) is _Tensor:
            try:
                a = a.numpy()
            except (RuntimeError, TypeError):
                return None
        elif not (a is None or type(a) is int or type(a) is np.ndarray):
            return None
        views.append(a)
    return views


def _special(t):
    return isinstance(t, _Tensor) and (
        type(t) is not _Tensor or t.is_meta or t.requires_grad and _grad()
    )


def _check_positions(pos, x):
    """Refuse a position tensor the operators cannot take."""
    if pos.requires_grad and _grad():
        raise RopeValueError(
            "pos requires grad: arrayrope differentiates with respect to x, not to the "
            "positions; pass pos.detach()"
        )
    if pos.device != x.device:
        raise RopeValueError(f"pos is on {pos.device} and x on {x.device}: put them on one device")
    if pos.dtype in _REFUSED_POSITIONS or pos.is_complex():
        raise RopeTypeError(
            f"pos must hold integers or real numbers of float16, float32 or float64, got "
            f"dtype {pos.dtype}"
        )


def _split_positions(pos, x):
    """``pos`` as the operators' three position arguments: (tensor, int, float), one set."""
    if pos is None:
        return None, None, None
    if isinstance(pos, _Tensor):
        _check_positions(pos, x)
        return pos, None, None
    if isinstance(pos, torch.SymInt):  # a traced int (see _rotate_node)
        return None, pos, None
    if isinstance(pos, bool):
        raise RopeTypeError(f"pos must be an int, a float, an array or None, got {pos!r}")
    if isinstance(pos, int) or type(pos).__name__.startswith(("int", "uint")):
        return None, int(pos), None
    if isinstance(pos, float) or type(pos).__name__.startswith("float"):
        return None, None, float(pos)
    raise RopeTypeError(
        "pos must be a torch tensor, an int, a float or None where torch traces, transforms or "
        f"records the call (x requires grad, a compiler, torch.func), got {type(pos).__name__}"
    )


def _transformed():
    """Whether a torch.func transform or forward-mode AD is active outside any compiler: these
    differentiate through the Functions."""
    return not _compiling() and (_transforms() or _forward_ad._current_level >= 0)


def _differentiated(*tensors):
    """Whether a call may be differentiated: autograd records one of ``tensors``, or a
    torch.func transform or forward-mode AD is active."""
    return _grad() and any(t.requires_grad for t in tensors) or _transformed()


def _rotated(x, tail):
    """A new rotated tensor: through its Function under torch.func, through the operator with
    autograd where autograd records the call, else through the one without."""
    if _transformed():
        return _Rotate.apply(x, *tail)
    if _grad() and x.requires_grad:
        return ops.rotate.default(x, *tail)
    return ops.rotate_nograd.default(x, *tail)


def _writable(name, out):
    if out.is_leaf and out.requires_grad and _grad():
        raise RopeValueError(
            f"{name} is a leaf tensor that requires grad, which torch does not let an "
            "operation write: rotate into a new tensor (autograd then runs the transpose "
            "backward), or write under torch.no_grad()"
        )


def _lowered(xs, outs, tail):
    """Where torch.compile traces a small call (``_torch_lowered``): the new rotated tensors,
    or ``outs`` written with them. None where the call goes through the operators."""
    if not _compiling() or _exporting():
        return None
    if outs is not None and any(
        o.shape != x.shape or o.dtype != x.dtype or o.device != x.device for o, x in zip(outs, xs)
    ):
        return None  # the operator says what is wrong
    pos, pos_int, pos_float, key, inverse, backend, seq_len = tail
    new = _torch_lowered.rotated(key, xs, pos, pos_int, pos_float, inverse, backend, seq_len)
    if new is None or outs is None:
        return new
    for out, result in zip(outs, new):
        out.copy_(result)
    return outs


def _seq_len(seq_len):
    """``seq_len`` as the operators' schema takes it (an int or None), else arrayrope's error."""
    if seq_len is None or isinstance(seq_len, torch.SymInt):
        return seq_len
    try:
        return operator.index(seq_len)
    except TypeError:
        raise RopeTypeError(f"seq_len must be an int or None, got {seq_len!r}") from None


def routed(key, x, pos, inverse, out, backend, seq_len):
    """``Engine.rotate`` on a torch.Tensor that its eager decode step did not take:
    :func:`rotate` where :func:`wanted` says so, else None (the call takes the way of every
    array). One function, so that Dynamo, which traces it, guards on few of its globals."""
    if _dynamo_tracing() or wanted(x, pos, out):
        return rotate(key, x, pos, inverse, out, backend, seq_len)
    return None


def routed_qk(key, q, k, pos, inverse, out, backend, seq_len):
    """:func:`routed` of ``Engine.rotate_qk``."""
    if _dynamo_tracing() or wanted(q, pos, out, k):
        return rotate_qk(key, q, k, pos, inverse, out, backend, seq_len)
    return None


def rotate(key, x, pos, inverse, out, backend, seq_len):
    """``Engine.rotate``'s contract for a torch tensor, through the operators; ``key`` names
    the engine.

    Where Dynamo traces, the code up to the graph node reads as few globals as it can, and
    neither torch.Tensor nor the torch module through arrayrope's names: Dynamo guards on each
    global it reads, and where the function it compiles reaches one object by a second name
    (torch.Tensor as x's class, the torch module as the caller's ``torch``), it checks on each
    call, in Python, that the two still name one object."""
    if _dynamo_tracing():
        if _transforms():
            _eager_under_transforms()
        elif _node_arguments(_tensor_class(x), pos, inverse, backend, seq_len, out):
            _check_node(x, pos, out)
            return _rotate_node(key, x, pos, inverse, out, backend, seq_len)
    return _rotate(key, x, pos, inverse, out, backend, seq_len)


def _eager_under_transforms():
    """Where torch.compile traces a call inside a torch.func transform, a graph break: the call
    runs eagerly, where the transform differentiates (or batches) through the Functions. Traced
    under a transform, jvp's tangents came out wrong, with no error."""
    torch._dynamo.graph_break()


def _tensor_class(x):
    """torch.Tensor, read as x's class where x is a plain tensor (see :func:`rotate`)."""
    return type(x) if type(x).__module__ == "torch" else _Tensor


def _check_node(x, pos, out):
    """The checks of positions and outputs that raise arrayrope's errors, made where Dynamo
    traces: raised inside a graph node, they would reach the caller as torch's
    TorchRuntimeError."""
    tensor = _tensor_class(x)
    if isinstance(pos, tensor):
        _check_positions(pos, x)
    if isinstance(out, tensor):
        _writable("out", out)
    elif out is not None:
        _writable("out[0]", out[0])
        _writable("out[1]", out[1])


def _node_arguments(tensor, pos, inverse, backend, seq_len, out):
    """Whether a call's arguments other than its tensors (of class ``tensor``) are ones a graph
    node holds: None, an int, a float, a bool or a str where the call has them (else it is
    traced as written, and refused there if it must be)."""
    if not (pos is None or type(pos) in (int, float) or isinstance(pos, tensor)):
        return False
    if type(inverse) is not bool or type(backend) is not str:
        return False
    if not (seq_len is None or type(seq_len) is int):
        return False
    if out is None or isinstance(out, tensor):
        return True
    return type(out) is tuple and len(out) == 2 and all(isinstance(o, tensor) for o in out)


# While torch.compile's Dynamo traces, a call is one node of its graph, which AOTAutograd then
# traces with fake tensors through the operators. Dynamo traces none of arrayrope's Python past
# this point: every module global that traced Python reads becomes a guard that each call of
# the compiled function checks, and the tens of them in the code below cost a compiled decode
# step microseconds.
@torch.compiler.allow_in_graph
def _rotate_node(key, x, pos, inverse, out, backend, seq_len):
    return _rotate(key, x, pos, inverse, out, backend, seq_len)


@torch.compiler.allow_in_graph
def _rotate_qk_node(key, q, k, pos, inverse, out, backend, seq_len):
    return _rotate_qk(key, q, k, pos, inverse, out, backend, seq_len)


def _rotate(key, x, pos, inverse, out, backend, seq_len):
    if _compiling() and not _dynamo_tracing():  # where Dynamo runs the graph node on fakes
        refuse_negative({"x": x, "pos": pos, "out": out})
    tensor, as_int, as_float = _split_positions(pos, x)
    tail = (tensor, as_int, as_float, key, check_inverse(inverse), backend, _seq_len(seq_len))
    if out is None:
        small = _lowered((x,), None, tail)
        return small[0] if small is not None else _rotated(x, tail)
    if not isinstance(out, _Tensor):
        raise RopeTypeError(f"out must be a torch tensor like x, got {type(out).__name__}")
    _writable("out", out)
    if _lowered((x,), (out,), tail) is not None:
        return out
    if _differentiated(x, out):
        out.copy_(_rotated(x, tail))  # autograd records the copy into out
    elif out is x:
        ops.rotate_.default(x, *tail)
    else:
        ops.rotate_out.default(x, out, *tail)
    return out


def rotate_qk(key, q, k, pos, inverse, out, backend, seq_len):
    """``Engine.rotate_qk``'s contract for torch tensors, through the operators."""
    if _dynamo_tracing():
        if _transforms():
            _eager_under_transforms()
        elif isinstance(k, tensor := _tensor_class(q)) and _node_arguments(
            tensor, pos, inverse, backend, seq_len, out
        ):
            _check_node(q, pos, out)
            return _rotate_qk_node(key, q, k, pos, inverse, out, backend, seq_len)
    return _rotate_qk(key, q, k, pos, inverse, out, backend, seq_len)


def _rotate_qk(key, q, k, pos, inverse, out, backend, seq_len):
    if _compiling() and not _dynamo_tracing():
        pair = out if isinstance(out, (tuple, list)) and len(out) == 2 else (None, None)
        refuse_negative({"q": q, "k": k, "pos": pos, "out[0]": pair[0], "out[1]": pair[1]})
    if not isinstance(k, _Tensor):
        raise RopeTypeError(f"q and k must both be torch tensors, got k of {type(k).__name__}")
    tensor, as_int, as_float = _split_positions(pos, q)
    tail = (tensor, as_int, as_float, key, check_inverse(inverse), backend, _seq_len(seq_len))
    if out is None:
        small = _lowered((q, k), None, tail)
        if small is not None:
            return small
        if _transformed():
            return _RotateQK.apply(q, k, *tail)
        if _grad() and (q.requires_grad or k.requires_grad):
            return ops.rotate_qk.default(q, k, *tail)
        return ops.rotate_qk_nograd.default(q, k, *tail)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise RopeTypeError(f"out must be None or a pair (q_out, k_out), got {type(out).__name__}")
    q_out, k_out = out
    if not (isinstance(q_out, _Tensor) and isinstance(k_out, _Tensor)):
        raise RopeTypeError("out must be a pair of torch tensors like q and k")
    _writable("out[0]", q_out)
    _writable("out[1]", k_out)
    if _lowered((q, k), (q_out, k_out), tail) is not None:
        return q_out, k_out
    if _differentiated(q, k, q_out, k_out):
        q_rot, k_rot = _rotate_qk(key, q, k, pos, inverse, None, backend, seq_len)
        q_out.copy_(q_rot)
        k_out.copy_(k_rot)
    elif q_out is q and k_out is k:
        ops.rotate_qk_.default(q, k, *tail)
    elif q_out is q or k_out is k:  # one in place: as two calls, each its own kind
        rotate(key, q, pos, inverse, q_out, backend, seq_len)
        rotate(key, k, pos, inverse, k_out, backend, seq_len)
    else:
        ops.rotate_qk_out.default(q, k, q_out, k_out, *tail)
    return q_out, k_out


def cache_step_wanted(arrays):
    """Whether a ``rotate_into_cache`` call with torch tensors among ``arrays`` (its arrays and
    norm weights) must go through its operators, as :func:`wanted` says for a rotation."""
    if _compiling() or _transforms() or _dispatch_modes() or _jit_tracing() is not None:
        return True
    return _forward_ad._current_level >= 0 or any(_special(a) for a in arrays)


def rotate_into_cache(key, arrays, options):
    """``RoPE.rotate_into_cache``'s contract for torch tensors, through the operators: an
    inference step, which autograd does not record."""
    q, k, v, pos, k_cache, v_cache, slots, out = arrays
    if _dynamo_tracing():
        named = {"q": q, "k": k, "v": v, "pos": pos, "k_cache": k_cache, "v_cache": v_cache,
                 "out": out}  # fmt: skip
        named = {n: t for n, t in named.items() if isinstance(t, _Tensor)}
        negative_node(tuple(named), tuple(named.values()))
    if not _compiling() and (_transforms() or _forward_ad._current_level >= 0):
        raise RopeTypeError(
            "rotate_into_cache is an inference step, which torch.func transforms (vmap, grad, "
            "jvp) and forward-mode AD do not take: call it outside them"
        )
    given = (q, k, v, options["q_norm"], options["k_norm"])
    for name, a in zip(("q", "k", "v", "q_norm", "k_norm"), given):
        if isinstance(a, _Tensor) and a.requires_grad and _grad():
            raise RopeValueError(
                f"{name} requires grad, and rotate_into_cache is an inference step that autograd "
                "does not record: call it under torch.no_grad() or torch.inference_mode()"
            )
    tensors = {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "slots": slots}
    for name, a in tensors.items():
        if not isinstance(a, _Tensor):
            raise RopeTypeError(
                f"{name} must be a torch tensor where torch traces the call, got {type(a).__name__}"
            )
    tensor, as_int, as_float = _split_positions(pos, q)
    weights = []
    for name in ("q_norm", "k_norm"):
        w = options[name]
        if w is not None and not isinstance(w, _Tensor):
            raise RopeTypeError(f"{name} must be a torch tensor or None, got {type(w).__name__}")
        weights.append(w)
    numbers = []
    for name in ("norm_eps", "k_scale", "v_scale"):
        value = options[name]
        if value is not None and not isinstance(value, (int, float)):
            raise RopeTypeError(f"{name} must be a number, got {type(value).__name__}")
        numbers.append(None if value is None else float(value))
    layout = options["cache_layout"]
    check_layout(layout)
    tail = (key, layout, *weights, *numbers, _seq_len(options["seq_len"]))
    step = (q, k, v, tensor, as_int, as_float, k_cache, v_cache, slots)
    if out is None:
        return ops.rotate_into_cache.default(*step, *tail)
    if not isinstance(out, _Tensor):
        raise RopeTypeError(f"out must be a torch tensor like q, got {type(out).__name__}")
    ops.rotate_into_cache_out.default(*step, out, *tail)
    return out
