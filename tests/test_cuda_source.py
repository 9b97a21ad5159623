"""The CUDA C source of the CuPy backend compiles for Ampere and Hopper, warnings as errors.

nvcc is on the build machines; elsewhere this skips, naming what is missing.
"""

import re
import shutil
import subprocess

import pytest

from arrayrope._cuda_cupy import KERNEL_NAMES, SOURCE

NVCC = shutil.which("nvcc")


def _nvcc(arch, output_kind, source, output):
    """nvcc with warnings as errors, from the front end through ptxas."""
    command = [
        NVCC,
        "-std=c++14",
        f"-arch={arch}",
        "-Werror",
        "all-warnings",
        "-Xptxas",
        "-Werror",
        output_kind,
        str(source),
        "-o",
        str(output),
    ]
    return subprocess.run(command, capture_output=True, text=True)


@pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) is not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_without_warnings(tmp_path, arch):
    source = tmp_path / "rope.cu"
    source.write_text(SOURCE)
    ptx = tmp_path / "rope.ptx"
    result = _nvcc(arch, "--ptx", source, ptx)
    assert result.returncode == 0, result.stderr
    entries = set(re.findall(r"\.visible \.entry (\w+)", ptx.read_text()))
    assert entries == set(KERNEL_NAMES)
    # And to machine code, which checks register and resource limits too.
    cubin = _nvcc(arch, "--cubin", source, tmp_path / "rope.cubin")
    assert cubin.returncode == 0, cubin.stderr


def test_one_entry_point_per_dtype_and_style():
    assert len(KERNEL_NAMES) == 8
    for name in KERNEL_NAMES:
        assert f"ROPE_ENTRY({name}," in SOURCE
