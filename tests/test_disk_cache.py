"""A damaged kernel cache never stops a call: each damaged entry is dropped with one warning
naming the folder, the kernel compiles and is saved anew, and the results are right."""

import os
import subprocess
import sys

import numpy as np
import pytest

CALL = """
import warnings
import numpy as np
import arrayrope as ar
x = np.arange(2 * 3 * 5 * 8, dtype=np.float32).reshape(2, 3, 5, 8) / 7
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y = ar.rotate(x, 9)
    z = ar.rotate(x.astype(np.float64), np.arange(5), style="half")
np.save({out!r}, np.concatenate([y.ravel(), z.ravel()]))
for w in caught:
    print("WARNING", w.category.__name__, w.message)
"""


def _run(tmp_path, cache):
    out = tmp_path / "result.npy"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    done = subprocess.run(
        [sys.executable, "-c", CALL.format(out=str(out))],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return np.load(out), [line for line in done.stdout.splitlines() if line.startswith("WARNING")]


@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_a_damaged_kernel_cache_is_dropped_and_rebuilt(tmp_path, damage):
    cache = tmp_path / "cache"
    expected, warned = _run(tmp_path, cache)
    assert not warned
    files = [os.path.join(root, f) for root, _, names in os.walk(cache) for f in names]
    assert any(f.endswith(".nbi") for f in files) and any(f.endswith(".nbc") for f in files)
    rng = np.random.default_rng(0)
    for path in files:
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            if damage == "truncate":
                f.truncate(size // 3)
            else:
                f.seek(size // 4)
                f.write(rng.integers(0, 256, max(1, size // 2), dtype=np.uint8).tobytes())
    got, warned = _run(tmp_path, cache)
    np.testing.assert_array_equal(got, expected)
    assert warned, "no warning for a damaged cache"
    assert all("RuntimeWarning" in w and str(cache) in w for w in warned)
    assert len({w.split(" in ", 1)[1].split(" ")[0] for w in warned}) == len(warned)  # once each
    again, warned = _run(tmp_path, cache)  # the entries were saved anew
    np.testing.assert_array_equal(again, expected)
    assert not warned


def test_entries_are_keyed_to_every_source_of_the_kernels(tmp_path):
    # A kernel's compiled code also holds the helpers it inlines from the other modules of its
    # folder, which Numba's stamp (the defining file's time and size) does not see: the stamp
    # of each entry holds a digest of every source file there, which any edit changes.
    import shutil

    from arrayrope.backends.cpu import _angles, _config, _disk_cache, _rows

    if not _config.DISK_CACHE:
        pytest.skip("the disk cache is off in this configuration")
    folder = os.path.dirname(os.path.abspath(_rows.__file__))
    digest = _disk_cache.sources_digest(folder)
    kernels = [*_rows.kernels(), _angles.fill_rows]
    for kernel in kernels:
        assert kernel._cache._cache_file._source_stamp[1] == digest
    copy = tmp_path / "cpu"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert _disk_cache.sources_digest(copy) == digest
    helper = copy / "_convert.py"
    helper.write_text(helper.read_text() + "\n")
    assert _disk_cache.sources_digest(copy) != digest


RACER = """
import numpy as np
from numba import njit
from arrayrope.backends.cpu import _disk_cache


@njit(cache=True)
def kernel(a):
    return a.sum() * 2 + a.ndim


_disk_cache.guard(__import__(__name__))
"""

SAVE = """
import sys
import numpy as np
sys.path.insert(0, {folder!r})
import racer
assert racer.kernel(np.ones(3)) == 7.0
"""


def test_a_save_waits_for_the_folder_lock(tmp_path):
    # Numba numbers a new entry's data file from the index it has read: two processes saving
    # at once could give two signatures one file, and a later load would run one signature's
    # machine code on the other's arrays (a crash). Saves take the folder's lock alone: while
    # this test holds it, another process's save waits, and no entry appears until it is let go.
    fcntl = pytest.importorskip("fcntl", reason="the lock needs fcntl")
    import time

    (tmp_path / "racer.py").write_text(RACER)
    cache = tmp_path / "cache"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    code = SAVE.format(folder=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    (folder,) = {p.parent for p in cache.rglob("*.nbi")}  # where the lock file lives
    for p in folder.glob("*.nb[ic]"):
        p.unlink()
    with open(folder / ".arrayrope.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saving = subprocess.Popen([sys.executable, "-c", code], env=env)
        time.sleep(5)  # it compiles, then waits to save
        assert saving.poll() is None and not list(folder.glob("*.nbi"))
        fcntl.flock(lock, fcntl.LOCK_UN)
    assert saving.wait(timeout=600) == 0
    assert list(folder.glob("*.nbi"))


def test_the_fused_step_runs_when_its_kernels_come_from_the_cache(tmp_path, seeded_kernel_cache):
    # a fused float16 step whose launcher, compiled over kernels loaded from the disk cache and
    # then itself loaded from it in a later process, called address 0: the launcher is cached,
    # its kernels are compiled into it
    case = (
        '[{"rope": {"kind": "plain", "head_dim": 64, "rotary_dim": 64, "style": "interleaved"}, '
        '"op": "into_cache", "dtype": "float16", "shape": [1, 64], "layout": "contiguous", '
        '"out_layout": "reversed", "side": "after", "pos": {"kind": "none"}, "inverse": true, '
        '"seed": 12}]'
    )
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_cases.py")
    cache = seeded_kernel_cache(tmp_path / "cache")  # the first run compiles only what is new
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))

    def run():
        done = subprocess.run(
            [sys.executable, worker], input=case, capture_output=True, text=True, env=env,
            timeout=600,
        )  # fmt: skip
        assert done.returncode == 0 and "OK 0" in done.stdout, done.stdout + done.stderr

    run()  # every kernel compiled or loaded, and saved
    entries = list(cache.rglob("_fused_launch.fused_step*"))
    assert entries  # the launcher is in the cache (copied, or saved by the run)
    for entry in entries:
        entry.unlink()  # the launcher alone compiled anew, over kernels loaded from the cache
    run()
    run()  # and everything loaded
