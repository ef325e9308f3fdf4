"""Typed, ranged argparse option types: bad values are refused by the parser with one line, exit 2."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v}: must be a positive integer (>= 1)")
    return v


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v}: must be >= 0")
    return v


def positive_float(text: str) -> float:
    """A number > 0 (seconds, USD)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{v:g}: must be positive")
    return v


def fraction(text: str) -> float:
    """A number in [0, 1)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"{v:g}: must be in [0, 1)")
    return v


def unit_interval(text: str) -> float:
    """A number in (0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v:g}: must be in (0, 1]")
    return v


class Parser(argparse.ArgumentParser):
    """argparse with attune's error line: ``attune: error: ...`` and exit code 2, no usage dump."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"attune: error: {self.prog}: {message}\n")
