"""Typed, ranged argparse option types: bad values are refused by the parser with one line, exit 2."""

from __future__ import annotations

import argparse
import dataclasses
import math

from attune.search.options import cli_fields


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


_KINDS = {"positive_int": positive_int, "nonnegative_int": nonnegative_int, "positive_float": positive_float,
          "fraction": fraction, "unit_interval": unit_interval}


def _default_text(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_options(p: argparse.ArgumentParser, cls: type, *, names: tuple[str, ...] | None = None,
                required: bool = True) -> None:
    """The options of dataclass ``cls`` (attune.search.options) on ``p``: flag, type, choices and default from each
    field, the help from its docstring. ``names``: only these fields; ``required=False``: none is required."""
    for f, cli, doc in cli_fields(cls):
        if names is not None and f.name not in names:
            continue
        if cli.positional:
            p.add_argument(f.name, help=doc)
            continue
        flag = cli.flag or "--" + f.name.replace("_", "-")
        kw: dict = {"dest": f.name, "help": doc}
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory() \
            if f.default_factory is not dataclasses.MISSING else None
        if cli.switch:
            kw.update(action="store_true" if cli.switch == "on" else "store_false", default=default)
        elif cli.append:
            kw.update(action="append", default=default, metavar=cli.metavar)
        else:
            kw.update(default=default, required=cli.required and required)
            if cli.kind:
                kw["type"] = _KINDS[cli.kind]
            if cli.choices is not None:
                kw["choices"] = list(cli.choices)
            if cli.choices is None:
                kw["metavar"] = cli.metavar or flag.lstrip("-").replace("-", "_").upper()
            if default is not None and "(default" not in doc:
                kw["help"] = f"{doc} (default {_default_text(default)})"
        p.add_argument(flag, **kw)


def options_from_args(cls: type, args: argparse.Namespace):
    """The ``cls`` options of a command line parsed by a parser ``add_options(p, cls)`` built."""
    return cls(**{f.name: getattr(args, f.name) for f, _, _ in cli_fields(cls)})
