"""torch code that torch traces: torch.compile, torch.export, the torch.func transforms,
autograd, fake and meta tensors, through arrayrope's torch operators (arrayrope/_torch_ops.py).

Every result is compared with the eager NumPy call on the same values, which the rest of the
suite checks against the float64 oracle.
"""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrayrope as ar
from arrayrope import RopeTypeError, RopeValueError
from arrayrope.scaling import YaRN

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
dynamo = pytest.importorskip("torch._dynamo")

ROPE = ar.RoPE(16, style="half")


def _numpy_rotate(rope, x, pos, **kwargs):
    pos = pos.numpy() if isinstance(pos, torch.Tensor) else pos
    return torch.from_numpy(rope.rotate(x.detach().numpy(), pos, **kwargs))


def _step(q, k, pos, step):
    """A step that calls every entry: the module-level functions and the RoPE's methods, with
    tensor and int positions."""
    q1 = ar.rotate(q, pos, style="half")
    q2, k2 = ar.rotate_qk(q, k, pos, style="half")
    k3 = ROPE.rotate(k, step)
    q4, k4 = ROPE.rotate_qk(q, k, step)
    return q1 + q2 * 2 + q4, k2 + k3 + k4


def _inputs(requires_grad=False, dtype=None):
    generator = torch.Generator().manual_seed(0)
    dtype = dtype or torch.float64
    q = torch.randn(2, 4, 5, 16, generator=generator, dtype=dtype)
    k = torch.randn(2, 2, 5, 16, generator=generator, dtype=dtype)
    pos = torch.randint(0, 100_000, (5,), generator=generator)
    return q.requires_grad_(requires_grad), k.requires_grad_(requires_grad), pos


def test_compile_fullgraph_has_no_graph_breaks_and_matches_eager():
    dynamo.reset()
    q, k, pos = _inputs()
    explained = dynamo.explain(_step)(q, k, pos, 7)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(_step, fullgraph=True, dynamic=True)
    for step in (7, 70_000, 2**31 - 1):  # ints become one symbolic size: no recompiles
        got_q, got_k = compiled(q, k, pos, step)
        with torch.no_grad():
            want_q, want_k = _step(q, k, pos, step)
        torch.testing.assert_close(got_q, want_q, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_k, want_k, rtol=1e-12, atol=1e-12)
    q1 = _numpy_rotate(ROPE, q, pos)
    torch.testing.assert_close(compiled(q, k, pos, 7)[0] - 2 * q1 - ROPE.rotate(q, 7), q1)


def test_compile_backward_matches_eager():
    dynamo.reset()
    q, k, pos = _inputs(requires_grad=True)
    compiled = torch.compile(_step, fullgraph=True)
    got_q, got_k = compiled(q, k, pos, 9)
    (got_q.square().sum() + got_k.sum()).backward()
    grads = q.grad.clone(), k.grad.clone()
    q.grad = k.grad = None
    want_q, want_k = _step(q, k, pos, 9)
    (want_q.square().sum() + want_k.sum()).backward()
    torch.testing.assert_close(got_q, want_q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[0], q.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[1], k.grad, rtol=1e-6, atol=1e-6)


def test_compile_writes_in_place_and_into_a_cache_slice():
    dynamo.reset()
    q, k, pos = _inputs(dtype=torch.float32)
    cache = torch.full((2, 2, 12, 16), float("nan"))

    def step(q, k, cache, pos, start):
        ROPE.rotate(q, pos, out=q)  # in place
        ar.rotate(k, pos, style="half", out=cache[:, :, start : start + k.shape[2]])
        return q * 1

    want_q = _numpy_rotate(ROPE, q, pos)
    want_k = _numpy_rotate(ROPE, k, pos)
    q_in = q.clone()
    got = torch.compile(step, fullgraph=True)(q_in, k, cache, pos, 3)
    torch.testing.assert_close(q_in, want_q, rtol=0, atol=0)
    torch.testing.assert_close(got, want_q, rtol=0, atol=0)
    torch.testing.assert_close(cache[:, :, 3:8], want_k, rtol=0, atol=0)
    assert cache[:, :, :3].isnan().all() and cache[:, :, 8:].isnan().all()

    def step_qk(q, k, q_out, k_out, pos):
        ar.rotate_qk(q, k, pos, style="half", out=(q, k))
        ROPE.rotate_qk(q, k, pos, inverse=True, out=(q_out, k_out))
        return q_out + 0

    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    torch.compile(step_qk, fullgraph=True)(q_in, k_in, q_out, k_out, pos)
    torch.testing.assert_close(q_in, want_q, rtol=0, atol=0)
    torch.testing.assert_close(k_in, want_k, rtol=0, atol=0)
    torch.testing.assert_close(q_out, q, rtol=1e-6, atol=1e-6)  # the undo
    torch.testing.assert_close(k_out, k, rtol=1e-6, atol=1e-6)


_OPCHECK_ROPE = ar.RoPE(16, style="half", rotary_dim=12, scaling=YaRN(4.0, 64))


def _every_op(dtype, device="cpu"):
    """(operator, arguments) for each of arrayrope's torch operators."""
    key = _OPCHECK_ROPE._engine.key
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 16, generator=generator, dtype=dtype).to(device)
    k = torch.randn(2, 1, 4, 16, generator=generator, dtype=dtype).to(device)
    pos = torch.tensor([0, 5, 70_000, 2**31 - 1], device=device)
    ops = torch.ops.arrayrope
    tails = [(pos, None, None), (None, 3, None), (None, None, 2.5), (None, None, None)]
    cases = []
    for p, p_int, p_float in tails:
        tail = (p, p_int, p_float, key, False, "auto", None)
        cases += [
            (ops.rotate.default, (q, *tail)),
            (ops.rotate_.default, (q.clone(), *tail)),
            (ops.rotate_out.default, (q, torch.empty_like(q), *tail)),
            (ops.rotate_qk.default, (q, k, *tail)),
            (ops.rotate_qk_.default, (q.clone(), k.clone(), *tail)),
            (ops.rotate_qk_out.default, (q, k, torch.empty_like(q), torch.empty_like(k), *tail)),
            (ops.rotate_nograd.default, (q, *tail)),
            (ops.rotate_qk_nograd.default, (q, k, *tail)),
        ]
    return cases


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_opcheck_passes_for_every_operator(dtype):
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    ar.rotate(torch.zeros(1, 16))  # loads the operators
    for op, args in _every_op(getattr(torch, dtype)):
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_gradcheck_and_gradgradcheck(style):
    rope = ar.RoPE(8, style=style, rotary_dim=6, scaling=YaRN(4.0, 16))
    pos = torch.tensor([3, 40, 70_000])
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    for fn, args in (
        (lambda t: rope.rotate(t, pos), (x,)),
        (lambda t: rope.rotate(t, 12, inverse=True), (x,)),
        (lambda t: rope.rotate(t, 2.5), (x,)),
        (lambda t: rope.unrotate(t, pos), (x,)),
        (lambda a, b: rope.rotate_qk(a, b, pos), (x, k)),
        (lambda t: ar.rotate(t, pos, style=style), (x,)),
    ):
        assert torch.autograd.gradcheck(fn, args)
        assert torch.autograd.gradgradcheck(fn, args)


def test_torch_func_transforms():
    from torch.func import grad, jacrev, jvp, vjp, vmap

    rope = ar.RoPE(8, style="half", scaling=YaRN(4.0, 16))
    pos = torch.tensor([1, 50_000, 7])
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    ones = torch.ones_like(x)
    transpose = _numpy_rotate(rope, ones, pos, inverse=True)
    torch.testing.assert_close(grad(lambda t: rope.rotate(t, pos).sum())(x), transpose)
    y, pull = vjp(lambda t: rope.rotate(t, pos), x)
    torch.testing.assert_close(y, _numpy_rotate(rope, x, pos))
    torch.testing.assert_close(pull(ones)[0], transpose)
    jac = jacrev(lambda t: rope.rotate(t, pos))(x)
    assert jac.shape == x.shape + x.shape
    torch.testing.assert_close(jac.sum(dim=(0, 1, 2)), transpose)
    tangent = torch.randn_like(x)
    y, dy = jvp(lambda t: rope.rotate(t, pos), (x,), (tangent,))
    torch.testing.assert_close(dy, _numpy_rotate(rope, tangent, pos))
    q_grad = grad(lambda a, b: sum(r.sum() for r in rope.rotate_qk(a, b, pos)))(x, x)
    torch.testing.assert_close(q_grad, transpose)
    # forward-mode AD outside torch.func: dual tensors keep their tangent
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(x, tangent)
        _, got = fwAD.unpack_dual(rope.rotate(dual, pos))
    torch.testing.assert_close(got, _numpy_rotate(rope, tangent, pos))
    # vmap: shared positions, per-example positions, and a batch of rows of one position each
    batch = torch.randn(5, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(
        vmap(lambda t: rope.rotate(t, pos))(batch), _numpy_rotate(rope, batch, pos)
    )
    per = torch.randint(0, 10**6, (5, 3))
    torch.testing.assert_close(
        vmap(lambda t, p: rope.rotate(t, p))(batch, per), _numpy_rotate(rope, batch, per)
    )
    rows = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(
        vmap(lambda t, p: rope.rotate(t, p))(rows, per[:, 0]),
        _numpy_rotate(rope, rows, per[:, 0]),
    )
    torch.testing.assert_close(vmap(lambda t: rope.rotate(t))(rows), _numpy_rotate(rope, rows, 0))
    q = torch.randn(5, 3, 4, 8, dtype=torch.float64)
    k, per_token = q[:, :1].clone(), torch.randint(0, 10**6, (5, 4))
    q_rot, k_rot = vmap(lambda a, b, p: rope.rotate_qk(a, b, p))(q, k, per_token)
    torch.testing.assert_close(q_rot, _numpy_rotate(rope, q, per_token[:, None]))
    torch.testing.assert_close(k_rot, _numpy_rotate(rope, k, per_token[:, None]))
    torch.testing.assert_close(
        vmap(grad(lambda t: rope.rotate(t, pos).sum()))(batch[:, None].expand(5, 2, 3, 8)),
        transpose.expand(5, 2, 3, 8),
    )
    # int positions: a tensor the transform wraps goes through the operators, one it does not
    # wrap (a constant to it) the eager decode step's way
    decode = rope.rotate(rows, 9)
    torch.testing.assert_close(vmap(lambda t: rope.rotate(t, 9))(rows), decode)
    torch.testing.assert_close(
        vmap(lambda t: rope.rotate(rows[0], 9) + t)(batch[:, 0]), decode[0] + batch[:, 0]
    )
    torch.testing.assert_close(
        grad(lambda t: (rope.rotate(t, 9) * rope.rotate(rows, 9)).sum())(rows),
        rope.rotate(decode, 9, inverse=True),
    )


def test_export_holds_the_operator():
    rope = ar.RoPE(16, style="half")

    class Step(torch.nn.Module):
        def forward(self, q, k, pos):
            q_rot, k_rot = rope.rotate_qk(q, k, pos)
            return q_rot, ar.rotate(k_rot, 3)

    q, k, pos = _inputs(dtype=torch.float32)
    exported = torch.export.export(Step(), (q, k, pos))
    names = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert {"arrayrope.rotate_qk_nograd.default", "arrayrope.rotate_nograd.default"} <= names
    torch.testing.assert_close(exported.module()(q, k, pos), Step()(q, k, pos))


def test_meta_and_fake_tensors_never_reach_a_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta = torch.empty(2, 3, 16, device="meta")
    result = ROPE.rotate(meta, 4)
    assert result.device.type == "meta" and result.shape == meta.shape
    q_rot, k_rot = ar.rotate_qk(meta, meta[:, :1], torch.arange(3, device="meta"), style="half")
    assert q_rot.device.type == "meta" and k_rot.shape == (2, 1, 16)
    with FakeTensorMode():
        fake = torch.empty(2, 3, 16)
        result = ROPE.rotate(fake, torch.arange(3))
        assert type(result).__name__ == "FakeTensor" and result.shape == fake.shape
        with pytest.raises(RopeValueError, match="head_dim"):
            ROPE.rotate(torch.empty(2, 3, 8), 1)


def test_errors_on_the_operator_route():
    x = torch.randn(3, 16, requires_grad=True)
    with pytest.raises(RopeValueError, match="leaf tensor that requires grad"):
        ROPE.rotate(x, 1, out=x)
    with pytest.raises(RopeValueError, match="pos requires grad"):
        ROPE.rotate(x, torch.ones(3, requires_grad=True))
    with pytest.raises(RopeTypeError, match="x must be float16"):
        ROPE.rotate(torch.empty(3, 16, dtype=torch.int32, device="meta"), 1)
    with pytest.raises(RopeValueError, match="head_dim"):
        ROPE.rotate(torch.empty(3, 8, requires_grad=True), 1)
    with pytest.raises(RopeTypeError, match="pos must be"):
        ROPE.rotate(x, "3")
    with pytest.raises(RopeValueError, match="no RoPE has key"):
        torch.ops.arrayrope.rotate(x.detach(), None, 1, None, 10**9, False, "auto", None)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(["float16", "bfloat16", "float32", "float64"]),
    style=st.sampled_from(["interleaved", "half"]),
    rotary=st.sampled_from([1.0, 0.5, 0.25]),
    shape=st.sampled_from([(5, 16), (2, 3, 5, 16), (1, 4, 1, 16), (3, 1, 2, 16)]),
    pos_kind=st.sampled_from(["tensor", "int", "float", "none", "neg-bit"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_operators_equal_the_direct_path(dtype, style, rotary, shape, pos_kind, seed):
    """Bits through the operators (forced by autograd) equal the direct path's, for each
    dtype, style, rotary fraction, layout and kind of positions; the backward is the
    transpose rotation."""
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    generator = torch.Generator().manual_seed(seed)
    rope = ar.RoPE(16, style=style, rotary_dim=int(16 * rotary))
    x = torch.randn(shape, generator=generator).to(getattr(torch, dtype))
    n = shape[-2]
    if pos_kind in ("tensor", "neg-bit"):
        pos = torch.randint(0, 2**31 - 1, (n,), generator=generator)
        if pos_kind == "neg-bit":
            pos = torch.complex(torch.zeros(n, dtype=torch.float64), -pos.double()).conj().imag
    else:
        draw = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        pos = {"int": draw, "float": draw / 7.0, "none": None}[pos_kind]
    direct = rope.rotate(x, pos)  # a plain tensor: no operator
    tracked = x.clone().requires_grad_()
    through_op = rope.rotate(tracked, pos)
    assert through_op.grad_fn is not None
    assert torch.equal(through_op.detach().view(torch.int16 if x.itemsize == 2 else x.dtype),
                       direct.view(torch.int16 if x.itemsize == 2 else x.dtype))  # fmt: skip
    seed_grad = torch.randn(shape, generator=generator).to(x.dtype)
    through_op.backward(seed_grad)
    assert torch.equal(tracked.grad, rope.rotate(seed_grad, pos, inverse=True))


def test_mixed_kinds_found_by_the_api_fuzz():
    q, k = torch.randn(2, 3, 5, 16), torch.randn(2, 1, 5, 16)
    pos = np.arange(5)
    q_rot, k_rot = ROPE.rotate_qk(q, k, pos)  # torch operands, NumPy positions
    assert torch.equal(q_rot, torch.from_numpy(ROPE.rotate(q.numpy(), pos)))
    assert torch.equal(k_rot, torch.from_numpy(ROPE.rotate(k.numpy(), pos)))
    with pytest.raises(RopeTypeError, match="out cannot be viewed through DLPack"):
        ROPE.rotate(q.numpy(), 1, out=torch.empty(2, 3, 5, 16, device="meta"))
    with pytest.raises(RopeValueError, match="style must be"):
        ar.rotate(q.requires_grad_(), 1, style=["half"])  # unhashable, through the operators


def test_found_by_a_fresh_read():
    from arrayrope.scaling import NTK

    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    y = ar.rotate(x, 2, scaling=NTK(2.0))  # a module-level call with a scaling rule, with grad
    torch.testing.assert_close(
        y.detach(), torch.from_numpy(ar.rotate(x.detach().numpy(), 2, scaling=NTK(2.0)))
    )
    with pytest.raises(RopeValueError, match="pos is on meta and x on cpu"):
        ROPE.rotate(torch.ones(3, 16), torch.arange(3, device="meta"))
    with pytest.raises(RopeTypeError, match="pos must hold integers or real numbers"):
        ROPE.rotate(x.new_ones(3, 16), torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(RopeValueError, match="requires grad, and autograd cannot record"):
        ROPE.rotate(np.ones((3, 16)), 1, out=torch.ones(3, 16, requires_grad=True))


# Small calls under torch.compile: written as torch operations (arrayrope/_torch_lowered.py)
_HALF = ar.RoPE(32, style="half")
_PARTIAL = ar.RoPE(32, style="interleaved", rotary_dim=20, scaling=YaRN(4.0, 64))


_M = 2**31 - 1  # an int position with every digit of the level tables at its largest


def _small_step(x, k, pos):
    """Every kind of small call: tensor, int and no positions, both styles, partial rotary,
    an attention scaling, the transpose and rotate_qk (writes into out and in place:
    test_compile_writes_in_place_and_into_a_cache_slice)."""
    q_rot, k_rot = _HALF.rotate_qk(x, k, pos)
    return (
        _HALF.rotate(x, pos),
        _PARTIAL.rotate(x, pos, inverse=True),
        _PARTIAL.rotate(x, _M),
        _HALF.rotate(x),
        ar.rotate(k[0, 0, 0], pos[0]),
        q_rot,
        k_rot,
    )


def _graph_targets(fn, *args):
    """The operations of the graph torch.compile's compiler gets for ``fn(*args)``, after
    AOTAutograd has traced it (arrayrope's calls are nodes of Dynamo's graph until then)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    dynamo.reset()
    torch.compile(fn, backend=aot_autograd(fw_compiler=compiler), fullgraph=True)(*args)
    return {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}


def test_compile_takes_each_call_as_one_node_of_dynamos_graph():
    """Dynamo traces arrayrope's Python only as far as the graph node each call becomes (the
    compiled function then guards on few of arrayrope's globals); AOTAutograd traces the node
    through the operators. Results equal eager's bits."""
    import operator

    from arrayrope import _torch_ops

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(x, k, pos, out):
        a = _HALF.rotate(x, pos)
        b, c = _HALF.rotate_qk(x, k, 5)
        ar.rotate(x, pos, out=out)
        return a, b, c

    x, k, pos, out = torch.randn(1, 4, 3, 32), torch.randn(1, 2, 3, 32), torch.arange(3), None
    out = torch.empty_like(x)
    dynamo.reset()
    results = torch.compile(step, backend=backend, fullgraph=True)(x, k, pos, out)
    calls = [
        n.target
        for g in graphs
        for n in g.graph.nodes
        if n.op == "call_function"
        # beside the nodes: the check for torch.func transforms, and the attributes that the
        # checks made before a node read
        and n.target not in (operator.getitem, getattr, torch._C._are_functorch_transforms_active)
    ]
    node, qk_node = _torch_ops._rotate_node, _torch_ops._rotate_qk_node
    assert calls == [node, qk_node, node]
    torch.testing.assert_close(results[0], _HALF.rotate(x, pos), rtol=0, atol=0)
    torch.testing.assert_close(results[1], _HALF.rotate_qk(x, k, 5)[0], rtol=0, atol=0)
    torch.testing.assert_close(out, ar.rotate(x, pos), rtol=0, atol=0)


def test_compiled_calls_check_no_second_name_of_arrayropes_objects():
    """Dynamo guards on each global that it traces on the way to a call's graph node, and where
    one object is reached by two names (a module as another module's attribute and as a
    function's globals, torch.Tensor through arrayrope), on each call of the compiled code it
    checks in Python that the two still name one object. rotate and rotate_qk, the RoPE's and
    the module's, reach their nodes with none of those checks."""
    x, k, pos = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 1, 32), torch.arange(1)
    _HALF.rotate(x, 0)  # arrayrope's torch module loaded, as in a process that ran eagerly
    for fn in (
        lambda x, p: _HALF.rotate(x, p),
        lambda x, p: _HALF.rotate_qk(x, k, p),
        lambda x, p: ar.rotate(x, p),
        lambda x, p: ar.rotate_qk(x, k, p, style="half"),
        lambda x, p: torch.relu(_HALF.rotate(x, p)),  # the caller's torch: the module again
    ):
        found = []

        def keep(entries, found=found):
            found.extend(e for e in entries if e.guard_type == "DUPLICATE_INPUT")
            return [True] * len(entries)

        dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, options={"guard_filter_fn": keep})
        compiled(x, pos)
        assert [e.name for e in found if "arrayrope" in e.name] == []


def test_a_parameter_is_one_node_of_dynamos_graph_too():
    """x a tensor subclass (a parameter) with plain tensor positions and out: still one node."""
    from torch._dynamo.testing import CompileCounterWithBackend

    x = torch.nn.Parameter(torch.randn(1, 4, 3, 32), requires_grad=False)
    pos, out = torch.arange(3), torch.empty(1, 4, 3, 32)
    counter = CompileCounterWithBackend("aot_eager")
    dynamo.reset()
    compiled = torch.compile(lambda x, p, o: _HALF.rotate(x, p, out=o), backend=counter)
    compiled(x, pos, out)
    assert counter.frame_count == 1 and counter.op_count <= 3  # the node, beside its checks
    torch.testing.assert_close(out, _HALF.rotate(x.detach(), pos), rtol=0, atol=0)


def test_functionalize_never_rotates_what_is_not_x():
    """torch.func.functionalize wraps x in a tensor whose numpy() does not refuse: the call
    must not take the eager step's view of its memory (it raises, or equals eager)."""
    from torch.func import functionalize

    x = torch.arange(16, dtype=torch.float64).reshape(2, 8) + 1
    rope = ar.RoPE(8, style="half")
    for fn in (lambda a: rope.rotate(a, 9), lambda a: rope.rotate(a)):
        try:
            got = functionalize(fn)(x)
        except RuntimeError:
            continue
        torch.testing.assert_close(got, fn(x))


def test_transforms_inside_compile_equal_eager():
    # a call under a torch.func transform that torch.compile traces runs eagerly (a graph
    # break): traced, jvp's tangents came out wrong with no error
    x = torch.randn(1, 8, 256, 16, dtype=torch.float64)  # past the small calls: the operators
    k, pos = torch.randn(1, 2, 256, 16, dtype=torch.float64), torch.arange(256)
    steps = [
        lambda t, p: torch.func.jvp(lambda u: ROPE.rotate(u, p), (t,), (torch.ones_like(t),)),
        lambda t, p: torch.func.jvp(
            lambda u: ROPE.rotate_qk(u, k, p)[0], (t,), (torch.ones_like(t),)
        ),
        lambda t, p: torch.func.grad(lambda u: (ROPE.rotate(u, p) ** 2).sum())(t),
        lambda t, p: torch.func.vmap(lambda u: ROPE.rotate(u, p))(t),
    ]
    for step in steps:
        dynamo.reset()
        want, got = step(x, pos), torch.compile(step)(x, pos)
        for w, g in zip(
            want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)
        ):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def _negative_view(shape):
    """A writable float64 tensor of zeros with torch's negative bit: a view of a complex one."""
    view = torch.zeros(shape, dtype=torch.complex128).conj().imag
    assert view.is_neg()
    return view


def test_a_negative_bit_under_compile_is_refused_not_flipped():
    # torch.compile reads a tensor with the negative bit by its stored values, the opposite
    # of its own (pytorch/pytorch#145093, torch's t * 2 too): refused where Dynamo runs a
    # graph node on fake tensors, never rotated with the wrong sign; eager calls and
    # torch.export resolve the bit
    x = torch.randn(1, 2, 4, 16, dtype=torch.float64)
    negated = torch.complex(torch.zeros_like(x), -x).conj().imag
    assert negated.is_neg() and torch.equal(negated, x)
    pos = torch.arange(4)
    want = _numpy_rotate(ROPE, x, pos)
    torch.testing.assert_close(ROPE.rotate(negated, pos), want, rtol=0, atol=0)
    neg_pos = torch.complex(torch.zeros(4, dtype=torch.float64), -pos.double()).conj().imag
    cases = [
        ("x", lambda t, p: ROPE.rotate(t, p), (negated, pos)),
        ("x", lambda t, p: ROPE.rotate(t, 3), (negated, pos)),  # the lowered small call too
        ("x", lambda t, p: ROPE.rotate(t, 2.5), (negated, pos)),
        ("q", lambda t, p: ROPE.rotate_qk(t, x, p), (negated, pos)),
        ("k", lambda t, p: ROPE.rotate_qk(x, t, p), (negated, pos)),
        ("pos", lambda t, p: ROPE.rotate(x, p), (x, neg_pos)),
        ("out", lambda t, p: ROPE.rotate(x, p, out=t), (_negative_view(x.shape), pos)),
    ]
    for name, fn, args in cases:
        # refused where Dynamo runs the graph node on fake tensors, which keep the bit: torch's
        # TorchRuntimeError carries arrayrope's error
        for fullgraph in (False, True):
            dynamo.reset()
            with pytest.raises(dynamo.exc.TorchRuntimeError, match=rf"{name}\.resolve_neg\(\)"):
                torch.compile(fn, fullgraph=fullgraph)(*args)

    # the calls that reach an operator with no node of their own: a node that checks
    q, k, v, step_pos, k_cache, v_cache, slots = _cache_step_inputs(torch.float32, 4)
    lazy_q = torch.complex(torch.zeros_like(q), -q).conj().imag
    cos, sin = ROPE.cos_sin(pos, like=x)
    others = [
        ("q", lambda t: STEP_ROPE.rotate_into_cache(t, k, v, step_pos, k_cache, v_cache, slots),
         lazy_q),
        ("x", lambda t: ar.apply_cos_sin(t, cos, sin, style="half", rotary_dim=16), negated),
    ]  # fmt: skip
    before = k_cache.clone()
    for name, fn, arg in others:
        for fullgraph in (False, True):
            dynamo.reset()
            with pytest.raises(dynamo.exc.TorchRuntimeError, match=rf"{name}\.resolve_neg\(\)"):
                torch.compile(fn, fullgraph=fullgraph)(arg)
    assert torch.equal(k_cache, before)

    class Step(torch.nn.Module):
        def forward(self, t, p):
            return ROPE.rotate(t, p)

    dynamo.reset()
    exported = torch.export.export(Step(), (negated, pos)).module()
    torch.testing.assert_close(exported(negated, pos), want, rtol=0, atol=0)


def test_refusals_under_compile_are_arrayropes_errors():
    # checked where Dynamo traces: inside the graph node they would be torch's errors
    x = torch.randn(1, 2, 4, 16)
    bool_pos = torch.zeros(4, dtype=torch.bool)
    cases = [
        (lambda t, p: ROPE.rotate(t, p), (x, bool_pos), RopeTypeError, "integers or real"),
        (lambda t, p: ROPE.rotate_qk(t, t, p), (x, bool_pos), RopeTypeError, "integers or real"),
        (lambda t, p: ROPE.rotate(t, p), (x, torch.arange(4.0).requires_grad_()), RopeValueError,
         "pos requires grad"),
        (lambda t, o: ROPE.rotate(t, 3, out=o), (x, torch.empty_like(x).requires_grad_()),
         RopeValueError, "out is a leaf"),
    ]  # fmt: skip
    for fn, args, error, message in cases:
        dynamo.reset()
        with pytest.raises(error, match=message):
            torch.compile(fn)(*args)


def test_compile_writes_small_calls_as_torch_operations():
    from arrayrope import _torch_lowered

    x, k = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 1, 32)
    pos = torch.tensor([70_000])
    targets = _graph_targets(_small_step, x, k, pos)
    assert not any("arrayrope" in t for t in targets), targets
    with open(Path(__file__).parents[1] / "README.md") as f:
        assert f"up to {_torch_lowered.SMALL:,} elements" in f.read()  # the README's number
    big = torch.randn(1, 8, _torch_lowered.SMALL // (8 * 32) + 1, 32)
    targets = _graph_targets(lambda t: _HALF.rotate(t, 3), big)
    assert "arrayrope.rotate_nograd.default" in targets
    targets = _graph_targets(lambda t: _HALF.rotate(t, 2.5), x)  # real positions: the kernels
    assert "arrayrope.rotate_nograd.default" in targets


_COMPILED_SMALL = {}


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(["float16", "bfloat16", "float32", "float64"]),
    positions=st.lists(
        st.one_of(
            st.integers(0, 2**31 - 1),
            st.sampled_from([0, 1, 2047, 2048, 2**22 - 1, 2**22, 65_535, 65_536, 2**31 - 1]),
        ),
        min_size=3,
        max_size=3,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_small_calls_under_compile_equal_the_kernels(dtype, positions, seed):
    """Bits of every kind of small call compiled by Inductor equal the kernels', at positions
    over [0, 2**31) and on the level tables' digit edges, for every dtype."""
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    dtype = getattr(torch, dtype)
    compiled = _COMPILED_SMALL.get(dtype)
    if compiled is None:  # one compiled step per dtype: positions and values are inputs
        compiled = _COMPILED_SMALL[dtype] = torch.compile(_small_step, fullgraph=True)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, 3, 32, generator=generator).to(dtype)
    k = torch.randn(2, 1, 3, 32, generator=generator).to(dtype)
    pos = torch.tensor(positions)
    got = compiled(x, k, pos)
    want = _small_step(x, k, pos)  # plain tensors outside the compiler: the kernels
    bits = torch.int16 if x.itemsize == 2 else dtype
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a.view(bits), b.view(bits)), (i, positions, seed)


def test_small_calls_under_compile_refuse_positions_outside_the_range():
    compiled = torch.compile(lambda t, p: _HALF.rotate(t, p), fullgraph=True)
    x = torch.randn(1, 2, 3, 32)
    good = torch.tensor([0, 5, 2**31 - 1])
    torch.testing.assert_close(compiled(x, good), _numpy_rotate(_HALF, x, good))
    for bad in ([0, 2**31, 1], [-1, 0, 1]):
        with pytest.raises(
            RuntimeError, match=r"pos must hold integer positions in \[0, 2\*\*31\)"
        ):
            compiled(x, torch.tensor(bad))
    # what the direct path refuses, refused alike: (B, T) positions against (B, H, T) without
    # head_axis, an inverse that is not a bool; and an empty x
    ids = torch.tensor([[0, 1, 2], [100, 101, 102]])
    with pytest.raises(RopeValueError, match="fewer axes than the leading shape"):
        compiled(torch.randn(2, 2, 3, 32), ids)
    with pytest.raises(RopeTypeError, match="inverse must be a bool"):  # raised as it traces
        torch.compile(lambda t: _HALF.rotate(t, 3, inverse=1))(x)
    empty = torch.randn(1, 4, 0, 32)
    assert compiled(empty, torch.zeros(0, dtype=torch.int64)).shape == empty.shape
    for bad in (-1, 2**31):  # an int: through the operator
        with pytest.raises(RopeValueError, match="pos must be"):
            compiled(x, bad)


# RoPE.rotate_into_cache on torch tensors: plain CPU tensors through views of their memory,
# compiled and fake ones through the arrayrope::rotate_into_cache operators. The NumPy step on
# the same values (tests/test_kv_cache.py checks it against rotate_qk and a scatter) judges
# every bit, results and caches alike.
STEP_ROPE = ar.RoPE(32, style="half", rotary_dim=16)


def _cache_step_inputs(dtype, seed, cache_dtype=None):
    """q, k, v (views of one projection), positions, the caches and slots (one padding)."""
    generator = torch.Generator().manual_seed(seed)
    n, hq, hkv, d = 6, 4, 2, 32
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=generator).to(dtype)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    caches = torch.randn(2, 4, 8, hkv, d, generator=generator).to(cache_dtype or dtype)
    pos = torch.randint(0, 2**31 - 1, (n,), generator=generator)
    pos[:3] = torch.randint(0, 1000, (3,), generator=generator)  # in the table and past it
    slots = torch.randperm(32, generator=generator)[:n]
    slots[2] = -1
    return q, k, v, pos, caches[0], caches[1], slots


_INT_OF_SIZE = {1: (np.uint8, "uint8"), 2: (np.int16, "int16"), 4: (np.int32, "int32"),
                8: (np.int64, "int64")}  # fmt: skip


def _bits(t):
    """A tensor's bits, as integers of its element size."""
    return t.view(getattr(torch, _INT_OF_SIZE[t.element_size()][1]))


def _plain(t):
    """A NumPy copy of a CPU tensor (bfloat16 and float8 as ml_dtypes' types)."""
    import ml_dtypes

    kinds = {torch.bfloat16: ml_dtypes.bfloat16, torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn}
    if t.dtype in kinds:
        return _bits(t).numpy().copy().view(kinds[t.dtype])
    return t.numpy().copy()


def _back(a, like):
    return torch.from_numpy(a.view(_INT_OF_SIZE[a.itemsize][0])).view(like.dtype)


def _numpy_cache_step(rope, q, k, v, pos, k_cache, v_cache, slots, **options):
    """The NumPy step on copies: (q's result, k_cache, v_cache) as torch tensors."""
    caches = _plain(k_cache), _plain(v_cache)
    got = rope.rotate_into_cache(_plain(q), _plain(k), _plain(v), pos.numpy(), *caches,
                                 slots.numpy(), **options)  # fmt: skip
    return _back(got, q), _back(caches[0], k_cache), _back(caches[1], v_cache)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("where", ["new", "out", "in place"])
def test_rotate_into_cache_on_cpu_tensors_is_the_numpy_step(dtype, where):
    q, k, v, pos, k_cache, v_cache, slots = _cache_step_inputs(dtype, 1)
    want = _numpy_cache_step(STEP_ROPE, q, k, v, pos, k_cache, v_cache, slots)
    out = {"new": None, "out": torch.full_like(q, float("nan")), "in place": q}[where]
    got = STEP_ROPE.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=out)
    assert type(got) is torch.Tensor and (out is None or got is out)
    for a, b in zip((got, k_cache, v_cache), want):
        assert _same_bits(a, b)


def test_rotate_into_cache_on_cpu_tensors_with_norm_and_float8_caches():
    q, k, v, pos, k_cache, v_cache, slots = _cache_step_inputs(
        torch.bfloat16, 2, torch.float8_e4m3fn
    )
    options = dict(q_norm=torch.linspace(0.5, 1.5, 32), k_norm=torch.linspace(1.5, 0.5, 32),
                   k_scale=0.5, v_scale=2.0)  # fmt: skip
    numpy_options = {
        **options,
        "q_norm": options["q_norm"].numpy(),
        "k_norm": options["k_norm"].numpy(),
    }
    want = _numpy_cache_step(STEP_ROPE, q, k, v, pos, k_cache, v_cache, slots, **numpy_options)
    got = STEP_ROPE.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, **options)
    for a, b in zip((got, k_cache, v_cache), want):
        assert _same_bits(a, b)


def test_an_eager_step_on_plain_cpu_tensors_takes_no_operator_and_no_conversion(monkeypatch):
    # plain float32 tensors (slots a NumPy array among them) go straight to the NumPy step
    from arrayrope import _kv_frameworks, _torch_library

    q, k, v, pos, k_cache, v_cache, slots = _cache_step_inputs(torch.float32, 6)
    want = _numpy_cache_step(STEP_ROPE, q, k, v, pos, k_cache, v_cache, slots)

    def refused(*args, **kwargs):
        raise AssertionError("the general way was taken")

    monkeypatch.setattr(_kv_frameworks, "_native", refused)
    monkeypatch.setattr(_torch_library, "_native", refused)
    monkeypatch.setattr(ar._interop.torch_ops(), "rotate_into_cache", refused)
    out = torch.full_like(q, float("nan"))
    for where in (None, out):
        got = STEP_ROPE.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots.numpy(), out=where)
        assert type(got) is torch.Tensor and (where is None or got is out)
        for a, b in zip((got, k_cache, v_cache), want):
            assert _same_bits(a, b)
    numpy_q = q.numpy().copy()  # the result takes q's type: a NumPy q, a NumPy result
    got = STEP_ROPE.rotate_into_cache(numpy_q, k, v, pos, k_cache, v_cache, slots)
    assert type(got) is np.ndarray and _same_bits(torch.from_numpy(got), want[0])
    # a model's norm weights, parameters, with grad off: read as the tensors they hold
    weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 32))
    normed = dict(q_norm=weight, k_norm=weight)
    detached = dict(q_norm=weight.detach().numpy(), k_norm=weight.detach().numpy())
    want = _numpy_cache_step(STEP_ROPE, q, k, v, pos, k_cache, v_cache, slots, **detached)
    with torch.no_grad():
        got = STEP_ROPE.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, **normed)
    for a, b in zip((got, k_cache, v_cache), want):
        assert _same_bits(a, b)
    monkeypatch.undo()  # a tensor that requires grad is the operators' to refuse
    with pytest.raises(RopeValueError, match="k requires grad.*inference step"):
        STEP_ROPE.rotate_into_cache(q, k.clone().requires_grad_(), v, pos, k_cache, v_cache, slots)
    # with grad on, the weights too: autograd would not record their gradient
    before = k_cache.clone()
    with pytest.raises(RopeValueError, match="q_norm requires grad.*inference step"):
        STEP_ROPE.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, **normed)
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
def test_opcheck_passes_for_the_fused_steps_operators(dtype, norm):
    from arrayrope._torch_library import ops

    q, k, v, pos, k_cache, v_cache, slots = _cache_step_inputs(dtype, 3)
    weight = torch.linspace(0.5, 1.5, 32) if norm else None
    options = (STEP_ROPE._engine.key, "NHD", weight, weight, 1e-6, None, None, None)
    head = (q, k, v, pos, None, None, k_cache, v_cache, slots)
    cases = [
        (ops.rotate_into_cache.default, (*head, *options)),
        (ops.rotate_into_cache_out.default, (*head, torch.empty_like(q), *options)),
    ]
    for op, args in cases:
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_into_cache_under_compile_writes_the_caches(dtype):
    # fullgraph: the operators, whose schemas say the caches (and out) are written, so the
    # compiled step's caches hold the eager step's bits
    dynamo.reset()

    def step(q, k, v, pos, k_cache, v_cache, slots, out):
        rotated = STEP_ROPE.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots)
        STEP_ROPE.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=out)
        return rotated + 0

    compiled = torch.compile(step, fullgraph=True)
    for seed in (3, 4):  # the second call runs the compiled code again
        q, k, v, pos, k_cache, v_cache, slots = _cache_step_inputs(dtype, seed)
        want = _numpy_cache_step(STEP_ROPE, q, k, v, pos, k_cache, v_cache, slots)
        out = torch.full_like(q, float("nan"))
        got = compiled(q, k, v, pos, k_cache, v_cache, slots, out)
        for a, b in zip((got, out, k_cache, v_cache), (want[0],) + want):
            assert _same_bits(a, b)


def test_rotate_into_cache_on_fake_tensors_and_its_refusals():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, pos, k_cache, v_cache, slots = _cache_step_inputs(torch.float32, 5)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (q, k, v, pos, k_cache, v_cache, slots)]
        got = STEP_ROPE.rotate_into_cache(*fakes)
        assert got.shape == q.shape and got.dtype == q.dtype
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(RopeValueError, match="q requires grad.*inference step"):
        STEP_ROPE.rotate_into_cache(q.clone().requires_grad_(), k, v, pos, k_cache, v_cache, slots)
    step = STEP_ROPE.rotate_into_cache
    with pytest.raises(RopeTypeError, match="inference step, which torch.func"):
        torch.func.vmap(lambda a: step(a, k, v, pos, k_cache, v_cache, slots))(q[None])
    with pytest.raises(RopeTypeError, match="inference step, which torch.func"):
        torch.func.grad(lambda a: step(a, k, v, pos, k_cache, v_cache, slots).sum())(q)
    negated = torch.zeros(k_cache.shape, dtype=torch.complex64).conj().imag  # a lazy negation
    with pytest.raises(RopeValueError, match="k_cache has torch's negative"):
        STEP_ROPE.rotate_into_cache(q, k, v, pos, negated, v_cache, slots)
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(RopeTypeError, match="one framework, got torch tensors and JAX"):
        STEP_ROPE.rotate_into_cache(q, k, v, pos, jnp.asarray(k_cache.numpy()), v_cache, slots)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_a_seq_len_that_is_not_an_int_is_arrayropes_error_on_the_operators():
    # a tensor that requires grad goes through the operators, whose schema takes an int
    x = torch.zeros(1, 2, 3, 8, requires_grad=True)
    rope = ar.RoPE(8, scaling=ar.scaling.DynamicNTK(2.0, 4))
    for call in (lambda: rope.rotate(x, seq_len=2.5), lambda: rope.rotate_qk(x, x, seq_len=2.5)):
        with pytest.raises(ar.RopeTypeError, match="seq_len must be an int or None, got 2.5"):
            call()
