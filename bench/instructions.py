"""Instructions per decode call, counted by Valgrind: a measure the machine's noise cannot move.

On a shared VM a decode step's time swings 2x from minute to minute, so a change worth 0.1 us
is lost in timing. Valgrind's callgrind counts the instructions a process executes, the same
on every run. Each case runs in a child process under callgrind: every case is warmed up, then
the case's own call repeats N times; a child that repeats none gives the baseline, and the
difference divided by N is the count per call. Instructions are not time (a vector loop bound
by shuffles and a dictionary lookup differ in cycles per instruction), but a change that
removes instructions from one path and adds none elsewhere is measured exactly.

    python bench/instructions.py              # every case, instructions per call
    python bench/instructions.py --top 12     # and where they go, by function
    python bench/instructions.py --only "RoPE.rotate(x, int)"

Needs ``valgrind`` on PATH. About 1.5 minutes per case on the 2-core VM, plus about 10 minutes
the first time: Valgrind reports its own CPU model, so Numba compiles its kernels once more for
it (kept in the disk cache from then on).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Run in the child: name -> statement, on the names that SETUP defines.
SETUP = """
import numpy as np
import arrayrope as ar
rng = np.random.default_rng(0)
x = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
k = rng.standard_normal((1, 8, 1, 128)).astype(np.float32)
x16 = x.astype(np.float16)
rope = ar.RoPE(128)
"""
CASES = {
    "RoPE.rotate(x, int)": "rope.rotate(x, 1234)",
    "ar.rotate(x, int)": "ar.rotate(x, 1234)",
    "ar.rotate(x, int, out=x)": "ar.rotate(x, 1234, out=x)",
    "ar.rotate_qk(q, k, int)": "ar.rotate_qk(x, k, 1234)",
    "ar.rotate(x float16, int)": "ar.rotate(x16, 1234)",
}
CHILD = """
import sys
sys.path.insert(0, {root!r})
{setup}
cases = {cases!r}
for statement in cases.values():  # compile or load every kernel, build every table
    exec(f"for _ in range(200):\\n    {{statement}}")
if {which} >= 0:  # the loop is one code object: about 10 instructions a call of its own
    exec(f"for _ in range({n}):\\n    {{list(cases.values())[{which}]}}")
"""


def count(which, n, folder):
    """(total instructions, {function: instructions}) of one child run under callgrind."""
    script = os.path.join(folder, "child.py")
    with open(script, "w") as f:
        f.write(CHILD.format(root=ROOT, setup=SETUP, cases=CASES, which=which, n=n))
    out = os.path.join(folder, "callgrind.out")
    # Without these, OpenBLAS's idle threads and string hash randomization (which moves dict
    # probe counts) each add or take a few hundred instructions per call from run to run.
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, script],
        check=True,
        capture_output=True,
        env=env,
    )
    text = subprocess.run(
        ["callgrind_annotate", "--threshold=100", out], check=True, capture_output=True, text=True
    ).stdout
    functions = {}
    total = 0
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \([\s\d.]+%\)\s+(.*)$", line)
        if not m:
            continue
        value = int(m.group(1).replace(",", ""))
        if "PROGRAM TOTALS" in line:
            total = value
            continue
        name = re.sub(r" \[.*\]$", "", m.group(2))
        name = name.rsplit("/", 1)[-1]  # source file:function, without the build path
        if name.startswith("???:0x"):
            name = "(JIT-compiled code)"
        functions[name] = functions.get(name, 0) + value
    return total, functions


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="measured calls per case")
    parser.add_argument("--top", type=int, default=0, help="also list the top functions")
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("bench/instructions.py needs valgrind on PATH")
    with tempfile.TemporaryDirectory() as folder:
        count(-1, 0, folder)  # fill Numba's disk cache for the CPU that Valgrind reports
        base_total, base_functions = count(-1, 0, folder)
        print(f"# instructions per call, {args.calls} calls, under callgrind")
        for which, name in enumerate(CASES):
            if args.only not in name:
                continue
            total, functions = count(which, args.calls, folder)
            print(f"{name:28s} {(total - base_total) / args.calls:9.0f}", flush=True)
            per_call = {
                f: (v - base_functions.get(f, 0)) / args.calls for f, v in functions.items()
            }
            for f, v in sorted(per_call.items(), key=lambda item: -item[1])[: args.top]:
                print(f"    {v:9.0f}  {f[:100]}")


if __name__ == "__main__":
    main()
