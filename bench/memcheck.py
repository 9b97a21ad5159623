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
    python bench/memcheck.py --only "table blocks" --write docs/memcheck.md

``--only`` runs the configurations whose names contain the text; with ``--write``, the rows of
the others are kept from the file where it was written with the same ``--size`` and ``--seed``,
each row with the date it was run.

Reports, per configuration, the cases run, the time taken and the invalid accesses found:
those inside arrayrope's kernels or anything but the dynamic loader (expected: zero), and the
dynamic loader's own (glibc's word-wise string reads while it loads libraries, which memcheck
reports on every Python process). Exits 1 when any of the first kind is found.

Needs ``valgrind`` on PATH. Under Valgrind, Numba sees another CPU model (Valgrind's, without
AVX-512 say) and would compile every kernel for it under Valgrind before the first case, for an
hour or more. So each configuration first runs natively with Numba told Valgrind's model
(NUMBA_CPU_NAME, NUMBA_CPU_FEATURES, read by a query under ``valgrind --tool=none``): that fills
Numba's disk cache with the kernels the run under memcheck then loads. The time reported is
the run under memcheck.
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


def valgrind_cpu(valgrind):
    """{NUMBA_CPU_NAME, NUMBA_CPU_FEATURES} of the CPU model Numba sees under Valgrind."""
    query = (
        "import llvmlite.binding as ll; ll.initialize_native_target(); "
        "print(ll.get_host_cpu_name()); print(ll.get_host_cpu_features().flatten())"
    )
    done = subprocess.run(
        [valgrind, "-q", "--tool=none", sys.executable, "-c", query],
        capture_output=True,
        text=True,
        check=True,
    )
    name, features = done.stdout.split()[-2:]
    return {"NUMBA_CPU_NAME": name, "NUMBA_CPU_FEATURES": features}


def worker_env(env):
    return {**os.environ, **env, "PYTHONMALLOC": "malloc", "MEMORY_CASES_ALLOCATION": "heap"}


def prime(cases, env, cpu):
    """Run the worker on ``cases`` natively for the CPU model ``cpu`` (see valgrind_cpu), so
    that Numba's disk cache holds the kernels a run under Valgrind takes."""
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "memory_cases.py")],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env={**worker_env(env), **cpu},
    )


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
        child_env = worker_env(env)
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


_HEADER = "| configuration | cases passed | invalid accesses | in the loader | time | run on |"


def kept_rows(path, size, seed, names, count):
    """{configuration: table row} of the clean rows of ``names`` in a report written earlier at
    ``path`` with the same size and seed, over ``count`` cases (a row without a date takes the
    report's), else {}."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {}
    if f"--size {size} --seed {seed}`" not in text:
        return {}
    dated = re.search(r"` on (\d{4}-\d\d-\d\d),", text)
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] not in names or len(cells) not in (5, 6):
            continue
        passed, total = cells[1].split(" of ")
        if passed != total or total != str(count) or cells[2] != "0":
            continue  # a row with findings is run again, not carried
        if len(cells) == 5:
            cells.append(dated.group(1) if dated else "?")
        rows[cells[0]] = "| " + " | ".join(cells) + " |"
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=300, help="random layouts per configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", metavar="TEXT", help="the configurations whose names hold TEXT")
    parser.add_argument("--write", metavar="FILE", help="also write the report to FILE")
    args = parser.parse_args()
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        sys.exit("memcheck.py needs valgrind on PATH")
    import memory_cases

    configs = {
        name: env
        for name, env in memory_cases.CONFIGS.items()
        if args.only is None or args.only in name
    }
    if not configs:
        sys.exit(f"--only {args.only!r} names none of: {', '.join(memory_cases.CONFIGS)}")
    cases = memory_cases.standard_cases(large=True) + memory_cases.corpus(args.size, args.seed)
    kept = {}
    if args.write and len(configs) < len(memory_cases.CONFIGS):
        others = set(memory_cases.CONFIGS) - set(configs)
        kept = kept_rows(args.write, args.size, args.seed, others, len(cases))
    revision = subprocess.run(
        ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    run_on = f"{datetime.date.today()}" + (f", {revision}" if revision else "")
    lines = [
        "# Memcheck over fuzzed layouts",
        "",
        f"Written by `python bench/memcheck.py --size {args.size} --seed {args.seed}`, "
        f"{platform.machine()}, "
        f"{subprocess.run([valgrind, '--version'], capture_output=True, text=True).stdout.strip()}"
        "; each configuration's row says when it ran.",
        "",
        f"{len(cases)} cases per configuration: the guard-page tests' fixed matrix and "
        f"{args.size} hypothesis-drawn layouts. Operands sit in heap blocks of exactly their "
        "span; invalid reads and writes are counted inside arrayrope (or anywhere but the "
        "dynamic loader) and in the dynamic loader.",
        "",
        _HEADER,
        "|---|---:|---:|---:|---:|---|",
    ]
    print("\n".join(lines), flush=True)
    rows, bad = dict(kept), []
    for name in kept:
        print(kept[name] + "  (kept)", flush=True)
    cpu = valgrind_cpu(valgrind)
    for name, env in configs.items():
        prime(cases, env, cpu)
        ok, failed, found, seconds, code = run(cases, env, valgrind)
        ours = [e for e in found if not from_loader(e[1])]
        rows[name] = (
            f"| {name} | {ok} of {len(cases)} | {len(ours)} | {len(found) - len(ours)} "
            f"| {seconds / 60:.1f} min | {run_on} |"
        )
        print(rows[name], flush=True)
        bad += [f"{name}: {headline}\n    " + "\n    ".join(stack[:12]) for headline, stack in ours]
        bad += [f"{name}: {line}" for line in failed]
        if code not in (0, 1) or ok + len(failed) < len(cases):
            bad.append(f"{name}: the worker stopped (status {code}) after {ok + len(failed)} cases")
    lines += [rows[name] for name in memory_cases.CONFIGS if name in rows]
    missing = [name for name in memory_cases.CONFIGS if name not in rows]
    if missing:
        lines += ["", "Not run with this size and seed: " + "; ".join(missing) + "."]
    if bad:
        lines += ["", "## Findings", "", "```", *bad, "```"]
        print("\n".join(lines[-len(bad) - 4 :]))
    if args.write:
        with open(args.write, "w") as f:
            f.write("\n".join(lines) + "\n")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
