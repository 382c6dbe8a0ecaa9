"""Functions compiled by numba on first use, or left as they are where numba is not installed."""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
import warnings

__all__ = ["compiled"]


@functools.cache
def compiled(function, *callees):
    """``function`` compiled by numba on first use (importing numba takes a while); without numba, as it is.

    ``callees`` are the functions it calls by their own names (from the module that defines it or one it imports them
    from): they are compiled with it, since compiled code calls only compiled functions.
    """
    try:
        import numba
    except ImportError:  # a machine without numba (the GPU images) gets the same results, at Python speed
        warnings.warn("pipecomm: numba is not installed; schedules are simulated and list-scheduled at Python speed "
                      "and the planner skips its local search", stacklevel=3)
        return function
    # numba reads a function's globals when it compiles it: a copy whose globals name the compiled callees leaves the
    # module's own names (the Python functions) as they are.
    namespace = {**function.__globals__, **{callee.__name__: compiled(callee) for callee in callees}}
    copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                              function.__closure__)
    # numba's cache sees a change to the function's own file only, but compiles in its callees and the numbers its
    # globals held (the kind codes, from Kind's order): they name the cached code, so that a change compiles afresh.
    copy.__qualname__ = f"{function.__qualname__}.{_compiled_in(function, callees)}"
    return numba.njit(cache=True)(copy)


def _compiled_in(function, callees) -> str:
    """A digest of the callees' source and of the numbers that ``function`` and they read from their globals."""
    parts = [inspect.getsource(callee) for callee in callees]
    for part in (function, *callees):
        codes = [part.__code__]
        while codes:  # the function's code and that of the functions defined in it
            code = codes.pop()
            parts += [f"{name}={part.__globals__[name]!r}" for name in code.co_names
                      if isinstance(part.__globals__.get(name), (int, float))]
            codes += [constant for constant in code.co_consts if isinstance(constant, types.CodeType)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
