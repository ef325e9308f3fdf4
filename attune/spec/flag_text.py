"""How a number is written as a slime / Megatron-LM flag value, the way slime's ``scripts/models/*.sh`` write them
(``--rotary-base 1000000``, ``--norm-epsilon 1e-6``, ``--rotary-percent 1.0``). One owner for the family plug-ins'
model arguments and the slime launch. A leaf: it imports nothing of attune but the errors.
"""

from __future__ import annotations

import math
import re

from attune.errors import UserInputError

_EXPONENT = re.compile(r"e([+-])0*(\d)")


def number(x: float | int, error: type[UserInputError] = UserInputError) -> str:
    """Compact number text: 10000000.0 -> 10000000, 1e-06 -> 1e-6, 0.25 -> 0.25; a bool or a non-finite float
    raises ``error`` (the caller's one-line error class)."""
    if isinstance(x, bool):
        raise error(f"expected a number, got {x!r}")
    if isinstance(x, int):
        return str(x)
    if not math.isfinite(x):
        raise error(f"expected a finite number, got {x!r}")
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return _EXPONENT.sub(lambda m: "e" + ("-" if m.group(1) == "-" else "") + m.group(2), repr(float(x)))


def floating(x: float, error: type[UserInputError] = UserInputError) -> str:
    """A float flag value that stays a float (0.0, not 0)."""
    s = number(x, error)
    return s if any(c in s for c in ".e") else s + ".0"
