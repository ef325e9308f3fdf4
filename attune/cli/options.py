"""Typed, ranged argparse option types: bad values are refused by the parser with one line, exit 2."""

from __future__ import annotations

import argparse
import math


def _ranged(cast, ok, rule: str):
    """An argparse type: ``cast`` the text, then refuse values ``ok`` rejects, saying the ``rule``."""
    what = "an integer" if cast is int else "a number"

    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not {what}") from None
        if isinstance(v, float) and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"'{text}': must be a finite number")
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{v:g}: must be {rule}")
        return v

    parse.__doc__ = f"{what.capitalize()} that is {rule}."
    return parse


positive_int = _ranged(int, lambda v: v >= 1, "a positive integer (>= 1)")
nonnegative_int = _ranged(int, lambda v: v >= 0, ">= 0")
positive_float = _ranged(float, lambda v: v > 0, "positive")  # seconds, USD
fraction = _ranged(float, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
unit_interval = _ranged(float, lambda v: 0.0 < v <= 1.0, "in (0, 1]")


class Parser(argparse.ArgumentParser):
    """argparse with attune's error line: ``attune: error: ...`` and exit code 2, no usage dump."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"attune: error: {self.prog}: {message}\n")
