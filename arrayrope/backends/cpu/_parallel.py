"""Parallel launches of the general path: rows split into tasks, each a call of one of the
one-thread kernels of _rows, on Numba's threads.
"""

import numba
import numpy as np
from numba import config, njit, prange, types
from numba.core import cgutils
from numba.core.errors import NumbaError
from numba.extending import intrinsic

from ..._cache import Bounded
from ._config import DISK_CACHE, run_parallel
from ._rows import _STREAM_BLOCK_BYTES

# Rows per parallel task. Numba hands each thread an equal share of the tasks, in order, so more
# tasks than threads balance nothing by themselves; each costs its call and index decoding.
# Sixteen per thread, of equal size, keep the shares within one task (a sixteenth) of each
# other.
_MIN_TASK_ROWS = 32
_MAX_TASKS = min(256, 16 * config.NUMBA_NUM_THREADS)


def scratch_blocks(tasks, rows, d, dtype, streaming):
    """The scratch blocks of a launch: one per task, of whole rows of ``d`` elements of o's
    ``dtype``, where ``streaming`` (SCRATCH); else empty. A parallel launch of ``rows`` rows
    has ``tasks`` None: as many tasks as split them evenly."""
    if tasks is None:
        chunk = max(_MIN_TASK_ROWS, -(-rows // _MAX_TASKS))
        tasks = -(-rows // chunk)
    block = max(1, _STREAM_BLOCK_BYTES // (d * np.dtype(dtype).itemsize)) if streaming else 0
    return np.empty((tasks, block * d), dtype)


@intrinsic
def _function_at(typingctx, kernel_type, address):
    """The first-class function of type ``kernel_type`` whose C wrapper is at ``address``."""
    fnty = kernel_type.instance_type

    def codegen(context, builder, signature, args):
        function = cgutils.create_struct_proxy(fnty)(context, builder)  # zero-filled
        function.c_addr = builder.inttoptr(args[1], context.get_value_type(types.voidptr))
        return function._getvalue()

    return fnty(kernel_type, address), codegen


@njit(cache=DISK_CACHE, parallel=True)
def rotate_parallel(
    kernel_type, address, x1, o1, i1, x2, o2, i2, g, cos, sin, seg, rotary_dim, d, half, inv,
    copy_tail, scratch, total,
):  # fmt: skip
    """The parallel entry point: rows 0..total-1 split into one task per scratch block, each a
    call of the kernel (a one-thread kernel of _rows, with the same arguments and its task's
    block). The kernel arrives as the address of its C wrapper and its Numba type (see
    :func:`launch_parallel`): this compiles once per argument types for all of them, no
    kernel's code is compiled into it, and the call costs no Python (a function object passed
    as such would be asked for its address and signature on every call)."""
    kernel = _function_at(kernel_type, address)
    n = scratch.shape[0]
    for task in prange(n):
        t = np.int64(task)  # a prange index is unsigned; the kernel takes int64
        kernel(
            x1, o1, i1, x2, o2, i2, g, cos, sin, seg, rotary_dim, d, half, inv, copy_tail,
            scratch[t], total * t // n, total * (t + 1) // n,
        )  # fmt: skip


# (kernel, the Numba fingerprints of the arguments) -> (rotate_parallel's entry point for those
# types, the kernel's Numba type, the address of its C wrapper)
_parallel_entries = Bounded(256)
# The key is the Numba dispatcher's own type key of each argument: about a microsecond for a
# launch's arguments, where numba.typeof of each would cost fifty.
try:
    from numba._dispatcher import compute_fingerprint as _type_key
except ImportError:  # not public API: numba.typeof is the documented equivalent
    _type_key = numba.typeof


def _plain_entry(kernel):
    """The fallback where a kernel's C wrapper cannot be reached (see launch_parallel): a
    parallel entry point of its own with ``kernel`` compiled into it (not cached on disk, and
    compiled per kernel: slower to start, the same speed once compiled)."""

    @njit(parallel=True)
    def entry(
        x1, o1, i1, x2, o2, i2, g, cos, sin, seg, rotary_dim, d, half, inv, copy_tail, scratch,
        total,
    ):  # fmt: skip
        n = scratch.shape[0]
        for task in prange(n):
            t = np.int64(task)
            kernel(
                x1, o1, i1, x2, o2, i2, g, cos, sin, seg, rotary_dim, d, half, inv, copy_tail,
                scratch[t], total * t // n, total * (t + 1) // n,
            )  # fmt: skip

    return entry


# Whether launches reach the kernels through their C wrappers (Numba internals: the compiled
# overload's library and wrapper name, known to work with Numba 0.68); False forces the
# fallback (tests), and it is set False when those internals are not found.
FUNCTION_POINTERS = True
_plain_entries = {}  # finite store: by kernel, one of _rows.kernels()


def _pointer_entry(kernel, args, scratch):
    arg_types = tuple(numba.typeof(a) for a in args)
    sig = types.void(*arg_types[:-1], numba.typeof(scratch[0]), types.int64, types.int64)
    kernel.compile(sig.args)
    compiled = kernel.overloads[sig.args]
    address = compiled.library.get_pointer_to_function(compiled.fndesc.llvm_cfunc_wrapper_name)
    kernel_type = types.FunctionType(sig)
    entry_types = (numba.typeof(kernel_type), types.uint64, *arg_types, types.int64)
    return rotate_parallel.compile(entry_types), kernel_type, address


def launch_parallel(kernel, args, scratch, total):
    """``rotate_parallel`` with ``kernel`` over rows 0..total-1 (``args``: the kernel's
    arguments before the scratch block; ``scratch``: one block per task). The entry point for
    the arguments' types is compiled, or loaded from the disk cache, the first time."""
    global FUNCTION_POINTERS
    args = (*args, scratch)
    if FUNCTION_POINTERS:
        key = (kernel, tuple(map(_type_key, args)))
        found = _parallel_entries.get(key)
        if found is None:
            try:
                found = _parallel_entries.put(key, _pointer_entry(kernel, args, scratch))
            except (AttributeError, KeyError, NumbaError):  # the internals moved
                FUNCTION_POINTERS = False
        if found is not None:
            entry, kernel_type, address = found
            run_parallel(entry, kernel_type, address, *args, total)
            return
    entry = _plain_entries.get(kernel)
    if entry is None:
        entry = _plain_entries.setdefault(kernel, _plain_entry(kernel))
    run_parallel(entry, *args, total)
