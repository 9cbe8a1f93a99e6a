"""Type predicates for argument checks, shared by every layer (NumPy only).

Python's bool is an int, and NumPy scalars are not Python numbers: a count or an index must accept
np.int64 (sizes read from shapes) and refuse True, which int() and float() would read as 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["first_repeat", "is_int", "is_real"]


def is_int(x: Any) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    """A Python or NumPy integer or float, not a bool (NaN and inf included: check them apart)."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def first_repeat(items: Iterable[Any]) -> Any:
    """The first item equal to an earlier one, or None (a list that names something twice)."""
    seen = set()
    for x in items:
        if x in seen:
            return x
        seen.add(x)
    return None
