"""The kernels never touch memory outside their operands.

Every operand (x, out, k, positions) sits flush against an inaccessible page, after its last byte
or before its first (``guarded.py``), and every kernel route runs through the public API in a
subprocess (``memory_cases.py``): a read or write past either end kills it with SIGSEGV, which
fails the test and names the case. Each configuration of routes runs in its own process, steered
by the library's environment switches: the default (decode and prefill sizes on one thread),
every input on the parallel kernels with streaming stores, with plain stores, and with streaming
stores and the table calls' rows taken two positions at a time through every head.

The fixed matrix runs always; a random corpus of layouts (``memory_cases.case_strategy``) adds
60 cases per configuration, 1,000 with ``--slow``.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import memory_cases  # noqa: E402

CONFIGS = memory_cases.CONFIGS


def run_worker(cases, env):
    """Run ``cases`` in a fresh worker process; returns the failures as readable lines."""
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "memory_cases.py")],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=900,
    )
    failures, begun, finished = [], None, set()
    for line in done.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "BEGIN":
            begun = int(rest)
        elif word == "OK":
            finished.add(int(rest))
        elif word == "FAIL":
            i, _, why = rest.partition(" ")
            finished.add(int(i))
            failures.append(f"{memory_cases.describe(cases[int(i)])}: {why}")
    if done.returncode < 0 or (done.returncode and begun is not None and begun not in finished):
        died = done.returncode
        name = signal.Signals(-died).name if died < 0 else f"exit status {died}"
        case = cases[begun] if begun is not None else None
        failures.append(
            f"the worker died ({name}) in "
            + (memory_cases.describe(case) if case else "start-up")
            + f"\nreplay: echo '[{json.dumps(case)}]' | python tests/memory_cases.py"
            + f"\n{done.stderr[-2000:]}"
        )
    elif done.returncode and not failures:
        failures.append(f"the worker failed: {done.stderr[-2000:]}")
    if len(finished) < len(cases) and not failures:
        failures.append(f"the worker ran {len(finished)} of {len(cases)} cases")
    return failures


@pytest.mark.parametrize("config", CONFIGS)
def test_every_route_stays_inside_its_operands(config):
    failures = run_worker(memory_cases.standard_cases(large=True), CONFIGS[config])
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("config", CONFIGS)
def test_random_layouts_stay_inside_their_operands(config, request):
    size = 1000 if request.config.getoption("--slow") else 60
    seed = sum(map(ord, config))  # each configuration its own corpus, the same every run
    failures = run_worker(memory_cases.corpus(size, seed=seed), CONFIGS[config])
    assert not failures, "\n".join(failures[:20])


def test_a_touch_past_the_end_is_caught():
    """The guard itself: a read one element past a guarded operand kills the worker, and the
    report names the case and how to replay it."""
    case = dict(memory_cases.standard_cases()[0], touch_past_end=True)
    if case["layout"] != "contiguous" or case["side"] != "after":
        case.update(layout="contiguous", side="after")
    failures = run_worker([case], {})
    assert len(failures) == 1
    assert "SIGSEGV" in failures[0] and memory_cases.describe(case) in failures[0]
    assert "replay" in failures[0]
