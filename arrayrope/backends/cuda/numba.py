"""numba.cuda kernels and their launcher.

The same maths as the CuPy kernels, written independently in Python, for users who want no CuPy
kernels and as a second GPU implementation for the tests to compare. Under Numba's CUDA simulator
(NUMBA_ENABLE_CUDASIM=1) the same kernels run on the CPU, which is how CI tests them.

Operands are flat 1-D views with element offsets (``backends._geometry``). Launch geometry:
``block=(32, WARPS_PER_BLOCK)``, warp lanes across the pairs of a row, ROWS_PER_WARP rows per
warp, element by element. The CuPy kernels (``backends.cuda.cupy``) add vector accesses and
load all of a warp's rows before storing any.
"""

import math

import numpy as np

from ... import _arrays
from ..._errors import BackendUnavailableError, RopeValueError
from .._geometry import flat_view, geometry, rows, tail_mask
from . import level_arguments
from ._flag import error_flag
from ._staging import on_device

try:
    # A module global, not a closure variable: the simulator swaps the kernels' global ``cuda``
    # for its thread-aware fake. This module itself is imported only when the backend is used.
    from numba import cuda
except ImportError:
    cuda = None

LANES = 32
WARPS_PER_BLOCK = 8
ROWS_PER_WARP = 4
ROWS_PER_BLOCK = WARPS_PER_BLOCK * ROWS_PER_WARP


def require_numba_cuda():
    if cuda is None:
        raise BackendUnavailableError(
            "backend 'numba-cuda' needs numba-cuda: pip install 'arrayrope[cuda12]' (or [cuda13])"
        )
    return cuda


def _bit_casts():
    """float32 <-> uint32 reinterpretation: libdevice on a GPU, NumPy views in the simulator."""
    if _simulated():

        def as_float(bits):
            return np.uint32(bits).view(np.float32)

        def as_bits(value):
            return np.float32(value).view(np.uint32)

        return as_float, as_bits
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def as_float(bits):
        return libdevice.int_as_float(np.int32(bits))

    @cuda.jit(device=True, inline=True)
    def as_bits(value):
        return np.uint32(libdevice.float_as_int(value))

    return as_float, as_bits


def _products():
    """(mul64, mul32): float64 and float32 products rounded on their own. On a GPU they are
    libdevice's round-to-nearest products, which NVVM never fuses with a following sum: NVVM
    contracts a * b + c into an FMA by default (numba-cuda does not turn that off), which
    moves a last bit from the CPU's and, in the rows past the table, drops the rounding of the
    float64 angle m * theta that the contract rotates by. Plain products in the simulator."""
    if _simulated():

        def mul(a, b):
            return a * b

        return mul, mul
    from numba.cuda import libdevice

    return libdevice.dmul_rn, libdevice.fmul_rn


def _simulated():
    from numba import config

    return bool(config.ENABLE_CUDASIM)


_kernels = {}  # finite store: compiled kernels by variant


def _kernel(bf16_bits, half_style, compute):
    """The kernel for one storage kind, pair style and compute dtype, built once."""
    key = (bf16_bits, half_style, compute)
    if key in _kernels:
        return _kernels[key]
    as_float, as_bits = _bit_casts()
    mul64, mul32 = _products()

    if bf16_bits:

        @cuda.jit(device=True, inline=True)
        def load(a, i):
            return as_float(np.uint32(a[i]) << np.uint32(16))

        @cuda.jit(device=True, inline=True)
        def store(a, i, value):
            u = as_bits(value)
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # nan stays a quiet nan
                a[i] = np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
            else:  # round half to even on the 16 dropped bits
                odd = (u >> np.uint32(16)) & np.uint32(1)
                a[i] = np.uint16((u + np.uint32(0x7FFF) + odd) >> np.uint32(16))

    else:
        # float16 is widened here and narrowed (half to even) by the store; half types compute
        # in float32, float64 in float64.
        @cuda.jit(device=True, inline=True)
        def load(a, i):
            return compute(a[i])

        @cuda.jit(device=True, inline=True)
        def store(a, i, value):
            a[i] = value

    exact = compute == np.float64
    mul = mul64 if exact else mul32  # products in the compute type

    @cuda.jit(device=True, inline=True)
    def past_table(p, j, inv_freq, levels, scale):
        """cos and sin of pair j at position p in [0, 2**31) past the table: the CPU's formula
        (backends/cpu/_angles.py) from the level tables ``levels`` (2, LEVEL_ROWS, n_pairs),
        rounded once to the compute type; no cos or sin. Every product is mul64's (see
        _products): the CPU's bits."""
        h = p >> 22
        k = (p >> 11) & 2047
        low = p & 2047
        theta = inv_freq[j]
        c2, s2 = levels[0, 2048 + k, j], levels[1, 2048 + k, j]
        c3, s3 = levels[0, low, j], levels[1, low, j]
        fm, fk, fl = np.float64(p), np.float64(k), np.float64(low)
        if h == 0:
            cc = mul64(c2, c3) - mul64(s2, s3)
            ss = mul64(s2, c3) + mul64(c2, s3)
            delta = (mul64(fm, theta) - mul64(fk, mul64(theta, 2048.0))) - mul64(fl, theta)
        else:
            c1, s1 = levels[0, 4096 + h, j], levels[1, 4096 + h, j]
            c12 = mul64(c1, c2) - mul64(s1, s2)
            s12 = mul64(s1, c2) + mul64(c1, s2)
            cc = mul64(c12, c3) - mul64(s12, s3)
            ss = mul64(s12, c3) + mul64(c12, s3)
            a = mul64(np.float64(h), mul64(theta, 4194304.0))
            delta = mul64(fm, theta) - a
            delta = (delta - mul64(fk, mul64(theta, 2048.0))) - mul64(fl, theta)
        if exact:  # float64: to second order in delta
            half = mul64(mul64(0.5, delta), delta)
            c = mul64(cc - (mul64(ss, delta) + mul64(cc, half)), scale)
            return compute(c), compute(mul64(ss + (mul64(cc, delta) - mul64(ss, half)), scale))
        c = mul64(cc - mul64(ss, delta), scale)
        return compute(c), compute(mul64(ss + mul64(cc, delta), scale))

    @cuda.jit
    def rope_kernel(
        x1,
        o1,
        i1,
        x2,
        o2,
        i2,
        g,
        cos,
        sin,
        pair_axis,
        inv_freq,
        levels,
        scale,
        flagged,
        rotary_dim,
        d,
        sign,
        copy_tail,
        n1,
        n2,
    ):
        # Each warp takes ROWS_PER_WARP consecutive rows: the first row's coordinates come from
        # divisions (Python-semantics integer division, dozens of instructions), the next ones
        # from stepping the innermost axis until it wraps (k's rows begin at such a wrap).
        first = (cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y) * ROWS_PER_WARP
        nlead = g.shape[2] - 1
        half = rotary_dim // 2
        t = 0
        xb = ob = pb = inner = inner_n = xs = os_ = ps = axis_stride = 0
        x, o, idx = x1, o1, i1
        for r in range(ROWS_PER_WARP):
            row = first + r
            if row >= n1 + n2:
                return
            if r == 0 or inner == inner_n:
                t = 0 if row < n1 else 1
                x = x1 if t == 0 else x2
                o = o1 if t == 0 else o2
                idx = i1 if t == 0 else i2
                xb = g[t, 1, nlead]
                ob = g[t, 2, nlead]
                pb = g[t, 3, nlead]
                rem = row - t * n1
                for ax in range(nlead - 1, -1, -1):
                    n = g[t, 0, ax]
                    i = rem % n
                    rem //= n
                    xb += i * g[t, 1, ax]
                    ob += i * g[t, 2, ax]
                    pb += i * g[t, 3, ax]
                    if ax == nlead - 1:
                        inner = i
                inner_n = g[t, 0, nlead - 1]
                xs = g[t, 1, nlead - 1]
                os_ = g[t, 2, nlead - 1]
                ps = g[t, 3, nlead - 1]
                axis_stride = g[t, 0, nlead]
            j = cuda.threadIdx.x
            while j < half:
                p = idx[pb + pair_axis[j] * axis_stride]
                if p >= 0 and p < cos.shape[0]:
                    c = cos[p, j]
                    s = sin[p, j] * sign
                elif p < 0 or p >= 2147483648:  # invalid: NaN rows, and the error flag
                    flagged[0] = 1
                    c = s = compute(math.nan)
                elif scale != scale:  # no level tables: every position was in the table
                    c = s = compute(math.nan)
                else:  # past the table: the level tables' rows, as on the CPU
                    c, s = past_table(p, j, inv_freq, levels, scale)
                    s = s * sign
                if half_style:
                    ia = j
                    ib = j + half
                else:
                    ia = 2 * j
                    ib = 2 * j + 1
                a = load(x, xb + ia)
                b = load(x, xb + ib)
                store(o, ob + ia, mul(a, c) - mul(b, s))
                store(o, ob + ib, mul(b, c) + mul(a, s))
                j += cuda.blockDim.x
            if (copy_tail >> t) & 1:  # operand t's tail, where its out is not its x
                j = rotary_dim + cuda.threadIdx.x
                while j < d:
                    o[ob + j] = x[xb + j]
                    j += cuda.blockDim.x
            inner += 1
            xb += xs
            ob += os_
            pb += ps

    _kernels[key] = rope_kernel
    return rope_kernel


def launch(spec, operands, cos, sin, inverse, freqs=None, capture=False):
    """Rotate one or two operands in one launch; same contract as ``backends.cpu.launch``, and
    ``freqs`` as for ``backends.cuda.cupy.launch_plan``: positions past the table are computed
    from it, invalid ones give NaN rows and set the device's error flag. (``capture`` is never
    true here: the plan refuses numba-cuda calls during graph capture.)

    Operands are CuPy arrays on a GPU, or NumPy arrays under the CUDA simulator, where an
    invalid position raises at once (nothing is pending).
    """
    require_numba_cuda()
    x0 = operands[0][0]
    if _arrays.is_host(x0):
        # Host arrays (the simulator): each distinct buffer goes over once and comes back once.
        # Left to the kernel call, the same buffer passed in two slots would be copied back
        # twice, the stale copy last.
        moved = {}
        stream = 0

        def to_device(a):
            if id(a) not in moved:
                moved[id(a)] = (a, cuda.to_device(a))
            return moved[id(a)][1]

        def kept(key, a):
            return to_device(a)

        flag = np.zeros(1, np.int32)
    else:
        import cupy

        moved = None
        to_device = cupy.asarray  # the operands and tables are on the device already
        # CuPy's current stream, where everything else of the call was queued
        stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)

        device = x0.device.id

        def kept(key, a):  # host arrays made once: copied once per device, not per call
            return on_device(cupy, device, key, a)

        flag = error_flag(cupy, device)[0]

    g = geometry(operands, flat=True)
    bf16_bits = x0.dtype.itemsize == 2 and x0.dtype != np.float16
    args, written = [], []
    for x, out, idx in operands:
        xf = flat_view(x)[0]
        of = xf if out is x else flat_view(out)[0]
        if bf16_bits:
            xf = xf.view(np.uint16)
            of = xf if out is x else of.view(np.uint16)
        args += (to_device(xf), to_device(of), to_device(flat_view(idx)[0]))
        written.append(of)
    if len(operands) == 1:
        args += args  # the second operand has zero rows
    n1 = rows(g, 0)
    n2 = rows(g, 1) if len(operands) == 2 else 0
    d = x0.shape[-1]
    compute = np.float64 if x0.dtype == np.float64 else np.float32
    kernel = _kernel(bf16_bits, spec.style == "half", compute)
    copy_tail = tail_mask(spec.rotary_dim, operands)
    blocks = (n1 + n2 + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK
    inv_freq, levels, scale = level_arguments(spec, freqs)
    flag_arg = to_device(flag)
    arrays = (
        *args,
        kept(("g", g.shape, g.tobytes()), g),
        to_device(cos),
        to_device(sin),
        kept(("axes", "int64", spec.pair_axis.tobytes()), spec.pair_axis),
        kept(("inv_freq", inv_freq.tobytes()), inv_freq),
        kept(("levels", levels.shape, inv_freq.tobytes()), levels),
    )
    kernel[(blocks,), (LANES, WARPS_PER_BLOCK), stream](
        *arrays,
        np.float64(scale),
        flag_arg,
        np.int64(spec.rotary_dim),
        np.int64(d),
        compute(-1.0 if inverse else 1.0),
        np.int64(copy_tail),
        np.int64(n1),
        np.int64(n2),
    )
    if moved is not None:
        for of in written:
            moved[id(of)][1].copy_to_host(of)
        flag_arg.copy_to_host(flag)
        if flag[0]:
            raise RopeValueError("pos holds values that are negative or 2**31 or more")
