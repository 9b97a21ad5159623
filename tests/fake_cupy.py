"""A stand-in for CuPy on a machine without a GPU: host memory, CuPy's rules, the real kernels.

``make(library)`` returns a module that arrayrope takes for ``cupy`` when it is placed in
``sys.modules``. Its arrays hold NumPy arrays and keep CuPy's boundaries, so that the glue
between arrayrope's API and its CUDA kernels runs here as it would on a GPU:

- an array lives on a device (0 or 1) and an operation on it must run with that device current,
  as CuPy requires, so a missing ``with x.device:`` fails here too;
- it refuses implicit conversion to NumPy (``np.asarray`` raises TypeError, as CuPy's does) and
  operations that mix it with NumPy arrays, so a silent host copy fails;
- ``RawModule(...).get_function(name)(grid, block, args)`` checks that every array argument is
  one of its arrays on the launching device, then runs the CUDA C source compiled for the host
  (host_cuda.py) over that grid, addressing memory through ``data.ptr``.

What it cannot show: CuPy's own behaviour where it differs from NumPy's, timing, and anything
about real device memory. tests/test_gpu.py covers those on a GPU.
"""

import contextlib
import sys
import time
import types

import host_cuda
import numpy as np

_current = [0]  # the stack's top is the current device


class Device:
    def __init__(self, device=None):
        self.id = _current[-1] if device is None else int(device)

    def __enter__(self):
        _current.append(self.id)
        return self

    def __exit__(self, *exc):
        _current.pop()

    def synchronize(self):
        """Launches run as they are made here: nothing is ever pending."""

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


def _here():
    return _current[-1]


class Stream:
    """A CUDA stream: a ``with`` block makes it current; launches record the current one."""

    _next = [0x1000]

    def __init__(self, non_blocking=False, ptr=None):
        if ptr is None:
            ptr = Stream._next[0]
            Stream._next[0] += 0x10
        self.ptr = ptr

    def __enter__(self):
        _streams.append(self)
        return self

    def __exit__(self, *exc):
        _streams.pop()

    def synchronize(self):
        """Launches run as they are made here: nothing is ever pending."""
        _refuse_while_capturing("a synchronization")

    def is_capturing(self):
        return self.ptr in _capturing

    def begin_capture(self, mode=None):
        """Launches on this stream are recorded, not run, until :meth:`end_capture`; a copy
        from pageable memory or a read back to the host fails meanwhile, as on a device."""
        _capturing[self.ptr] = []

    def end_capture(self):
        return Graph(_capturing.pop(self.ptr))


class Graph:
    def __init__(self, launches):
        self.launches = launches

    def launch(self, stream=None):
        for run in self.launches:
            run()


_capturing = {}  # the launches recorded by each capturing stream, by its pointer


def _refuse_while_capturing(what):
    stream = get_current_stream()
    if stream.is_capturing():
        raise RuntimeError(
            f"cudaErrorStreamCaptureUnsupported: {what} while stream {stream.ptr:#x} captures"
        )


def ExternalStream(ptr):  # noqa: N802 - CuPy's name
    """A stream another framework owns, known by its pointer."""
    return Stream(ptr=ptr)


Stream.null = Stream(ptr=0)
_streams = [Stream.null]


def get_current_stream():
    return _streams[-1]


class MisalignedAddress(RuntimeError):
    """What a device raises for a typed access at an address its type does not divide
    (CUDA_ERROR_MISALIGNED_ADDRESS): sticky, the process's CUDA context is lost."""


_lost = []  # a launch failed as a device would: every later launch fails too


def _access_bytes(name, itemsize):
    """The widest access an entry point makes: P pairs of ``_v<P>`` (interleaved: 2P elements
    at once), else one element."""
    if "_v" not in name:
        return itemsize
    p = int(name.rsplit("_v", 1)[1])
    return p * itemsize * (2 if "_interleaved_" in name else 1)


class _Pointer:
    def __init__(self, ptr, owner=None):
        self.ptr = ptr
        self.owner = owner  # the NumPy array whose memory holds ptr


def _typed_access(what, *arrays):
    """Fail as a device does where CuPy's own kernels (copies, casts, element-wise
    operations) load or store an array's elements off their grid: CuPy's loads are typed, and
    the error is sticky (see MisalignedAddress)."""
    if _lost:
        raise MisalignedAddress(f"the CUDA context is lost since {_lost[0]}")
    for a in arrays:
        if not isinstance(a, ndarray) or a.size == 0:
            continue
        item = a.itemsize
        steps = (s for n, s in zip(a.shape, a.strides) if n > 1)
        if a.data.ptr % item or any(s % item for s in steps):
            _lost.append(f"CuPy's {what} at {a.data.ptr:#x}, {item}-byte elements")
            raise MisalignedAddress(f"CUDA_ERROR_MISALIGNED_ADDRESS: {_lost[-1]}")


def _unwrap(value, device):
    """NumPy values for an operation on ``device``: our arrays must live there; NumPy arrays
    (not scalars) are refused, as CuPy refuses them."""
    if isinstance(value, ndarray):
        if value._device != device:
            raise ValueError(
                f"array on device {value._device} used while device {device} is current"
            )
        return value._a
    if isinstance(value, np.ndarray) and value.ndim > 0:
        raise TypeError(f"Unsupported type {type(value)}: a NumPy array mixed with a CuPy one")
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _unwrap(v, device) for k, v in value.items()}
    return value


def _wrap(value):
    if isinstance(value, np.ndarray):
        return ndarray(value, _here())
    if isinstance(value, tuple):
        return tuple(_wrap(v) for v in value)
    return value


class _Interface:
    """An object NumPy views through the array interface, keeping the memory's owner."""

    __slots__ = ("__array_interface__", "owner")


class ndarray:  # noqa: N801 (CuPy's name)
    """A device array: a NumPy array and the device it lives on."""

    # What arrayrope and the tests read, copied at creation: attribute reads as cheap as
    # CuPy's, so that timing a call through the stand-in shows arrayrope's own cost
    __slots__ = ("_a", "_device", "_ptr", "shape", "strides", "dtype", "ndim", "size", "itemsize")

    def __init__(self, a, device, memptr=None, strides=None):
        if isinstance(memptr, _Pointer):  # ndarray(shape, dtype, x.data, strides=...)
            shape, dtype = tuple(a), np.dtype(device)
            view = _Interface()
            view.owner = memptr.owner
            view.__array_interface__ = {
                "data": (memptr.ptr, False), "shape": shape, "typestr": dtype.str,
                "strides": strides, "version": 3,
            }  # fmt: skip
            a, device = np.asarray(view), _here()
        elif memptr is not None:  # CuPy's ndarray(shape, dtype, memptr): a view of memory
            shape, dtype, memory = a, np.dtype(device), memptr.mem
            owner = np.frombuffer(memory.owner, np.uint8)
            start = memory.ptr + memptr.offset - owner.__array_interface__["data"][0]
            count = int(np.prod(shape))
            a = np.frombuffer(owner, dtype, count, start).reshape(shape)
            device = memory.device_id
        self._a = a
        self._device = device
        self._ptr = None
        self.shape, self.strides, self.dtype = a.shape, a.strides, a.dtype
        self.ndim, self.size, self.itemsize = a.ndim, a.size, a.itemsize

    nbytes = property(lambda self: self._a.nbytes)
    flags = property(lambda self: self._a.flags)
    device = property(lambda self: Device(self._device))

    @property
    def data(self):
        if self._ptr is None:  # read once: NumPy builds a dict to tell
            self._ptr = self._a.__array_interface__["data"][0]
        return _Pointer(self._ptr, self._a)

    def _op(self, name, *args, **kwargs):
        device = _here()
        a = _unwrap(self, device)
        return _wrap(getattr(a, name)(*_unwrap(args, device), **_unwrap(kwargs, device)))

    def get(self):
        _refuse_while_capturing("a copy to the host")
        to_host.append((self.shape, self.dtype))
        return self._a.copy()

    def set(self, arr, stream=None):
        """A host-to-device copy: queued on ``stream`` from pinned memory, else a waiting
        copy from pageable memory (recorded in ``transfers`` either way)."""
        pinned = stream is not None and _is_pinned(arr)
        if not pinned:
            _refuse_while_capturing("a copy from pageable memory")
        transfers.append((arr.shape, arr.dtype) + (("pinned",) if pinned else ()))
        _unwrap(self, _here())[...] = arr

    def item(self):
        return self.get().item()

    def all(self, *args, **kwargs):
        return self._op("all", *args, **kwargs)

    def any(self, *args, **kwargs):
        return self._op("any", *args, **kwargs)

    def reshape(self, *shape, **kw):
        return self._op("reshape", *shape, **kw)

    def astype(self, dtype, copy=True):
        if copy or np.dtype(dtype) != self.dtype:  # else CuPy returns the array itself
            _typed_access("cast", self)
        return self._op("astype", dtype, copy=copy)

    def view(self, dtype):
        return self._op("view", dtype)

    def copy(self):
        _typed_access("copy", self)
        return self._op("copy")

    def min(self):  # a 0-d device array, as CuPy's reductions give
        return ndarray(np.asarray(_unwrap(self, _here()).min()), _here())

    def max(self):
        return ndarray(np.asarray(_unwrap(self, _here()).max()), _here())

    def __getitem__(self, key):
        device = _here()
        key = _index(key, device)
        return _wrap(np.asarray(_unwrap(self, device)[key]))

    def __setitem__(self, key, value):
        _typed_access("copy", self, value)
        device = _here()
        _unwrap(self, device)[_index(key, device)] = _unwrap(value, device)

    def __len__(self):
        return len(self._a)

    def __array__(self, *args, **kwargs):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
            "construct a NumPy array explicitly."
        )

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _typed_access(ufunc.__name__, *inputs, *kwargs.get("out", ()))
        device = _here()
        result = getattr(ufunc, method)(*_unwrap(inputs, device), **_unwrap(kwargs, device))
        if "out" in kwargs:
            return kwargs["out"][0] if len(kwargs["out"]) == 1 else kwargs["out"]
        return _wrap(np.asarray(result) if np.ndim(result) == 0 else result)

    def __array_function__(self, func, kinds, args, kwargs):
        device = _here()
        return _wrap(func(*_unwrap(args, device), **_unwrap(kwargs, device)))

    __hash__ = None

    def __neg__(self):
        return np.negative(self)

    def __repr__(self):
        return f"fake_cupy.ndarray({self._a!r}, device={self._device})"


def _operator(name, reflected=False, in_place=False):
    ufunc = getattr(np, name)
    if in_place:
        return lambda self, other: ufunc(self, other, out=(self,))
    if reflected:
        return lambda self, other: ufunc(other, self)
    return lambda self, other: ufunc(self, other)


for _dunder, _ufunc in [
    ("add", "add"),
    ("sub", "subtract"),
    ("mul", "multiply"),
    ("truediv", "true_divide"),
    ("floordiv", "floor_divide"),
    ("mod", "remainder"),
]:
    setattr(ndarray, f"__{_dunder}__", _operator(_ufunc))
    setattr(ndarray, f"__r{_dunder}__", _operator(_ufunc, reflected=True))
    setattr(ndarray, f"__i{_dunder}__", _operator(_ufunc, in_place=True))
for _dunder, _ufunc in [("and", "bitwise_and"), ("or", "bitwise_or")]:
    setattr(ndarray, f"__{_dunder}__", _operator(_ufunc))
ndarray.__invert__ = lambda self: np.invert(self)
for _dunder, _ufunc in [
    ("lt", "less"),
    ("le", "less_equal"),
    ("gt", "greater"),
    ("ge", "greater_equal"),
    ("eq", "equal"),
    ("ne", "not_equal"),
]:
    setattr(ndarray, f"__{_dunder}__", _operator(_ufunc))


def _index(key, device):
    """An index for a device array: device arrays and NumPy arrays (which CuPy takes too)."""
    if isinstance(key, tuple):
        return tuple(_index(k, device) for k in key)
    if isinstance(key, ndarray):
        return _unwrap(key, device)
    return key


def _creator(func):
    """A NumPy function that makes a new array, making it on the current device."""

    def create(*args, **kwargs):
        device = _here()
        args = tuple(a._a if isinstance(a, ndarray) and a._device == device else a for a in args)
        for a in args:
            if isinstance(a, ndarray):
                raise ValueError(
                    f"array on device {a._device} used while device {device} is current"
                )
        return ndarray(np.asarray(func(*args, **kwargs)), device)

    return create


# (shape, dtype) of every host-to-device copy (with "pinned" where it was queued from pinned
# memory) and of every device-to-host copy, for the tests to count
transfers = []
to_host = []


def _asarray(a, dtype=None):
    if isinstance(a, ndarray):
        if a._device != _here():  # CuPy copies across devices
            return ndarray(a._a.astype(dtype or a.dtype), _here())
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    _refuse_while_capturing("a copy from pageable memory")
    copy = np.array(a, dtype=dtype)
    transfers.append((copy.shape, copy.dtype))
    return ndarray(copy, _here())


_pinned = []  # every pinned allocation: host memory a copy can be queued from


def _alloc_pinned_memory(nbytes):
    memory = np.zeros(nbytes, np.uint8)
    _pinned.append(memory)
    return memory


def _is_pinned(arr):
    start = arr.__array_interface__["data"][0]
    for memory in _pinned:
        base = memory.__array_interface__["data"][0]
        if base <= start and start + arr.nbytes <= base + memory.nbytes:
            return True
    return False


class Event:
    """A CUDA event: launches and copies run as they are made here, so it is done when
    recorded; a test makes events pending to model a stream that runs behind."""

    pending = False  # class-wide switch for the tests

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.recorded = False
        self.waited = False

    def record(self, stream=None):
        self.recorded = True

    @property
    def done(self):
        return self.recorded and not Event.pending

    def synchronize(self):
        self.waited = True


class UnownedMemory:
    def __init__(self, ptr, size, owner, device_id=-1):
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.offset = mem, offset


def _ascontiguousarray(a, dtype=None):
    a = _asarray(a, dtype)
    return a if a._a.flags.c_contiguous else ndarray(np.ascontiguousarray(a._a), a._device)


class _Function:
    def __init__(self, module, name):
        self.module, self.name = module, name

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        device = _here()
        if _lost:
            raise MisalignedAddress(f"the CUDA context is lost since {_lost[0]}")
        if self.module.device != device:
            raise ValueError(f"kernel of device {self.module.device} launched on device {device}")
        for i, a in enumerate(args):
            if not isinstance(a, ndarray):
                continue
            wide = _access_bytes(self.name, a.itemsize) if i in (0, 1, 3, 4) else a.itemsize
            if a.data.ptr % wide:
                _lost.append(f"{self.name}: argument {i} at {a.data.ptr:#x}, {wide}-byte access")
                raise MisalignedAddress(f"CUDA_ERROR_MISALIGNED_ADDRESS: {_lost[-1]}")
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray) or (
                not isinstance(a, ndarray) and not isinstance(a, np.generic)
            ):
                raise TypeError(f"kernel argument {i}: unsupported type {type(a)}")
            if isinstance(a, ndarray) and a._device != device:
                raise ValueError(f"kernel argument {i} is on device {a._device}, not {device}")
        self.module.launches.append(self.name)
        ptr = (stream or get_current_stream()).ptr
        self.module.streams.append(ptr)

        def run():
            host_cuda.run_kernel(self.module.library, self.name, grid, block, args, _address)

        if ptr in _capturing:
            _capturing[ptr].append(run)  # runs when the graph does, reading memory then
        else:
            run()


def _address(a):
    return a.data.ptr


class _RawModule:
    def __init__(self, library, code, options=()):
        if code != host_cuda.SOURCE:
            raise ValueError("this stand-in runs arrayrope's CUDA source only")
        self.library, self.options, self.device = library, options, _here()
        self.launches = []
        self.streams = []  # the stream each launch ran on

    def get_function(self, name):
        if name not in host_cuda.KERNEL_NAMES and name not in host_cuda.FUSED_NAMES:
            raise KeyError(name)
        return _Function(self, name)


def make(library):
    """A fresh ``cupy`` module whose kernels run through ``library`` (host_cuda)."""
    cupy = types.ModuleType("cupy")
    cupy.ndarray = ndarray
    cupy.cuda = types.SimpleNamespace(
        Device=Device,
        Stream=Stream,
        ExternalStream=ExternalStream,
        get_current_stream=get_current_stream,
        Event=Event,
        alloc_pinned_memory=_alloc_pinned_memory,
        UnownedMemory=UnownedMemory,
        MemoryPointer=MemoryPointer,
    )
    cupy.is_available = lambda: True
    modules = []

    def raw_module(code, options=()):
        module = _RawModule(library, code, options)
        modules.append(module)
        return module

    cupy.RawModule = raw_module
    cupy.modules = modules  # for the tests: which modules were built, what each launched
    cupy.transfers = transfers
    cupy.to_host = to_host
    cupy.__version__ = "0.0 (tests/fake_cupy.py)"
    cupy.cuda.runtime = types.SimpleNamespace(
        getDeviceProperties=lambda device: {"name": b"fake_cupy (host memory)"}
    )
    cupy.asarray = _asarray
    cupy.copyto = lambda dst, src, where=True: np.copyto(
        _unwrap(dst, _here()), _unwrap(src, _here()), where=_unwrap(where, _here())
    )
    cupy.ascontiguousarray = _ascontiguousarray
    for name in ("empty", "zeros", "ones", "full", "arange"):
        setattr(cupy, name, _creator(getattr(np, name)))
    for name in ("empty_like", "zeros_like", "full_like"):
        setattr(cupy, name, _creator(getattr(np, name)))
    for name in (
        "stack",
        "concatenate",
        "broadcast_to",
        "cos",
        "sin",
        "shares_memory",
        "where",
        "maximum",
    ):
        func = getattr(np, name)
        setattr(
            cupy,
            name,
            lambda *a, _f=func, **k: _wrap(_f(*_unwrap(a, _here()), **_unwrap(k, _here()))),
        )
    for name in ("float16", "float32", "float64", "int32", "int64", "uint16"):
        setattr(cupy, name, getattr(np, name))
    return cupy


def _benchmark(fn, n_repeat=10000, n_warmup=10):
    """cupyx.profiler.benchmark's shape: per-repeat times in seconds (host clock for both)."""
    for _ in range(n_warmup):
        fn()
    times = []
    for _ in range(n_repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return types.SimpleNamespace(gpu_times=np.array([times]), cpu_times=np.array(times))


@contextlib.contextmanager
def installed(library):
    """``cupy`` (and ``cupyx.profiler``) are the stand-in inside the block, with arrayrope's
    device-side caches fresh before and after (they are keyed by device id, which the real CuPy
    would share)."""

    from arrayrope import _cache
    from arrayrope.backends.cuda import _capture, _flag, _staging

    def forget():
        _cache.clear_all()  # plans, shared RoPEs, compiled modules, device arrays
        _staging._buffers.clear()  # what a process keeps for its life: new with each stand-in
        _flag._flags.clear()
        _capture._held.clear()
        _capture._held_ids.clear()
        transfers.clear()
        to_host.clear()
        _lost.clear()
        _capturing.clear()
        _pinned.clear()
        Event.pending = False

    fake = make(library)
    profiler = types.ModuleType("cupyx.profiler")
    profiler.benchmark = _benchmark
    cupyx = types.ModuleType("cupyx")
    cupyx.profiler = profiler
    stand_ins = {"cupy": fake, "cupyx": cupyx, "cupyx.profiler": profiler}
    saved = {name: sys.modules.get(name) for name in stand_ins}
    forget()
    sys.modules.update(stand_ins)
    try:
        yield fake
    finally:
        for name, module in saved.items():
            if module is None:
                del sys.modules[name]
            else:
                sys.modules[name] = module
        forget()
