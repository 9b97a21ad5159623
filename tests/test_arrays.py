"""The array probe (_arrays), the position checks (_positions) and the cache policy (_cache):
the answers the dispatcher builds every plan on."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import arrayrope as ar
from arrayrope import RopeTypeError, RopeValueError, _api, _arrays, _cache, _positions
from arrayrope._arrays import NUMPY


def _raw(shape, dtype, strides, offset=0, size=4096):
    return np.ndarray(shape, dtype, np.zeros(size, np.uint8), offset=offset, strides=strides)


def test_family_of_arrays_and_other_objects():
    assert _arrays.family(np.zeros(2)) == NUMPY
    assert _arrays.family(np.zeros(2).view(np.memmap)) == NUMPY

    class Sub(np.ndarray):
        pass

    assert _arrays.family([1.0]) == "" and _arrays.family(np.zeros(2).view(Sub)) == ""


def test_addressable_needs_contiguous_features_whole_strides_and_an_aligned_start():
    f32 = np.dtype(np.float32)
    assert _arrays.addressable(np.zeros((3, 8), f32), NUMPY)
    assert _arrays.addressable(np.zeros((3, 8), f32)[::-1], NUMPY)  # any leading strides
    assert not _arrays.addressable(np.zeros((3, 8), f32)[:, ::2], NUMPY)
    assert not _arrays.addressable(_raw((3, 8), f32, (34, 4)), NUMPY)  # part of an element
    assert _arrays.addressable(_raw((1, 8), f32, (34, 4)), NUMPY)  # an axis of 1 has no step
    assert not _arrays.addressable(_raw((3, 8), f32, (32, 4), offset=2), NUMPY)  # misaligned
    assert _arrays.addressable(np.zeros((0, 8), f32)[:, ::2], NUMPY)  # nothing to address


def test_self_overlapping_finds_elements_that_share_memory():
    base = np.zeros(64, np.float32)
    strided = np.lib.stride_tricks.as_strided
    assert _arrays.self_overlapping(strided(base, (3, 8), (0, 4)))  # broadcast rows
    assert _arrays.self_overlapping(strided(base, (4, 8), (16, 4)))  # rows overlap by half
    assert not _arrays.self_overlapping(strided(base, (4, 8), (32, 4)))
    assert not _arrays.self_overlapping(strided(base, (4, 4), (4, 16)))  # transposed: distinct
    assert not _arrays.self_overlapping(strided(base, (1, 8), (0, 4)))  # an axis of 1
    assert not _arrays.self_overlapping(np.zeros((3, 0, 8)))


@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
    st.lists(st.integers(-3, 3), min_size=3, max_size=3),
)
def test_self_overlapping_is_never_wrong_about_distinct_elements(shape, steps):
    # where it says "distinct", every element has its own address (it may refuse some
    # interleavings that are in fact distinct: it is conservative, never the other way)
    strides = tuple(s * 4 for s in steps[: len(shape)])
    base = np.zeros(256, np.float32)
    a = np.lib.stride_tricks.as_strided(base[128:], shape, strides)
    if not _arrays.self_overlapping(a):
        offsets = {sum(i * s for i, s in zip(index, strides)) for index in np.ndindex(*shape)}
        assert len(offsets) == a.size


def test_overlap_kind():
    buffer = np.zeros((4, 16), np.float32)
    assert _arrays.overlap_kind(buffer[:2], buffer[2:], NUMPY) == "none"
    assert _arrays.overlap_kind(buffer[:2], buffer[:2], NUMPY) == "same"
    assert _arrays.overlap_kind(buffer[:2], buffer[1:3], NUMPY) == "partial"
    assert _arrays.overlap_kind(buffer[:, ::2], buffer[:, 1::2], NUMPY) == "none"  # interleaved


def test_resolve_and_check_positions():
    assert _positions.resolve(None, 1) == (_positions.NONE, None)
    assert _positions.resolve(np.int16(7), 1) == (_positions.INT, 7)
    with pytest.raises(RopeValueError, match="pos must be non-negative, got -1"):
        _positions.resolve(-1, 1)
    with pytest.raises(RopeValueError, match=r"pos must be below 2\*\*31, got 2147483648"):
        _positions.resolve(2**31, 1)
    with pytest.raises(RopeValueError, match="pos is required"):
        _positions.resolve(None, 3)
    with pytest.raises(RopeTypeError, match="bool"):
        _positions.resolve(np.array([True]), 1)
    values, is_int, high = _positions.check_values(np.array([[3], [9]], np.uint8))
    assert values.dtype == np.int64 and is_int and high == 9
    with pytest.raises(RopeValueError, match=r"pos must be below 2\*\*31, got 2147483648"):
        _positions.check_values(np.array([2**31]))
    with pytest.raises(RopeValueError, match="finite"):
        _positions.check_values(np.array([1.0, np.inf]))


def test_row_patterns():
    lead = (2, 4, 3)  # (B, H, T)
    assert _positions.row_pattern((3,), lead) == (False, 1)
    assert _positions.row_pattern((2, 1, 1), (2, 4, 1)) == (True, 4)  # batched decode
    assert _positions.row_pattern((1,), lead) == (False, 1)
    assert _positions.row_pattern((2, 1, 3), lead) is None  # broadcast in the middle
    assert _positions.row_pattern((2, 4, 3, 1), lead) is None  # more axes than the rows


def test_seq_len_is_refused_without_a_length_dependent_rule():
    assert _positions.seq_len_for(True, None, 99) == 100
    assert _positions.seq_len_for(False, None, 99) is None
    with pytest.raises(RopeValueError, match="seq_len applies"):
        _positions.seq_len_for(False, 4096, 99)


def test_bounded_drops_the_oldest_first():
    cache = _cache.Bounded(3)
    for i in range(5):
        cache.put(i, str(i))
    assert list(cache) == [2, 3, 4]
    cache.put(3, "again")  # an existing key: nothing dropped
    assert list(cache) == [2, 3, 4] and cache[3] == "again"
    _cache.clear_all()
    assert not cache


def test_a_config_change_keeps_the_tables_and_drops_the_plans():
    from arrayrope.backends.cpu import _config

    rope = ar.RoPE(64)
    x = np.ones((2, 3, 64), np.float32)
    rope.rotate(x, 1000)
    tables = rope._freq_set(None).tables
    levels = tables.level_arrays()
    plans = rope._engine.plans
    assert plans and tables._tables
    with _config.override(stream_above=0):
        assert not plans  # plans follow the launch configuration
        assert rope._freq_set(None).tables is tables and tables.level_arrays() is levels
        # and a RoPE made now finds the same frequencies' level tables built
        assert ar.RoPE(64)._default.tables.level_arrays()[2] is levels[2]
        shared = _api.shared_rope(64, 10000.0, "interleaved", None, None)
    assert _api.shared_rope(64, 10000.0, "interleaved", None, None) is shared
    _cache.clear_all()  # anything else (a device backend swapped): everything goes
    assert rope._freq_set(None).tables is not tables
    assert _api.shared_rope(64, 10000.0, "interleaved", None, None) is not shared


@given(
    shape=st.lists(st.integers(0, 9), max_size=4).map(tuple),
    dtype=st.sampled_from(["float16", "float32", "float64", "uint8", "int64"]),
)
def test_empty_for_xla_is_c_ordered_and_starts_on_64_bytes(shape, dtype):
    a = _arrays.empty_for_xla(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous
    assert a.flags.writeable and (a.size == 0 or a.ctypes.data % 64 == 0)
    a[...] = 3  # the whole array is its own memory
    assert a.nbytes == 0 or a.base.nbytes >= a.nbytes


def _vm_flags(address):
    """The VmFlags of the mapping that holds ``address`` (Linux's /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_advise_huge_pages_marks_the_whole_huge_pages_and_keeps_the_contents():
    import mmap
    import os
    import sys

    if not sys.platform.startswith("linux"):
        assert _arrays._madvise() is None
        return
    memory = mmap.mmap(-1, 12 << 20)
    a = np.frombuffer(memory, np.uint8)
    a[:] = np.arange(a.size) % 251
    start = a.ctypes.data + 4096  # off the 2 MiB grid: only whole huge pages inside are marked
    assert "hg" not in _vm_flags(start + (4 << 20))
    if not _arrays.advise_huge_pages(start, 8 << 20):  # refused: a kernel without them
        assert not os.path.exists("/sys/kernel/mm/transparent_hugepage")
        return
    assert "hg" in _vm_flags(-(-start // (2 << 20)) * (2 << 20))
    assert "hg" not in _vm_flags(a.ctypes.data)  # the partial page below stays as it was
    np.testing.assert_array_equal(a, np.arange(a.size) % 251)
    assert not _arrays.advise_huge_pages(start, (4 << 20) - 1)  # below NumPy's threshold
    del a
    memory.close()
