"""Functions compiled by numba on first use, or left as they are where numba is not installed."""

from __future__ import annotations

import functools
import warnings

__all__ = ["compiled"]


@functools.cache
def compiled(function):
    """``function`` compiled by numba on first use (importing numba takes a while); without numba, as it is."""
    try:
        import numba
    except ImportError:  # a machine without numba (the GPU images) gets the same results, at Python speed
        warnings.warn("pipecomm: numba is not installed; schedules are simulated and list-scheduled at Python speed "
                      "and the planner skips its local search", stacklevel=3)
        return function
    return numba.njit(cache=True)(function)
