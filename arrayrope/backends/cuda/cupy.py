"""CUDA C kernels compiled through CuPy (RawModule), and their launcher.

Entry points per storage dtype and pair style, built once per device and fetched by name:
``rope_<dtype>_<style>`` loads element by element, ``rope_<dtype>_<style>_v<P>`` loads P pairs
per lane as one aligned access of up to 16 bytes, where the launcher finds every row aligned
(:func:`launch_plan`). Operands are addressed from their element 0 with signed element strides,
so any leading layout (negative steps, fused QKV views, broadcast positions) runs without a copy.

Launch geometry: ``block=(32, WARPS_PER_BLOCK)``. The 32 lanes of a warp walk the pairs of one
row at a time, so neighbouring lanes touch neighbouring memory, and each warp takes
ROWS_PER_WARP consecutive rows, decoding the row coordinates once for them. q and k rows share
one grid (one launch for rotate_qk).
"""

from importlib import resources

import numpy as np

from ... import _arrays
from ..._cache import Bounded
from ..._errors import BackendUnavailableError
from .._geometry import geometry, rows, tail_mask
from . import level_arguments
from ._capture import hold
from ._flag import error_flag
from ._staging import kept, on_device

LANES = 32
WARPS_PER_BLOCK = 8
ROWS_PER_WARP = 4
ROWS_PER_BLOCK = WARPS_PER_BLOCK * ROWS_PER_WARP

_KERNELS = (resources.files(__package__) / "rope.cu").read_text()

# Storage type in the source and item size, by dtype name
_STORAGE = {
    "float32": ("float", 4),
    "float64": ("double", 8),
    "float16": ("f16_bits", 2),
    "bfloat16": ("bf16_bits", 2),
}


def _variants():
    """(name, storage type, half style, P, vector) of every entry point: per dtype and style,
    one element-wise (``rope_<dtype>_<style>``) and one per P pairs a lane loads as one access
    of at most 16 bytes (``..._v<P>``)."""
    for dtype, (ctype, size) in _STORAGE.items():
        for style in ("interleaved", "half"):
            name = f"rope_{dtype}_{style}"
            yield name, ctype, style == "half", 1, False
            elements = 1 if style == "half" else 2  # per pair and access
            for p in (1, 2, 4):
                if 1 < p * elements and p * elements * size <= 16:
                    yield f"{name}_v{p}", ctype, style == "half", p, True


def _fused_variants():
    """(name, storage type, cache storage type, half style) of the fused step's entry points:
    ``fused_<dtype>_<style>``, and ``..._fp8`` for float8 e4m3fn caches."""
    for dtype, (ctype, _) in _STORAGE.items():
        for style in ("interleaved", "half"):
            yield f"fused_{dtype}_{style}", ctype, ctype, style == "half"
            yield f"fused_{dtype}_{style}_fp8", ctype, "e4m3_bits", style == "half"


KERNEL_NAMES = tuple(v[0] for v in _variants())
FUSED_VARIANTS = tuple(_fused_variants())
FUSED_NAMES = tuple(v[0] for v in FUSED_VARIANTS)
SOURCE = (
    f"#define ROWS_PER_WARP {ROWS_PER_WARP}\n"
    + _KERNELS
    + "".join(
        f"ROPE_ENTRY({name}, {ctype}, {str(half).lower()}, {p}, {str(vector).lower()})\n"
        for name, ctype, half, p, vector in _variants()
    )
    + "".join(
        f"FUSED_ENTRY({name}, {ctype}, {cache}, {str(half).lower()})\n"
        for name, ctype, cache, half in FUSED_VARIANTS
    )
)


def require_cupy():
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is None:
        raise BackendUnavailableError(
            "backend 'cupy' needs CuPy: pip install 'arrayrope[cuda12]' (or [cuda13])"
        )
    return cupy


# No FMA contraction: every product and sum rounds on its own, as in the CPU kernels and the
# reference, so a GPU gives their bits. (CuPy appends -ftz=true to every RawModule's options;
# the source's float arithmetic is inline PTX that is never flushed, so subnormal values keep
# the CPU's bits too: see rope.cu's mul.) The kernels wait on memory, not on arithmetic.
OPTIONS = ("--std=c++14", "--fmad=false")
_modules = Bounded(16)  # per device
_functions = Bounded(256)  # per device and entry point
last_entry = None  # the entry point of the latest launch, for benchmarks and debugging


def _function(cupy, device, name):
    """Entry point ``name`` of the module on device ``device`` (an id; the current one):
    compiled once per device (all entry points together), each looked up once (a lookup is a
    driver call)."""
    function = _functions.get((device, name))
    if function is None:
        module = _modules.get(device)
        if module is None:
            module = cupy.RawModule(code=SOURCE, options=OPTIONS)
            _modules.put(device, module)
        function = _functions.put((device, name), module.get_function(name))
    return function


def _alignment(arrays):
    """The largest power of two, at most 16, dividing the byte address of every row of every
    array (the start and the strides of axes longer than 1; negative strides alike)."""
    bits = 16
    for a in arrays:
        bits |= _arrays.address(a)
        for n, s in zip(a.shape[:-1], a.strides[:-1]):
            if n > 1:
                bits |= s
    return bits & -bits


def _pairs_per_access(spec, operands, tables):
    """P of the ``_v<P>`` entry point to launch, or 0 for the element-wise one: the largest P
    whose access (P pairs, at most 16 bytes) is aligned in every row of every x and out and
    in the tables, and which leaves no lane idle where a row has 32 pairs or more."""
    itemsize = operands[0][0].itemsize
    half = spec.rotary_dim // 2
    per_pair = 1 if spec.half_style else 2  # elements of a pair in one access
    data = _alignment([a for x, out, _ in operands for a in (x, out)])
    table = _alignment(tables)
    for p in (4, 2, 1):
        if (
            p * per_pair > 1
            and p * per_pair * itemsize <= data
            and p * tables[0].itemsize <= table
            and half % p == 0
            and (p == 1 or half >= LANES * p)
        ):
            return p
    return 0


_ENTRY_PREFIX = {}  # "rope_<dtype>_<style>" by (dtype, style): dtype.name is slow to build


def launch_plan(spec, operands, tables, inverse, freqs, flag, place):
    """What one launch takes, host side: (kernel name, grid, block, args), args in the kernel's
    order: the six operand arrays, geometry g, nlead, cos, sin (``tables``, C-contiguous), the
    table's rows, pair_axis (int32), inv_freq (float64), the level tables (float64), scale,
    the error flag ``flag``, then rotary_dim, d, sign, copy_tail, n1, n2. Host arrays made once
    per frequency set (g, pair_axis, inv_freq, the level tables) pass through
    ``place(key, host)`` (host: an array, or a function that makes it), which keeps them on
    the device for :func:`launch`; the tests, which run the same source on the host, pass them
    through.

    ``freqs`` (the frequency set's ``CosSinTables``) gives the level tables of the rows past
    the table that the kernel makes for device positions; None where every position is in the
    table (a row past it would be NaN)."""
    x0 = operands[0][0]
    g = geometry(operands, flat=False)
    arrays = []
    for x, out, idx in operands:
        arrays += (x, out, idx)  # arrays pass as the address of their element 0
    if len(operands) == 1:
        arrays += arrays  # the second operand has zero rows
    n1 = rows(g, 0)
    n2 = rows(g, 1) if len(operands) == 2 else 0
    d = x0.shape[-1]
    copy_tail = tail_mask(spec.rotary_dim, operands)
    compute = np.float64 if x0.dtype == np.float64 else np.float32
    axes = spec.pair_axis
    inv_freq, levels, scale = level_arguments(spec, freqs)
    args = (
        *arrays,
        place(("g", g.shape, g.tobytes()), g),
        np.int32(g.shape[2] - 1),
        *tables,
        np.int64(tables[0].shape[0]),
        place(("axes", "int32", axes.tobytes()), lambda: axes.astype(np.int32)),
        place(("inv_freq", inv_freq.tobytes()), inv_freq),
        place(("levels", levels.shape, inv_freq.tobytes()), levels),
        np.float64(scale),
        flag,
        np.int32(spec.rotary_dim),
        np.int32(d),
        compute(-1.0 if inverse else 1.0),
        np.int32(copy_tail),
        np.int64(n1),
        np.int64(n2),
    )
    grid = ((n1 + n2 + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK,)
    p = _pairs_per_access(spec, operands, tables)
    prefix = _ENTRY_PREFIX.get((x0.dtype, spec.style))
    if prefix is None:
        prefix = _ENTRY_PREFIX[(x0.dtype, spec.style)] = f"rope_{x0.dtype.name}_{spec.style}"
    name = prefix + (f"_v{p}" if p else "")
    return name, grid, (LANES, WARPS_PER_BLOCK), args


def launch(spec, operands, cos, sin, inverse, freqs=None, capture=False):
    """Rotate one or two operands in one launch; same contract as ``backends.cpu.launch``, and
    ``freqs`` as for :func:`launch_plan`. ``capture``: the current stream is capturing a CUDA
    graph (the plan has checked the call can be captured)."""
    cupy = require_cupy()
    device = operands[0][0].device
    with device:
        device = device.id
        tables = (cupy.ascontiguousarray(cos), cupy.ascontiguousarray(sin))

        def place(key, host):
            return on_device(cupy, device, key, host)

        flag = error_flag(cupy, device)[0]
        name, grid, block, args = launch_plan(spec, operands, tables, inverse, freqs, flag, place)
        if capture:  # arrayrope's arrays the graph reads: kept positions, and from args[6] on
            # g, the tables, pair axes, frequencies, level tables and the flag (the rest are
            # scalars)
            hold(cupy, [a for a in (args[2], args[5]) if kept(a)] + list(args[6:]))
        _function(cupy, device, name)(grid=grid, block=block, args=args)
    global last_entry
    last_entry = name


def fused_plan(q, out, k, v, k_cache, v_cache, slots, rows, cos, sin, block, layout, spec,
               q_weight, k_weight, numbers, place):  # fmt: skip
    """What the fused step's launch takes, host side: (kernel name, grid, block, args), args
    in the kernel's order (``FUSED_ENTRY`` in rope.cu): the six operands, the geometry g (their
    element strides, through ``place`` as for :func:`launch_plan`), slots, rows, the tables,
    each weight and its length (0: no norm), eps and the caches' multipliers (``numbers``),
    then rotary_dim, d, hq, hkv, the block size and the token count. The caches share one
    dtype (the caller checks)."""
    n, hq, d = q.shape
    cache_axes = (0, 1, 2) if layout == "NHD" else (0, 2, 1)  # block, offset, head
    strides = []
    for a, axes in ((q, (0, 1)), (out, (0, 1)), (k, (0, 1)), (v, (0, 1)),
                    (k_cache, cache_axes), (v_cache, cache_axes)):  # fmt: skip
        strides += [a.strides[i] // a.itemsize for i in axes]
    g = np.array(strides, np.int64)
    compute = np.float64 if q.dtype == np.float64 else np.float32
    fp8 = "_fp8" if k_cache.dtype != q.dtype else ""
    name = f"fused_{q.dtype.name}_{spec.style}{fp8}"
    args = (
        q, out, k, v, k_cache, v_cache, place(("g", g.tobytes()), g), slots, rows, cos, sin,
        q_weight, np.int32(q_weight.shape[0]), k_weight, np.int32(k_weight.shape[0]),
        compute(numbers[0]),
        compute(numbers[1]), compute(numbers[2]), np.int32(spec.rotary_dim), np.int32(d),
        np.int32(hq), np.int32(k.shape[1]), np.int64(block), np.int64(n),
    )  # fmt: skip
    grid = ((n * (hq + k.shape[1]) + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK,)
    return name, grid, (LANES, WARPS_PER_BLOCK), args


def launch_fused(q, out, k, v, k_cache, v_cache, slots, rows, cos, sin, block, layout, spec,
                 q_weight, k_weight, numbers):  # fmt: skip
    """RoPE.rotate_into_cache's step on CuPy arrays of one device, in one launch on the current
    stream; the caller has checked every argument (see _kv_cache). A warp per head's row: q's
    rows into out, k's into the key cache, each carrying v's row into the value cache."""
    cupy = require_cupy()
    with q.device:
        device = q.device.id

        def place(key, host):
            return on_device(cupy, device, key, host)

        name, grid, block_shape, args = fused_plan(
            q, out, k, v, k_cache, v_cache, slots, rows, cos, sin, block, layout, spec,
            q_weight, k_weight, numbers, place,
        )  # fmt: skip
        _function(cupy, device, name)(grid=grid, block=block_shape, args=args)
    global last_entry
    last_entry = name
