"""python -m arrayrope (warmup, info) and arrayrope.warmup: one line per variant, clean
refusals, help as Python tools give it."""

import subprocess
import sys

import numba
import numpy as np
import pytest

import arrayrope as ar


def test_warmup_reports_every_variant():
    lines = []
    seconds = ar.warmup(("float32",), head_dim=16, progress=lines.append)
    from arrayrope.backends.cpu import _parallel, _rows
    from arrayrope.backends.cpu._config import STREAMING

    assert seconds > 0 and len(lines) == 2 * (14 + 3 * STREAMING)  # per pair style
    assert all(line.startswith("float32") and line.endswith(" s") for line in lines)
    # every kernel of the general path for a new result and in place, and the parallel entry
    # point: on x86-64 the vector steps' (a one-axis RoPE's rows all take them there, the
    # general loop serving multi-axis tables), elsewhere the general loop
    f32 = numba.typeof(np.empty(1, np.float32))
    vector_kernels = {k for styles in _rows.KERNELS.values() for k in styles.values()}
    vector_kernels -= {_rows.rotate_range}
    for kernel in vector_kernels if STREAMING else {_rows.rotate_range}:
        assert f32 in [sig[0] for sig in kernel.signatures], kernel
    parallel = {str(sig[2]) for sig in _parallel.rotate_parallel.signatures}  # x1
    # in place, the direct path's plain-store kernel takes x itself; the general loop, None
    in_place = str(f32) if STREAMING else "none"
    assert {str(f32), in_place} <= parallel, parallel
    # rows past the cos/sin cache: one thread and parallel
    from arrayrope.backends.cpu import _angles

    assert _angles.fill_rows.signatures and _angles.fill_rows_parallel.signatures
    # the fused step's launcher, which the disk cache keeps
    from arrayrope.backends.cpu import _fused_launch

    assert any(sig[0].dtype == numba.float32 for sig in _fused_launch.fused_step.signatures)
    with pytest.raises(ar.RopeValueError, match="dtypes must be among"):
        ar.warmup(("int8",))


def test_the_command():
    # in the suite's own kernel cache: an empty one would compile every variant again
    done = subprocess.run(
        [sys.executable, "-m", "arrayrope", "warmup", "float32"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("float32 ") >= 9 and "done in" in done.stdout
    usage = subprocess.run([sys.executable, "-m", "arrayrope"], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr
    bad = [sys.executable, "-m", "arrayrope", "warmup", "float8"]
    refused = subprocess.run(bad, capture_output=True, text=True)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "unknown dtype 'float8'" in refused.stderr


def _command(*args):
    done = subprocess.run(
        [sys.executable, "-m", "arrayrope", *args], capture_output=True, text=True, timeout=300
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_help_and_info():
    top = _command("--help")
    assert top.returncode == 0 and "warmup" in top.stdout and "info" in top.stdout
    warm = _command("warmup", "--help")
    assert warm.returncode == 0 and "DTYPE" in warm.stdout and "float32" in warm.stdout
    info = _command("info")
    assert info.returncode == 0, info.stderr
    found = dict(line.split(":", 1) for line in info.stdout.splitlines())
    assert set(found) >= {"arrayrope", "numba", "cpu", "vector steps", "threads", "kernel cache"}
    assert found["numba"].strip().startswith(numba.__version__)
    assert "-byte steps" in found["vector steps"] and "gpu backends" in found
