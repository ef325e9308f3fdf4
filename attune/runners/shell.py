"""The one place that builds text a shell or Ray reads: commands, ``bash -c`` scripts, Ray ``env_vars``.

* A Ray job's entrypoint runs under a shell (ray 2.60 ``dashboard/modules/job/job_supervisor.py:184`` starts it
  with ``subprocess.Popen(..., shell=True)``), so every
  word of it is quoted here with :func:`shlex.quote`: ``$(...)``, backticks, ``;``, quotes, ``$HOME`` and
  newlines stay literal text of one argument.
* Ray expands ``runtime_env["env_vars"]`` values on the node with ``os.path.expandvars`` (ray 2.60,
  ``ray/_private/utils.py`` ``update_envs``), which has no escape for ``$``. A value meant literally (a path,
  a cluster-file env value) that holds ``$NAME`` or ``${...}`` would silently change, so :func:`ray_env_vars`
  refuses it with one line; values attune writes to be expanded (``${PYTHONPATH}``) are passed as such.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping

from attune.errors import UserInputError

__all__ = ["ShellValueError", "word", "command", "bash_c", "ray_expands", "check_ray_literal", "ray_env_vars"]

# posixpath.expandvars' own pattern (CPython Lib/posixpath.py, _varprog): what Ray's update_envs expands.
_EXPANDVARS_RE = re.compile(r"\$(\w+|\{[^}]*\})", re.ASCII)


class ShellValueError(UserInputError):
    """A value that cannot travel literally to a shell or to Ray (exit code 2)."""


def word(value: object) -> str:
    """One shell word that a POSIX shell reads back as exactly ``str(value)``."""
    text = str(value)
    if "\x00" in text:
        raise ShellValueError(f"{text[:60]!r}: a NUL byte cannot be passed to a command")
    return shlex.quote(text)


def command(argv: Iterable[object]) -> str:
    """A command line a shell splits back into exactly ``argv`` (every word quoted)."""
    words = [word(a) for a in argv]
    if not words:
        raise ShellValueError("an empty command")
    return " ".join(words)


def bash_c(script: str) -> str:
    """``bash -c '<script>'``: the script as bash's one argument."""
    return "bash -c " + word(script)


def ray_expands(value: str) -> bool:
    """Whether Ray's ``os.path.expandvars`` could change ``value`` on a node."""
    return bool(_EXPANDVARS_RE.search(value))


def check_ray_literal(value: str, what: str) -> str:
    """``value`` unchanged, or ShellValueError when Ray would expand part of it (``what`` names it)."""
    m = _EXPANDVARS_RE.search(value)
    if m:
        raise ShellValueError(f"{what}: {value[:80]!r} holds {m.group(0)!r}, which Ray's runtime_env would expand "
                              f"(os.path.expandvars, no escape exists); values are literal, write it out in full")
    if "\x00" in value:
        raise ShellValueError(f"{what}: a NUL byte cannot be passed in an environment variable")
    return value


def ray_env_vars(literal: Mapping[str, object], expanded: Mapping[str, str] | None = None,
                 source: str = "env") -> dict[str, str]:
    """A runtime_env ``env_vars`` dict: ``literal`` values checked to reach the node unchanged, ``expanded``
    values (written by attune, e.g. ``/x:${PYTHONPATH}``) passed for Ray to expand. Expanded keys win."""
    out = {str(k): check_ray_literal(str(v), f"{source}.{k}") for k, v in literal.items()}
    out.update({str(k): str(v) for k, v in (expanded or {}).items()})
    return out
