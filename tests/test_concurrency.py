"""Threads rotating through shared RoPEs while their caches grow, under each threading layer
Numba can load here: see ``stress_threads.py``, run in a subprocess per layer (a process picks
its layer once)."""

import importlib
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# Where each layer's pool lives in Numba, and what to install where it does not load
LAYERS = {
    "omp": ("numba.np.ufunc.omppool", "an OpenMP runtime (libgomp)"),
    "tbb": ("numba.np.ufunc.tbbpool", "TBB: pip install tbb"),
    "workqueue": ("numba.np.ufunc.workqueue", None),
}


@pytest.mark.parametrize("layer", LAYERS)
def test_threads_share_ropes_while_caches_grow(layer, session_seed):
    module, needs = LAYERS[layer]
    try:
        importlib.import_module(module)
    except ImportError as error:
        pytest.skip(f"Numba's {layer} threading layer does not load here ({error}); needs {needs}")
    env = {
        **os.environ,
        "NUMBA_THREADING_LAYER": layer,
        # small enough that the stress's larger inputs take the parallel kernels
        "ARRAYROPE_SERIAL_BELOW": "4096",
    }
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "stress_threads.py"), str(session_seed)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    report = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, f"status {done.returncode}:\n{report}"
    assert f"on the {layer} layer: all equal" in done.stdout, report
