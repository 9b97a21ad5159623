"""The public API survives arbitrary arguments: see ``fuzz_api.py``, run here in a subprocess so
that a crash fails the test instead of ending the run."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_arbitrary_arguments_are_rejected_cleanly(request, session_seed):
    examples = 3000 if request.config.getoption("--slow") else 300
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "fuzz_api.py"), str(examples), str(session_seed)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    report = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"the fuzz worker ended with status {done.returncode}:\n{report}"
    assert f"fuzzed {examples} calls" in done.stdout
