"""``compiled``: numba's ``njit`` with the project's settings, typed for mypy.

numba is untyped, so a decorated function would lose its signature; ``compiled`` keeps it.
Kernels are cached on disk (``cache=True``: the first process compiles, later ones load) and
release the GIL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba

_F = TypeVar("_F", bound=Callable[..., Any])
_njit: Any = numba.njit


def compiled(fn: _F) -> _F:
    return cast(_F, _njit(cache=True, nogil=True)(fn))


def compiled_inline(fn: _F) -> _F:
    """``compiled``, inlined into its callers at numba's level: for small helpers on hot
    paths that take records of arrays (a call would pay reference counting per array)."""
    return cast(_F, _njit(cache=True, nogil=True, inline="always")(fn))
