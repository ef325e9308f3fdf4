"""attune's command line: the only place that prints, exits and configures logging.

Every command is a thin function over ``attune.api``. Errors: an ``AttuneError`` becomes one line on
stderr and its exit code (2 for bad input, 1 for run-time failures); anything else is a bug and keeps its
traceback. ``--debug`` or ``ATTUNE_DEBUG=1`` re-raises attune's errors with their traceback too.
"""

from __future__ import annotations

import logging
import os
import sys

from attune.errors import AttuneError
from attune.search.storage import mask_text

from .parser import build_parser
from .signals import TERMINATED_EXIT, Terminated, terminate_as_interrupt

__all__ = ["main", "build_parser"]


class _MaskingFormatter(logging.Formatter):
    """Log lines with every URL's password masked (attune.search.storage.mask_text)."""

    def format(self, record: logging.LogRecord) -> str:
        return mask_text(super().format(record))


def _configure_logging(verbose: bool) -> None:
    from rich.logging import RichHandler

    root = logging.getLogger("attune")
    if not any(isinstance(h, RichHandler) for h in root.handlers):
        handler = RichHandler(show_time=False, show_path=False, markup=False, rich_tracebacks=False)
        handler.setFormatter(_MaskingFormatter("%(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)  # progress has its own display
    root.propagate = False
    # Optuna logs every trial at INFO; the tuner reports progress itself
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "flags", None) and args.flags[0] == "--":
        args.flags = args.flags[1:]
    if getattr(args, "flags", None) and not args.flags[0].startswith("-"):
        print(f"attune: error: {args.flags[0][:60]!r} after -- is a value without a flag; give flags like "
              f"--tensor-model-parallel-size 2", file=sys.stderr)
        return 2
    debug = bool(getattr(args, "debug", False)) or os.environ.get("ATTUNE_DEBUG", "") not in ("", "0")
    _configure_logging(getattr(args, "verbose", False))
    try:
        with terminate_as_interrupt():
            return int(args.func(args) or 0)
    except Terminated:
        print("attune: terminated (SIGTERM); the running trial was stopped and marked interrupted", file=sys.stderr)
        return TERMINATED_EXIT
    except KeyboardInterrupt:
        print("attune: interrupted", file=sys.stderr)
        return 130
    except AttuneError as e:
        if debug:
            raise
        text = mask_text(" ".join(str(e).split())) or type(e).__name__
        print(f"attune: error: {text}", file=sys.stderr)
        return e.exit_code
