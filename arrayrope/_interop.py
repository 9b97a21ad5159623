"""Arrays from other frameworks: DLPack in and out, the framework operators' loaders; Dask
arrays chunk by chunk are _dask's.

Nothing here imports a framework that the caller's arrays do not already come from: a torch
tensor means torch is loaded, a dask array means dask is.
"""

import sys

import numpy as np

from . import _arrays, _jax_results
from ._cache import Bounded
from ._errors import BackendUnavailableError, RopeTypeError, RopeValueError

_CPU, _CUDA, _CUDA_MANAGED = 1, 2, 13  # DLPack device types


def is_dask(a):
    dask_array = sys.modules.get("dask.array")
    return dask_array is not None and isinstance(a, dask_array.Array)


def _framework(a):
    return type(a).__module__.split(".", 1)[0]


def _torch_bits(a):
    """A torch bfloat16 tensor as int16 bits: DLPack consumers such as NumPy lack bfloat16 (and
    torch.uint16 needs torch 2.3)."""
    torch = sys.modules["torch"]
    if a.dtype == torch.bfloat16:
        return a.view(torch.int16), True
    return a, False


def _bfloat16(name):
    try:
        import ml_dtypes
    except ImportError:
        raise BackendUnavailableError(
            f"{name} is bfloat16, which needs ml_dtypes: pip install 'arrayrope[bfloat16]'"
        ) from None
    return ml_dtypes.bfloat16


def native_positions(pos):
    """``pos``, or a NumPy or CuPy view of it where it comes from another framework."""
    if hasattr(pos, "__dlpack__") and not _arrays.family(pos):
        return adopt("pos", pos)[0]
    return pos


def adopt(name, a, written=False):
    """A NumPy or CuPy view of a DLPack-capable ``a`` (no copy, except of a torch tensor with
    a lazy negation, which an input resolves first), a function that returns a result (NumPy or
    CuPy) as ``a``'s own type, and whether ``a`` is read-only. ``written``: ``a`` is to be
    written (an out). Raises for what DLPack cannot carry."""
    if not hasattr(a, "__dlpack__") or not hasattr(a, "__dlpack_device__"):
        raise RopeTypeError(f"{name} must be {_arrays.ACCEPTED}, got {_arrays.describe(a)}")
    _arrays.refuse_masked(name, a)  # DLPack carries its data and not its mask
    framework = _framework(a)
    if framework == "torch":
        if a.requires_grad and sys.modules["torch"].is_grad_enabled():
            # reached only beside a non-torch array: a torch x takes the operators instead
            raise RopeValueError(
                f"{name} requires grad, and autograd cannot record a call whose x is not a torch "
                "tensor: pass torch tensors for x (and k), or call under torch.no_grad()"
            )
        a = torch_library().resolve_lazy_bits(name, a.detach(), written)
    try:
        device_type = int(a.__dlpack_device__()[0])
    except (BufferError, TypeError, RuntimeError, ValueError) as error:  # torch's meta device
        raise RopeTypeError(f"{name} cannot be viewed through DLPack: {error}") from None
    source, bits = _torch_bits(a) if framework == "torch" else (a, False)
    try:
        if device_type == _CPU:
            native = np.from_dlpack(source)
        elif device_type in (_CUDA, _CUDA_MANAGED):
            import cupy

            # consumed on the stream the call launches on (torch's current one for a torch
            # tensor): the producer then has no other stream to order, which it could not do
            # while a CUDA graph is being captured on its stream
            with framework_stream((a,)):
                native = cupy.from_dlpack(source)
        else:
            raise RopeTypeError(
                f"{name} is on DLPack device type {device_type}; arrayrope runs "
                "on CPU (NumPy) and CUDA (CuPy) memory"
            )
    except (BufferError, TypeError, RuntimeError, ValueError) as error:
        if isinstance(error, RopeTypeError):
            raise
        if framework in ("jax", "jaxlib") and device_type == _CPU:
            # DLPack has no bfloat16 for NumPy, but JAX's own NumPy conversion does (both use
            # ml_dtypes); on the CPU it is a read-only view of the buffer.
            native = np.asarray(a)
        else:
            raise RopeTypeError(f"{name} cannot be viewed through DLPack: {error}") from None
    if bits:
        native = native.view(_bfloat16(name))
    read_only = framework in ("jax", "jaxlib") or (
        _arrays.is_host(native) and not native.flags.writeable
    )
    return native, restorer(framework), read_only


_restorers = {}  # finite store: by framework


def restorer(framework):
    """The function that hands a result (NumPy or CuPy) back as ``framework``'s array."""
    found = _restorers.get(framework)
    if found is None:
        found = _restorers[framework] = _make_restorer(framework)
    return found


def _make_restorer(framework):
    if framework == "torch":
        torch = sys.modules["torch"]

        def to_torch(result):
            bf16 = result.dtype.name == "bfloat16"
            if bf16:
                result = result.view(np.int16)
            tensor = (
                torch.from_numpy(result) if _arrays.is_host(result) else torch.from_dlpack(result)
            )
            return tensor.view(torch.bfloat16) if bf16 else tensor

        return to_torch
    if framework in ("jax", "jaxlib"):
        jnp = sys.modules["jax"].numpy

        def to_jax(result):
            if result.dtype.name == "bfloat16":  # not expressible in DLPack from NumPy
                return jnp.asarray(result)
            return jnp.from_dlpack(result)

        return to_jax
    return lambda result: result


def framework_stream(arrays):
    """A context in which CuPy launches on the caller's CUDA stream: torch's current stream for
    torch CUDA tensors, so that the next torch operation (on that stream, or in a CUDA graph
    being captured on it) sees the writes of an out= or in-place call in order. Nothing for
    every other array."""
    import contextlib

    for a in arrays:
        if _framework(a) == "torch" and getattr(a, "is_cuda", False):
            torch = sys.modules["torch"]
            import cupy

            return cupy.cuda.ExternalStream(torch.cuda.current_stream(a.device).cuda_stream)
    return contextlib.nullcontext()


def torch_library():
    """arrayrope._torch_library: torch's own rules (lazy negations), and the operators."""
    from . import _torch_library

    return _torch_library


_torch_ops = None

# Set when _torch_ops loads (None until a torch tensor has been seen): the functions that
# RoPE's and the module's calls make on a torch.Tensor: _torch_ops.eager_view, eager_views and
# torch.from_numpy (an eager decode step's way), routed and routed_qk (Engine's others),
# wanted, shared_key, rotate and rotate_qk (rotate's and rotate_qk's). The callers read these,
# never the module or torch.Tensor: under torch.compile, each global that Dynamo traces on the
# way to the graph node is a guard that every call of the compiled code checks, and a second
# name of one object (a module, torch.Tensor) a slower one, in Python.
eager_view = eager_views = from_numpy = torch_routed_qk = None
torch_shared_key = torch_rotate = torch_rotate_qk = None
torch_routed = torch_wanted = None  # last set: they open the ways that use those above


def torch_ops():
    """arrayrope._torch_ops, which imports torch and registers the operators: loaded once a
    torch tensor needs it."""
    global _torch_ops, eager_view, eager_views, from_numpy, torch_routed, torch_routed_qk
    global torch_shared_key, torch_rotate, torch_rotate_qk, torch_wanted
    if _torch_ops is None:
        from . import _torch_ops as module

        eager_view, eager_views = module.eager_view, module.eager_views
        from_numpy = module.torch.from_numpy
        torch_routed_qk, torch_shared_key = module.routed_qk, module.shared_key
        torch_rotate, torch_rotate_qk = module.rotate, module.rotate_qk
        torch_routed, torch_wanted = module.routed, module.wanted
        _torch_ops = module
    return _torch_ops


def torch_ops_wanted(x, pos, out, k=None):
    """Whether ``x`` is a torch tensor whose call must go through arrayrope's torch
    operators (see _torch_ops.wanted)."""
    if type(x).__module__[:5] != "torch":
        return False
    return (_torch_ops or torch_ops()).wanted(x, pos, out, k)


_jax_ops = None


def jax_ops():
    """arrayrope._jax_ops, which imports JAX and registers the primitive: loaded once a traced
    JAX array needs it."""
    global _jax_ops
    if _jax_ops is None:
        from . import _jax_ops as module

        _jax_ops = module
    return _jax_ops


def traced_beside(pos, x):
    """Whether ``pos`` is a traced JAX array and ``x`` an array of another framework (a torch
    tensor): a JAX program cannot rotate it."""
    return (
        pos is not None
        and type(pos) not in (int, np.ndarray)
        and jax_traced(pos)
        and _framework(x) not in ("jax", "jaxlib")
    )


def traced_beside_error(name, x):
    """The refusal of :func:`traced_beside`."""
    return RopeTypeError(
        f"pos is a traced JAX array and {name} a {_framework(x)} array: inside jax.jit, grad or "
        f"vmap, pass {name} as a JAX array too (jnp.asarray)"
    )


def jax_traced(*arrays):
    """Whether one of ``arrays`` is a JAX tracer (an array inside jit, grad, vmap, ...)."""
    jax = sys.modules.get("jax")
    return jax is not None and any(isinstance(a, jax.core.Tracer) for a in arrays)


_fast = Bounded(64)


def fast_adopter(kind):
    """For a type whose CPU arrays convert to and from NumPy more cheaply than through DLPack
    (torch tensors, JAX arrays), a function ``a -> (NumPy view, new, restorer)``, or None where
    that array needs the general way (another device, bfloat16 without ml_dtypes, autograd).
    ``new(*views)`` makes the arrays the results are written into, or is None where the plan's
    own will do; ``restorer`` hands a result back as the type's array. None for every other
    type. Cached per type."""
    found = _fast.get(kind, False)
    if found is False:
        found = _fast.put(kind, _make_fast_adopter(kind))
    return found


def _make_fast_adopter(kind):
    framework = kind.__module__.split(".", 1)[0]
    if framework == "torch":
        torch = sys.modules["torch"]
        bfloat16 = torch.bfloat16
        back = restorer("torch")
        from_numpy = torch.from_numpy

        def from_torch(t):
            if not t.is_cpu:
                return None
            try:
                if t.dtype is bfloat16:
                    if "ml_dtypes" not in sys.modules:
                        return None
                    bits = t.view(torch.int16).numpy()
                    return bits.view(sys.modules["ml_dtypes"].bfloat16), None, back
                return t.numpy(), None, from_numpy
            except (RuntimeError, TypeError):  # one NumPy cannot view (conjugate bit, grad)
                return None

        return from_torch
    if framework in ("jax", "jaxlib"):
        tracer = sys.modules["jax"].core.Tracer

        def from_jax(a):
            if isinstance(a, tracer):
                return None
            devices = a.devices()
            if len(devices) != 1 or next(iter(devices)).platform != "cpu":
                return None
            # a read-only view of its buffer; a large result is written into memory that XLA
            # adopts as it is (no one else holds it), where a copy would fill fresh pages
            view = np.asarray(a)
            new = None if view.nbytes < _jax_results.ADOPTED_FROM else _jax_results.new
            return view, new, _jax_results.result

        return from_jax
    return None
