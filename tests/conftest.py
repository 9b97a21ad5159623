"""Shared fixtures and options; the oracles and tolerances (``oracles.py``) re-exported."""

import contextlib
import os
import shutil
import subprocess
import sys
import time

# pytest -n runs several processes on the same cores, each with OpenMP threads (Numba's omp
# layer, PyTorch's): idle ones spin by default and take the cores the other processes need.
# Read when the OpenMP runtime starts, so set here, before anything imports Numba or PyTorch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Without a GPU, numba.cuda kernels run under Numba's CUDA simulator. The switch is read when
# Numba is first imported, so it is set here, before any test module imports it.
GPU_PRESENT = os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None
if not GPU_PRESENT:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 tests need ml_dtypes")

from oracles import (  # noqa: E402, F401  (re-exported to the test modules)
    ABS_TOL,
    BF16,
    DTYPES,
    REL_TOL,
    assert_matches,
    bits,
    default_positions,
    inv_freq,
    matrix_oracle,
    oracle,
    poisoned,
    random_array,
)


def run_launcher(launch, rope, xs, pos=None, *, inverse=False, outs=None, xp=np):
    """Rotate ``xs`` through one backend's ``launch`` on the API's own general plan (positions,
    tables, operands the kernels can address), for launchers the API does not route these
    arrays to: numba.cuda on NumPy arrays under the simulator, the CUDA C source's host build."""
    from arrayrope import _arrays, _plan, _positions

    outs = tuple(xp.empty_like(x) for x in xs) if outs is None else tuple(outs)
    kind, value = _positions.resolve(pos, rope.n_axes)
    plan = _plan.GeneralPlan(rope._engine, xs, outs, kind, "numba", _arrays.family(xs[0]))
    plan.launch = launch
    plan.launch_filled = None  # positions past the cache, too, through ``launch``
    return plan.run(tuple(xs), value, inverse, outs, None)


@pytest.fixture
def cpu_config():
    """``cpu_config(**changes)`` changes the CPU backend's launch thresholds for the rest of
    the test (see ``arrayrope.backends.cpu._config.Config``); plans built under other values
    are dropped on the way in and out."""
    from arrayrope.backends.cpu import _config

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(_config.override(**changes))


settings.register_profile(
    "default", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "slow", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="run long hypothesis searches")
    parser.addoption(
        "--seed",
        type=int,
        default=None,
        help="seed of the random inputs (the rng fixture and the fuzz workers); a fresh one "
        "per run by default, printed in the header and beside every failure",
    )


_SEED = pytest.StashKey()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Under ``-n``, workers steal work rather than take fixed shares: a few tests run for a
    minute (the guard-page routes), and with fixed shares one of them ends the run alone."""
    if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
        config.option.dist = "worksteal"


_WARMED = pytest.StashKey()


def _warm_kernels(config):
    """Under ``-n``, before the workers start: the common kernel variants compiled into the
    disk cache by one process per worker, each on its share of the dtypes. Each worker would
    otherwise compile what it meets, and two that meet a variant at once both compile it."""
    workers = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or not workers or config.option.collectonly:
        return None
    if os.environ.get("ARRAYROPE_NUMBA_CACHE") == "0":
        return None
    workers = workers if isinstance(workers, int) else os.cpu_count() or 1
    dtypes = ["float16", "bfloat16", "float32", "float64"]
    shares = [dtypes[i :: min(workers, 4)] for i in range(min(workers, 4))]
    start = time.perf_counter()
    processes = [
        subprocess.Popen([sys.executable, "-m", "arrayrope", "warmup", *share],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for share in shares
    ]  # fmt: skip
    for process in processes:
        process.wait()
    return time.perf_counter() - start


def pytest_configure(config):
    config.stash[_WARMED] = _warm_kernels(config)
    settings.load_profile("slow" if config.getoption("--slow") else "default")
    seed = config.getoption("--seed")
    config.stash[_SEED] = (
        seed if seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    )


def pytest_report_header(config):
    lines = [f"arrayrope random inputs: --seed {config.stash[_SEED]}"]
    warmed = config.stash.get(_WARMED, None)
    if warmed is not None:
        lines.append(f"arrayrope kernels: common variants in the disk cache after {warmed:.1f} s")
    return lines


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and "rng" in getattr(item, "fixturenames", ()):
        seed = item.config.stash[_SEED]
        report.sections.append(("random inputs", f"replay: pytest --seed {seed} '{item.nodeid}'"))
    return report


@pytest.fixture(scope="session")
def session_seed(request):
    """The run's seed (``--seed``), for workers in subprocesses."""
    return request.config.stash[_SEED]


@pytest.fixture
def rng(request, session_seed):
    """A generator seeded from the run's seed and the test's id: the same inputs again with
    ``--seed``."""
    words = [session_seed] + list(request.node.nodeid.encode())
    return np.random.default_rng(words)


def _copy_if_there(source, target):
    """shutil.copy2, where another worker's save or load may have removed ``source`` (a missing
    entry is a miss: the subprocess compiles that kernel)."""
    with contextlib.suppress(FileNotFoundError):
        shutil.copy2(source, target)


@pytest.fixture
def seeded_kernel_cache():
    """``seeded_kernel_cache(folder)`` creates ``folder``, for NUMBA_CACHE_DIR, as a copy of this
    process's kernel cache (which the warm-up under ``-n`` has filled), and returns it: a
    subprocess then compiles only the kernels it is missing. Numba names a source folder's
    cache under NUMBA_CACHE_DIR by the folder's name and the SHA-1 of its path."""
    import hashlib

    from arrayrope.backends.cpu import _fused_launch

    def seed(folder):
        source = os.path.dirname(os.path.abspath(_fused_launch.__file__))
        ours = getattr(getattr(_fused_launch.fused_step, "_cache", None), "_cache_path", None)
        folder.mkdir(parents=True, exist_ok=True)
        if ours and os.path.isdir(ours):
            into = folder / f"cpu_{hashlib.sha1(source.encode()).hexdigest()}"
            skip = shutil.ignore_patterns("*.pyc", "*.lock", "*.tmp.*")  # a save in progress
            shutil.copytree(ours, into, ignore=skip, copy_function=_copy_if_there)
        return folder

    return seed


@pytest.fixture(scope="session")
def host_kernels(tmp_path_factory):
    """The CuPy backend's CUDA C source built for the host (see host_cuda.py)."""
    import host_cuda

    if host_cuda.GXX is None:
        pytest.skip("g++ is not on PATH: the CUDA C source's host run needs a C++ compiler")
    return host_cuda.compile_host_kernels(tmp_path_factory.mktemp("host_kernels"))
