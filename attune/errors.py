"""The error contract of attune: every error a user can cause or meet is an ``AttuneError``.

* ``UserInputError`` (exit code 2): bad input (a flag, a file, a name, a layout rule). The message is one
  line naming what is wrong and what is allowed.
* Run-time failures (exit code 1): ``NoFeasibleLayout`` (the search space has no layout that fits),
  ``TrialFailed`` (a measured run that could not produce a result where one was required),
  ``RunnerError`` (a runner could not be started or reached), ``MissingDependency`` (an optional extra
  is not installed; exit 2, since installing it is the user's move).

The CLI catches ``AttuneError`` only; anything else is a bug and keeps its traceback. Every specific
error below subclasses one of these, and ``UserInputError`` also subclasses ``ValueError`` so library
callers may catch either.
"""

from __future__ import annotations


class AttuneError(Exception):
    """Root of every error attune raises on purpose."""

    exit_code: int = 1


class UserInputError(AttuneError, ValueError):
    """Bad input: the message names what is wrong and what is allowed (exit code 2)."""

    exit_code = 2


class MissingDependency(AttuneError, ImportError):
    """An optional extra is needed (``pip install 'attune[torch]'`` and the like); exit code 2."""

    exit_code = 2


class NoFeasibleLayout(AttuneError):
    """No layout of the search space passes the rules and fits in memory (exit code 1)."""


class TrialFailed(AttuneError):
    """A measured run failed where the command needed its result (exit code 1)."""


class RunnerError(AttuneError, RuntimeError):
    """A runner could not start, reach its cluster or read its own output (exit code 1)."""


# ------------------------------------------------------------------ specific input errors, by layer
class ModelError(UserInputError):
    """A model that cannot be read: unknown name, unsupported family, missing field."""


class HardwareError(UserInputError):
    """An unknown GPU type or a malformed GPU spec."""


class EngineError(UserInputError):
    """An unknown training engine."""


class LayoutError(UserInputError):
    """A layout or workload that breaks a rule; the message names the rule and what is allowed."""


class FlagError(UserInputError):
    """A Megatron-LM / slime flag with a bad value."""


class RecipeError(UserInputError):
    """A recipe that cannot be read or does not satisfy the schema."""


class SearchSpaceError(UserInputError):
    """A search-space file with an unknown knob or a bad domain."""


class ClusterFileError(UserInputError):
    """A cluster file (slime runner) that is missing a field or names a bad path."""


def require(module: str, extra: str):
    """Import an optional dependency or raise ``MissingDependency`` naming the extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependency(
            f"{module} is not installed ({exc}); install it with: pip install 'attune[{extra}]'") from None
