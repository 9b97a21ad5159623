"""Every kernel route under Valgrind's memcheck: invalid reads and writes over fuzzed layouts.

The worker of the guard-page tests (``tests/memory_cases.py``) runs under memcheck with its
operands on the heap, each in a block of exactly its span, which memcheck surrounds with red
zones; the cos/sin tables, results and kernel scratch are heap blocks too. The corpus is the
fixed matrix of the guard-page tests plus a hypothesis-drawn set of layouts (the same for the
same ``--seed``), run once per route configuration: decode and prefill sizes on one thread,
every input on the parallel kernels with streaming stores and with plain stores, and streaming
again with the table calls' rows taken two positions at a time through every head.

    python bench/memcheck.py                     # 300 random layouts per configuration
    python bench/memcheck.py --size 2000 --seed 7
    python bench/memcheck.py --write docs/memcheck.md

Reports, per configuration, the cases run, the time taken and the invalid accesses found:
those inside arrayrope's kernels or anything but the dynamic loader (expected: zero), and the
dynamic loader's own (glibc's word-wise string reads while it loads libraries, which memcheck
reports on every Python process). Exits 1 when any of the first kind is found.

Needs ``valgrind`` on PATH. Numba compiles its kernels once more for Valgrind's CPU model, the
first time (about 10 minutes per configuration), and keeps them in the disk cache.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

_KIND = re.compile(r"^==\d+== (Invalid (read|write|free)[^\n]*|Mismatched free[^\n]*)$")
_LOADER = ("dl-load.c", "dl-open.c", "dl-deps.c", "ld-linux", "dl-lookup.c", "rtld.c")


def errors(log):
    """Memcheck's invalid-access reports in ``log``: (headline, stack lines) each."""
    found, current = [], None
    for line in log.splitlines():
        if _KIND.match(line):
            current = (line.split("== ", 1)[1], [])
            found.append(current)
        elif current is not None:
            text = line.split("== ", 1)[-1] if "== " in line else ""
            if not text.strip():
                current = None
            else:
                current[1].append(text.strip())
    return found


def from_loader(stack):
    return any(name in frame for frame in stack for name in _LOADER)


def run(cases, env, valgrind):
    with tempfile.TemporaryDirectory() as folder:
        spec = os.path.join(folder, "cases.json")
        log = os.path.join(folder, "memcheck.log")
        with open(spec, "w") as f:
            json.dump(cases, f)
        command = [
            valgrind,
            "--tool=memcheck",
            "--error-limit=no",
            "--leak-check=no",
            "--undef-value-errors=no",  # Python's own reads of getrandom() bytes, not ours
            f"--log-file={log}",
            sys.executable,
            os.path.join(ROOT, "tests", "memory_cases.py"),
        ]
        child_env = {
            **os.environ,
            **env,
            "PYTHONMALLOC": "malloc",
            "MEMORY_CASES_ALLOCATION": "heap",
        }
        start = time.perf_counter()
        with open(spec) as stdin:
            done = subprocess.run(
                command, stdin=stdin, capture_output=True, text=True, env=child_env
            )
        seconds = time.perf_counter() - start
        with open(log) as f:
            text = f.read()
    ok = sum(1 for line in done.stdout.splitlines() if line.startswith("OK "))
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL ")]
    return ok, failed, errors(text), seconds, done.returncode


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=300, help="random layouts per configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", metavar="FILE", help="also write the report to FILE")
    args = parser.parse_args()
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        sys.exit("memcheck.py needs valgrind on PATH")
    import memory_cases

    cases = memory_cases.standard_cases(large=True) + memory_cases.corpus(args.size, args.seed)
    lines = [
        "# Memcheck over fuzzed layouts",
        "",
        f"Written by `python bench/memcheck.py --size {args.size} --seed {args.seed}` on "
        f"{datetime.date.today()}, {platform.machine()}, "
        f"{subprocess.run([valgrind, '--version'], capture_output=True, text=True).stdout.strip()}"
        ".",
        "",
        f"{len(cases)} cases per configuration: the guard-page tests' fixed matrix and "
        f"{args.size} hypothesis-drawn layouts. Operands sit in heap blocks of exactly their "
        "span; invalid reads and writes are counted inside arrayrope (or anywhere but the "
        "dynamic loader) and in the dynamic loader.",
        "",
        "| configuration | cases passed | invalid accesses | in the loader | time |",
        "|---|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    bad = []
    for name, env in memory_cases.CONFIGS.items():
        ok, failed, found, seconds, code = run(cases, env, valgrind)
        ours = [e for e in found if not from_loader(e[1])]
        row = (
            f"| {name} | {ok} of {len(cases)} | {len(ours)} | {len(found) - len(ours)} "
            f"| {seconds / 60:.1f} min |"
        )
        print(row, flush=True)
        lines.append(row)
        bad += [f"{name}: {headline}\n    " + "\n    ".join(stack[:12]) for headline, stack in ours]
        bad += [f"{name}: {line}" for line in failed]
        if code not in (0, 1) or ok + len(failed) < len(cases):
            bad.append(f"{name}: the worker stopped (status {code}) after {ok + len(failed)} cases")
    if bad:
        lines += ["", "## Findings", "", "```", *bad, "```"]
        print("\n".join(lines[-len(bad) - 4 :]))
    if args.write:
        with open(args.write, "w") as f:
            f.write("\n".join(lines) + "\n")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
