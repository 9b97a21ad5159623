"""The GPU backends: the CUDA C source launched through CuPy (``cupy``) and numba.cuda kernels
(``numba``), with the device plumbing they share (``_staging``, ``_flag``, ``_capture``) and
the one hook the plans and the API call (``_device``, reached as ``backends.device()``)."""

import numpy as np

_NO_LEVELS = np.zeros((2, 1, 1))


def level_arguments(spec, freqs):
    """(inv_freq, level tables, scale): what the kernels take to make rows past the table, from
    the frequency set's tables ``freqs`` (``_tables.CosSinTables``). Where freqs is None (every
    position is in the table) zeros and a NaN scale, which the kernels read as "no rows past
    the table": a row there is NaN."""
    if freqs is None:
        return np.zeros(spec.pair_axis.shape[0]), _NO_LEVELS, np.nan
    _, inv_freq, levels = freqs.level_arrays()
    return inv_freq, levels, freqs.scale
