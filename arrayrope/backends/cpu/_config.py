"""The CPU backend's switches and thread policy.

The environment is read once, into one :class:`Config`; plans read it when they are built, and
tests change it through :func:`override`, which also drops every plan built under the old one.
The facts of the machine that code generation depends on (streaming stores, F16C, the vector
width, AVX512-BF16, AVX512BW's permutes) are constants of the process, not switches.
"""

import contextlib
import dataclasses
import os
import platform
import threading

import numba
from llvmlite import binding as ll
from numba.core import codegen

from ... import _cache


def _last_level_cache(default=32 << 20):
    """The size of the CPU's largest cache in bytes (Linux sysfs), or ``default``."""
    sizes = []
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            break
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * scale if text.rstrip("KM").isdigit() else 0)
    return max(sizes, default=0) or default


# The most last-level cache a process counts on per CPU it may run on. A virtual machine's sysfs
# reports the whole socket's cache, shared with tenants it cannot see (480 MiB on a 2-CPU VM,
# where streaming stores write results of a few tens of MiB faster than plain ones); a 2-CPU VM
# with a 32 MiB cache keeps all of it.
_CACHE_PER_CPU = 16 << 20


def _cache_share():
    """The bytes of the last-level cache this process can count on: its size, at most
    _CACHE_PER_CPU per CPU the process may run on."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux, or the affinity cannot be read
        cpus = os.cpu_count() or 1
    return min(_last_level_cache(), cpus * _CACHE_PER_CPU)


@dataclasses.dataclass(frozen=True)
class Config:
    """Thresholds of the launch policy (see the README's Configuration section)."""

    # Inputs with fewer elements run on one thread: a parallel launch costs microseconds and can
    # stall for milliseconds after an idle gap, more than the whole work of a decode step.
    serial_below: int
    # The one-thread row kernel (no flat views, no geometry) takes inputs below this many
    # elements. With two threads the parallel kernel gains less, so it takes over later.
    small_below: int
    # Outputs of at least this many bytes, not written in place, take streaming stores: a plain
    # store first reads each line it writes, a third stream of memory traffic. Smaller results
    # may still be in cache when they are used next, which streaming would forfeit. Calls whose
    # inputs come to this many bytes (in place too) ask for each row's input ahead (see
    # _direct._AHEAD_BYTES); the fused step (rotate_into_cache) asks for its inputs ahead where
    # they are this large, and streams its results and cache rows as rotate does. The vector
    # steps' 2-byte results do both from a multiple of it (see streams_from).
    stream_above: int
    # Aligned outputs below stream_above, arrays rotated in place, and outputs of any size off
    # the 16-byte grid take the direct path's vector loop with plain stores (those whose rows
    # are on the grid and pair blocks off it, in chunks on the grid); off, they take the
    # general row loop. Outputs of stream_above bytes or more whose rows are on the grid
    # take the direct path either way (streaming from streams_from's size), and positions past
    # the cache take the direct path either way (see launch_filled), except half-style rows of
    # a 2-byte type with more rotary elements than a paired row holds (see cpu._chunks_hold).
    vector_rows: bool

    @classmethod
    def from_environment(cls, environ=os.environ):
        serial_below = _count(environ, "ARRAYROPE_SERIAL_BELOW", "elements", 1 << 16)
        factor = 4 if numba.config.NUMBA_NUM_THREADS <= 2 else 1
        return cls(
            serial_below=serial_below,
            small_below=factor * serial_below,
            stream_above=_count(environ, "ARRAYROPE_STREAM_ABOVE", "bytes", _cache_share() // 2),
            vector_rows=True,
        )


def _count(environ, name, unit, default):
    """The whole number >= 0 that the environment variable ``name`` holds, or ``default``."""
    text = environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a whole number of {unit} >= 0, got {text!r}")
    return value


CONFIG = Config.from_environment()

# Results of 2-byte elements (float16, bfloat16) that the vector steps write (the direct path, the
# fused step) stream, and their calls ask for rows ahead, from this many times stream_above. Those
# streaming steps take more instructions than their plain ones (results stored in pieces: see
# _simd._store_streaming; bfloat16 rounded without AVX512-BF16's instruction), which the memory
# traffic they save repays only once the results alone fill the cache share (twice stream_above's
# default): below that, plain stores, which also leave the results in cache, are the faster, and
# so are calls that leave the prefetching to the CPU. Rows written in chunks on the grid or out of
# a scratch block (CHUNKED, SCRATCH) stream from stream_above itself: their plain stores gained
# there only at its smallest sizes, and lost from twice it on.
HALF_STREAM_FACTOR = 2


def streams_from(itemsize):
    """The bytes of results (or of inputs, where a call asks for rows ahead) of
    ``itemsize``-byte elements from which the vector steps take streaming stores:
    Config.stream_above, times HALF_STREAM_FACTOR for the 2-byte types."""
    return CONFIG.stream_above * (HALF_STREAM_FACTOR if itemsize == 2 else 1)


# Code generation facts, fixed for the process.
STREAMING = platform.machine().lower() in ("x86_64", "amd64")
SOFT_F16 = os.environ.get("ARRAYROPE_SOFT_F16", "0") != "0"
# With F16C (every x86-64 since 2013) LLVM's half conversions are single vector instructions
# (vcvtph2ps/vcvtps2ph, round half to even). Without it LLVM would call a runtime helper that
# Numba's JIT may not link, so other CPUs take bit arithmetic (see _convert).
HARDWARE_F16 = not SOFT_F16 and "+f16c" in ll.get_host_cpu_features().flatten()


def _vector_bytes():
    """The widest step of the direct path's vector loop: a 64-byte step (a zmm register of
    float32) where the CPU has AVX-512, 32 bytes otherwise. ``ARRAYROPE_VECTOR_BYTES`` (32 or 64)
    forces one, for tests: LLVM splits a vector wider than the hardware's into legal pieces, so
    either width runs anywhere."""
    forced = os.environ.get("ARRAYROPE_VECTOR_BYTES")
    if forced is not None:
        if forced not in ("32", "64"):
            raise ValueError(f"ARRAYROPE_VECTOR_BYTES must be 32 or 64, got {forced!r}")
        return int(forced), True
    features = ll.get_host_cpu_features().flatten()
    return (64 if "+avx512f" in features and "+avx512bw" in features else 32), False


VECTOR_BYTES, _FORCED_WIDTH = _vector_bytes()


def _compiled_features():
    """The CPU features the kernels may rely on: NUMBA_CPU_FEATURES where set, else the host's
    less any NUMBA_ENABLE_AVX=0 turns off (as Numba compiles for them), and none where
    NUMBA_CPU_NAME is set without features (a named CPU, say for a portable cache, is taken to
    have only what its name implies, which this does not look up)."""
    if numba.config.CPU_FEATURES is not None:
        return numba.config.CPU_FEATURES.split(",")
    if numba.config.CPU_NAME:
        return []
    return codegen.get_host_cpu_features().split(",")


# The vector steps that store bfloat16 results plainly, and paired rows (see PAIRED_ROWS) with
# either kind of store, round them with AVX512-BF16's vcvtne2ps2bf16 (see _simd._bf16_two) where
# the steps are 64 bytes wide and Numba compiles for a CPU that has it.
BF16_INSTRUCTION = STREAMING and VECTOR_BYTES == 64 and "+avx512bf16" in _compiled_features()
# The half style's rows with pair blocks off the 16-byte grid compute each pair once and place
# the results with AVX-512's two-register permutes (see _paired.paired_row) where the steps are
# 64 bytes wide and Numba compiles for AVX512BW.
PAIRED_ROWS = STREAMING and VECTOR_BYTES == 64 and "+avx512bw" in _compiled_features()
# Streaming stores of 2-byte results go in 32-byte pieces where Numba compiles for AVX (the
# pieces pass through inline assembly, which then needs a 32-byte register), else in 16-byte
# ones (see _simd._store_streaming).
WIDE_PIECES = STREAMING and "+avx" in _compiled_features()
# Disk cache of compiled kernels. Off when the software float16 path or a vector width is
# forced: Numba's cache key does not see those switches, and would hand back kernels built for
# the others.
DISK_CACHE = (
    os.environ.get("ARRAYROPE_NUMBA_CACHE", "1") != "0" and not SOFT_F16 and not _FORCED_WIDTH
)


@contextlib.contextmanager
def override(**changes):
    """Run with some of :class:`Config`'s fields changed (tests); plans built before or inside
    are dropped, so that each is built under the config in force (cos/sin tables are kept:
    see _cache)."""
    global CONFIG
    saved = CONFIG
    CONFIG = dataclasses.replace(saved, **changes)
    _cache.clear_all(config_change=True)
    try:
        yield CONFIG
    finally:
        CONFIG = saved
        _cache.clear_all(config_change=True)


# GNU OpenMP, Numba's "omp" threading layer, does not survive fork(): Numba kills (SIGTERM) a
# forked child that starts a parallel region after its parent started one. Forked children are
# common (PyTorch DataLoader workers, multiprocessing pools on Linux), so a child forked after
# that runs every kernel on one thread. TBB and workqueue have no such limit.
_forked = False


def _after_fork_in_child():
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# Numba's thread count as the process started (NUMBA_NUM_THREADS, else the CPUs): where it is
# one, a parallel kernel would run its tasks one after another on one thread, after a launch
# that costs more than a small call's rotation.
_ONE_THREAD = numba.config.NUMBA_NUM_THREADS == 1


def threads_usable():
    """Whether this process may launch a parallel kernel: False where Numba has one thread, and
    in a child forked from a process that had started Numba's OpenMP layer."""
    if _ONE_THREAD:
        return False
    if not _forked:
        return True
    try:
        return numba.threading_layer() != "omp"
    except ValueError:  # no parallel region ran before the fork: the child may start one
        return True


_launch_lock = threading.Lock()
_layer = None


def run_parallel(kernel, *args):
    """``kernel(*args)`` for a parallel kernel. Numba's workqueue threading layer, its fallback
    where neither TBB nor OpenMP loads, aborts the process when two threads launch at once
    (Dask's threaded scheduler does), so there launches take turns. The layer is known after
    the first launch."""
    global _layer
    if _layer is None or _layer == "workqueue":
        with _launch_lock:
            result = kernel(*args)
            _layer = numba.threading_layer()
        return result
    return kernel(*args)
