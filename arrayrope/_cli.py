"""The command line: ``python -m arrayrope {warmup,info}``."""

import argparse
import os
import platform
import sys


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m arrayrope",
        description="Rotary position embeddings on plain arrays: kernel cache and machine facts.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    warm = commands.add_parser(
        "warmup",
        help="compile the common CPU kernels into the disk cache",
        description="Compile the common CPU kernel variants into Numba's disk cache, so that "
        "later processes load them instead of compiling (a few seconds per variant).",
    )
    warm.add_argument(
        "dtypes",
        nargs="*",
        metavar="DTYPE",
        help="float16, bfloat16, float32 or float64 (default: all four; bfloat16 where "
        "ml_dtypes is installed)",
    )
    commands.add_parser(
        "info",
        help="versions, CPU, threads, kernel cache and GPU backends",
        description="Print the versions, the CPU and its vector ISA, the threading layer, the "
        "kernel cache folder and what it holds, and which GPU backends load.",
    )
    return parser


DTYPES = ("float16", "bfloat16", "float32", "float64")


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "info":
        for key, value in info().items():
            print(f"{key + ':':22s} {value}")
        return 0
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"warmup: unknown dtype {unknown[0]!r} (choose from {', '.join(DTYPES)})")
    return _warmup(args.dtypes)


def _warmup(dtypes):
    from ._errors import RopeError
    from ._warmup import warmup
    from .backends.cpu._config import DISK_CACHE

    if not DISK_CACHE:
        print("the disk cache is off (ARRAYROPE_NUMBA_CACHE=0, ARRAYROPE_SOFT_F16=1 or "
              "ARRAYROPE_VECTOR_BYTES set): nothing would be kept", file=sys.stderr)  # fmt: skip
        return 1
    try:
        seconds = warmup(tuple(dtypes) or None)
    except RopeError as error:
        print(f"arrayrope warmup: {error}", file=sys.stderr)
        return 2
    print(f"done in {seconds:.1f} s; every process loads these kernels from the cache now")
    return 0


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _kernel_cache():
    """(folder, kernels, compiled variants) of arrayrope's Numba disk cache."""
    from .backends.cpu import _config, _decode

    if not _config.DISK_CACHE:
        return "off", 0, 0
    folder = getattr(_decode.rotate_rows._cache, "cache_path", None)
    if folder is None or not os.path.isdir(folder):
        return f"{folder} (empty)", 0, 0
    names = os.listdir(folder)
    return folder, sum(n.endswith(".nbi") for n in names), sum(n.endswith(".nbc") for n in names)


def _gpu_backends():
    found = []
    try:
        import cupy

        found.append(f"cupy {cupy.__version__} ({'a GPU' if cupy.is_available() else 'no GPU'})")
    except ImportError:
        found.append("cupy not installed")
    except Exception as error:  # an installed CuPy that fails to load its CUDA libraries
        found.append(f"cupy fails to load ({type(error).__name__})")
    try:
        from numba import cuda

        found.append(f"numba.cuda ({'a GPU' if cuda.is_available() else 'no GPU'})")
    except Exception as error:
        found.append(f"numba.cuda fails to load ({type(error).__name__})")
    return "; ".join(found)


def info():
    """The facts ``python -m arrayrope info`` prints, as a dict of strings."""
    import llvmlite
    import numba
    import numpy as np
    from llvmlite import binding

    import arrayrope

    from .backends.cpu import _config

    features = binding.get_host_cpu_features().flatten()
    isa = "AVX-512" if "+avx512f" in features else "AVX2" if "+avx2" in features else "baseline"
    try:
        layer = numba.threading_layer()
    except ValueError:
        layer = f"not started yet (NUMBA_THREADING_LAYER={numba.config.THREADING_LAYER})"
    folder, kernels, variants = _kernel_cache()
    return {
        "arrayrope": f"{arrayrope.__version__} ({os.path.dirname(arrayrope.__file__)})",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": f"{numba.__version__} (llvmlite {llvmlite.__version__})",
        "cpu": f"{_cpu_model()}, {binding.get_host_cpu_name()}",
        "vector steps": f"{isa}: {_config.VECTOR_BYTES}-byte steps, "
        f"F16C {'yes' if _config.HARDWARE_F16 else 'no'}, "
        f"AVX512-BF16 rounding {'yes' if _config.BF16_INSTRUCTION else 'no'}",
        "threads": f"{numba.config.NUMBA_NUM_THREADS}, threading layer {layer}",
        "kernel cache": folder,
        "cached kernels": f"{kernels} kernels, {variants} compiled variants",
        "gpu backends": _gpu_backends(),
    }
