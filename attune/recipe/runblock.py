"""Parse a recipe's `run` block (bash text) into exports, entrypoint and flags.

This is a small bash *word splitter*, not a shell: it understands what launch scripts for
slime use (backslash-newline continuations, single and double quotes, ``$(...)`` command
substitutions with nested quotes, ``${...}`` parameter expansions, backticks, comments,
``;``/``&&``/``||``/``|`` command separators, redirections and ``NAME=(...)`` arrays) and
keeps anything it cannot evaluate verbatim. Nothing is expanded or executed.

The main command is the first command that runs Python (``python``, ``python3``,
``python3.12``, any path ending in one of those) or submits a Ray job; failing that, the
last command that is not an export or assignment. With ``ray job submit ... -- cmd``, the
words up to ``--`` are the launcher and the entrypoint is read after it.

Entry point: the argv words before the first flag. For a Python interpreter the
interpreter's own options belong to the entrypoint, and ``-m MODULE`` ends it, so
``python3 -u train.py --x 1`` has entrypoint ``[python3, -u, train.py]`` and
``python3 -m --async --x 1`` has entrypoint ``[python3, -m, --async]``.

Flags: an ordered list of ``(flag, value-or-None)`` pairs. ``--flag=value`` is split at the
first ``=``. A flag followed by several non-flag words (argparse ``nargs='+'``) gets
them joined with one space. Array expansions such as ``${MODEL_ARGS[@]}`` (and ``$X_ARGS``
style variables, which launch scripts use for flag groups) are kept as opaque items
``(word, None)``; `is_expansion` tells them apart from flags.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

__all__ = ["RunBlock", "Word", "parse_run", "split_commands", "unclosed_quote", "is_expansion", "is_flag_word", "quote_argv"]


@dataclass(frozen=True)
class Word:
    """One shell word: `raw` as written (quotes kept), `text` with quotes removed."""

    raw: str
    text: str


@dataclass(frozen=True)
class RunBlock:
    env: dict[str, str] = field(default_factory=dict)
    """`export NAME=VALUE` values and `NAME=VALUE cmd` prefixes, quotes removed,
    command substitutions kept verbatim."""
    assignments: dict[str, str] = field(default_factory=dict)
    """Plain shell variable assignments (`NAME=VALUE` on their own)."""
    launcher: list[str] = field(default_factory=list)
    """Words before a bare `--` (e.g. `ray job submit --address=... --`), else empty."""
    entrypoint: list[str] = field(default_factory=list)
    flags: list[tuple[str, str | None]] = field(default_factory=list)
    flag_args: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    """The same flags with their value words kept apart (`flags` joins them with a space):
    ``--eval-prompt-data aime x.jsonl`` is ``("--eval-prompt-data", ("aime", "x.jsonl"))``."""
    positionals: list[str] = field(default_factory=list)
    """Non-flag words after the entrypoint that no flag could take (before any flag)."""
    other_commands: list[str] = field(default_factory=list)
    """Every other command (not export/assignment, not the main one), words re-joined."""

    def flag_dict(self) -> dict[str, str | None]:
        """Flags as a dict (the last occurrence wins, as with argparse); expansions left out."""
        return {k: v for k, v in self.flags if not is_expansion(k)}

    def has_flag(self, name: str) -> bool:
        return any(k == name for k, _ in self.flags)


# Shell control operators that end a simple command (bash(1), "DEFINITIONS: control operator").
_OPERATORS = ("&&", "||", ";;", ";", "|", "&")
_ASSIGN_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\+?=(.*)$", re.S)
# bash array expansion "${NAME[@]}" / "${NAME[*]}", and scalar flag-group variables
# named like slime's scripts do (MODEL_ARGS, PERF_ARGS, ... in scripts/run-*.sh).
_ARRAY_EXPANSION_RE = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*\[[@*]\]\}$")
_ARGS_VAR_RE = re.compile(r"^\$(\{[A-Za-z_][A-Za-z0-9_]*_ARGS\}|[A-Za-z_][A-Za-z0-9_]*_ARGS)$")
# a word that is a negative number is a value, not a flag (argparse does the same when the
# parser has no options that look like negative numbers)
_NEGATIVE_NUMBER_RE = re.compile(r"^-(\d|\.\d)")
# CPython command line (python(1)): options that take an argument, and -m/-c which end
# the interpreter's options.
_PY_OPTS_WITH_ARG = frozenset({"-X", "-W", "--check-hash-based-pycs"})
_PY_OPTS_ENDING = frozenset({"-m", "-c"})
_PYTHON_RE = re.compile(r"^(?:.*/)?python(?:\d+(?:\.\d+)*)?$")


def is_expansion(word: str) -> bool:
    """True for an opaque array expansion item such as ``${MODEL_ARGS[@]}``."""
    return bool(_ARRAY_EXPANSION_RE.match(word) or _ARGS_VAR_RE.match(word))


def is_flag_word(word: str) -> bool:
    return word.startswith("-") and word != "-" and not _NEGATIVE_NUMBER_RE.match(word)


class _Scanner:
    """Splits bash text into commands of words. Internal; state lives per call."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0
        self.n = len(text)
        self.unclosed: str | None = None  # the quote a word opened and the text never closed

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < self.n else ""

    # -- balanced constructs, returned verbatim -------------------------------------
    def read_single_quoted(self) -> str:
        start = self.i
        end = self.s.find("'", self.i + 1)
        if end < 0:
            self.unclosed = self.unclosed or "'"
        self.i = self.n if end < 0 else end + 1
        return self.s[start:self.i]

    def read_double_quoted(self) -> tuple[str, str]:
        """At '"'. Returns (raw, text)."""
        start = self.i
        self.i += 1
        out: list[str] = []
        closed = False
        while self.i < self.n:
            c = self.s[self.i]
            if c == '"':
                self.i += 1
                closed = True
                break
            if c == "\\" and self.i + 1 < self.n:
                nxt = self.s[self.i + 1]
                # inside double quotes backslash escapes only these (bash(1), QUOTING)
                if nxt == "\n":
                    self.i += 2
                    continue
                if nxt in '$`"\\':
                    out.append(nxt)
                    self.i += 2
                    continue
                out.append(c)
                self.i += 1
                continue
            if c == "$" and self.peek(1) in "({":
                out.append(self.read_dollar())
                continue
            if c == "`":
                out.append(self.read_backtick())
                continue
            out.append(c)
            self.i += 1
        if not closed:
            self.unclosed = self.unclosed or '"'
        return self.s[start:self.i], "".join(out)

    def read_backtick(self) -> str:
        start = self.i
        self.i += 1
        while self.i < self.n and self.s[self.i] != "`":
            self.i += 2 if self.s[self.i] == "\\" else 1
        self.i = min(self.i + 1, self.n)
        return self.s[start:self.i]

    def read_balanced(self, open_c: str, close_c: str) -> str:
        """At open_c. Reads to the matching close_c, skipping quoted text."""
        start = self.i
        depth = 0
        while self.i < self.n:
            c = self.s[self.i]
            if c == "\\":
                self.i += 2
                continue
            if c == "'":
                self.read_single_quoted()
                continue
            if c == '"':
                self.read_double_quoted()
                continue
            if c == "`":
                self.read_backtick()
                continue
            if c == open_c:
                depth += 1
            elif c == close_c:
                depth -= 1
                if depth == 0:
                    self.i += 1
                    break
            self.i += 1
        return self.s[start:self.i]

    def read_dollar(self) -> str:
        """At '$' followed by '(' or '{'. Returns the construct verbatim."""
        self.i += 1
        if self.peek() == "(":
            return "$" + self.read_balanced("(", ")")
        return "$" + self.read_balanced("{", "}")

    # -- commands -------------------------------------------------------------------
    def commands(self) -> list[list[Word]]:
        self.cmds: list[list[Word]] = []
        self.words: list[Word] = []
        self.raw: list[str] = []  # the current word as written
        self.text: list[str] = []  # the current word with its quotes removed
        self.in_word = False
        while self.i < self.n:
            self._step(self.s[self.i])
        self._end_command()
        return self.cmds

    def _step(self, c: str) -> None:
        """Consume the construct at ``self.i`` (whose first character is ``c``)."""
        if c == "\\":
            nxt = self.peek(1)
            if nxt != "\n":  # a backslash-newline is a line continuation: nothing of it is kept
                self._add(c + nxt, nxt)
            self.i += 2
        elif c in " \t\r":
            self._end_word()
            self.i += 1
        elif c == "\n":
            self._end_command()
            self.i += 1
        elif c == "#" and not self.in_word:
            end = self.s.find("\n", self.i)
            self.i = self.n if end < 0 else end
        elif self._quoted(c):
            pass
        elif c == "(" and self.in_word and "".join(self.raw).endswith("="):
            a = self.read_balanced("(", ")")  # NAME=( ... ) array assignment: kept verbatim
            self._add(a, a)
        elif (op := next((o for o in _OPERATORS if self.s.startswith(o, self.i)), None)) is not None:
            self._end_command()
            self.i += len(op)
        elif c in "<>" and (not self.in_word or "".join(self.raw).isdigit()):
            self._skip_redirection()
        else:
            self._add(c, c)
            self.i += 1

    def _quoted(self, c: str) -> bool:
        """Read a quoted string, ``$(...)`` / ``${...}`` or backticks into the word; False when ``c`` starts none."""
        if c == "'":
            q = self.read_single_quoted()
            self._add(q, q[1:-1] if q.endswith("'") and len(q) > 1 else q[1:])
        elif c == '"':
            self._add(*self.read_double_quoted())
        elif c == "$" and self.peek(1) in ("(", "{"):
            d = self.read_dollar()
            self._add(d, d)
        elif c == "`":
            b = self.read_backtick()
            self._add(b, b)
        else:
            return False
        return True

    def _skip_redirection(self) -> None:
        """A redirection ([n]>file, [n]>&m, <file ...) is dropped with its target."""
        self.raw.clear()
        self.text.clear()
        self.in_word = False
        while self.i < self.n and self.s[self.i] in "<>&":
            self.i += 1
        while self.i < self.n and self.s[self.i] in " \t":
            self.i += 1
        # the target word (or fd digits after >&)
        while self.i < self.n and self.s[self.i] not in " \t\r\n;|&":
            if self.s[self.i] == "'":
                self.read_single_quoted()
            elif self.s[self.i] == '"':
                self.read_double_quoted()
            else:
                self.i += 1

    def _add(self, raw: str, text: str) -> None:
        self.raw.append(raw)
        self.text.append(text)
        self.in_word = True

    def _end_word(self) -> None:
        if self.in_word:
            self.words.append(Word("".join(self.raw), "".join(self.text)))
        self.raw.clear()
        self.text.clear()
        self.in_word = False

    def _end_command(self) -> None:
        self._end_word()
        if self.words:
            self.cmds.append(self.words)
        self.words = []


def unclosed_quote(text: str) -> str | None:
    """The quote character (' or ") a word of ``text`` opens and never closes, else None: bash would refuse the
    text, and everything after the quote would silently become one word."""
    sc = _Scanner(text)
    sc.commands()
    return sc.unclosed


def split_commands(text: str) -> list[list[Word]]:
    """The simple commands of a bash text, each a list of Words (comments, operators and
    redirections removed, continuations joined)."""
    return _Scanner(text).commands()


def _is_python(word: str) -> bool:
    return bool(_PYTHON_RE.match(word))


def _is_main(words: list[str]) -> bool:
    return any(_is_python(w) for w in words) or words[:3] == ["ray", "job", "submit"]


def _entrypoint(words: list[str]) -> tuple[list[str], list[str]]:
    """Split argv (after any launcher) into (entrypoint, rest)."""
    if not words:
        return [], []
    if _is_python(words[0]):
        ep = [words[0]]
        i = 1
        while i < len(words) and words[i].startswith("-") and words[i] != "-":
            w = words[i]
            if w in _PY_OPTS_ENDING:
                ep.extend(words[i:i + 2])
                return ep, words[i + 2:]
            if w in _PY_OPTS_WITH_ARG:
                ep.extend(words[i:i + 2])
                i += 2
                continue
            if re.fullmatch(r"-[bBdEhiIOPqsSuvVx]+", w):  # python(1) single-letter switches
                ep.append(w)
                i += 1
                continue
            # an unknown option: argv from here on are flags
            return ep, words[i:]
        if i < len(words):
            ep.append(words[i])  # the script
            i += 1
        return ep, words[i:]
    i = 0
    while i < len(words) and not is_flag_word(words[i]) and not is_expansion(words[i]):
        i += 1
    return words[:i], words[i:]


def _flags(words: list[str]) -> tuple[list[tuple[str, tuple[str, ...]]], list[str]]:
    flags: list[tuple[str, list[str]]] = []
    positionals: list[str] = []
    current: list[str] | None = None
    for w in words:
        if is_expansion(w):
            flags.append((w, []))
            current = None
        elif is_flag_word(w):
            if w.startswith("--") and "=" in w:
                name, value = w.split("=", 1)
                flags.append((name, [value]))
                current = None
            else:
                current = []
                flags.append((w, current))
        elif current is not None:
            current.append(w)
        else:
            positionals.append(w)
    return [(k, tuple(v)) for k, v in flags], positionals


def _render(words: list[Word]) -> str:
    return " ".join(w.raw for w in words)


def parse_run(text: str) -> RunBlock:
    """Parse a run block. Never raises on odd shell; unknown constructs stay verbatim."""
    env: dict[str, str] = {}
    assignments: dict[str, str] = {}
    main: list[Word] | None = None
    main_prefix: dict[str, str] = {}
    others: list[tuple[list[Word], dict[str, str], list[Word]]] = []
    for cmd in split_commands(text):
        first = cmd[0].text
        if first in ("export", "declare", "typeset", "local"):
            for w in cmd[1:]:
                m = _ASSIGN_RE.match(w.text)
                if m:
                    (env if first == "export" else assignments)[m.group(1)] = m.group(2)
            continue
        # leading NAME=VALUE words: plain assignments, or env prefixes of a command
        j = 0
        prefix: dict[str, str] = {}
        while j < len(cmd) and _ASSIGN_RE.match(cmd[j].raw):
            m = _ASSIGN_RE.match(cmd[j].text)
            prefix[m.group(1)] = m.group(2)
            j += 1
        rest = cmd[j:]
        if not rest:
            assignments.update(prefix)
            continue
        if main is None and _is_main([w.text for w in rest]):
            main, main_prefix = rest, prefix
            continue
        others.append((cmd, prefix, rest))
    if main is None and others:
        _, main_prefix, main = others.pop()
    env.update(main_prefix)
    launcher: list[str] = []
    words = [w.text for w in (main or [])]
    if words and "--" in words and not _is_python(words[0]):
        k = words.index("--")
        launcher, words = words[: k + 1], words[k + 1:]
    entrypoint, rest = _entrypoint(words)
    flag_args, positionals = _flags(rest)
    flags = [(k, " ".join(v) if v else None) for k, v in flag_args]
    return RunBlock(
        env=env,
        assignments=assignments,
        launcher=launcher,
        entrypoint=entrypoint,
        flags=flags,
        flag_args=flag_args,
        positionals=positionals,
        other_commands=[_render(c) for c, _, _ in others],
    )


def quote_argv(words: list[str]) -> str:
    """Join argv words into one shell line (opaque expansions left unquoted)."""
    return " ".join(w if is_expansion(w) else shlex.quote(w) for w in words)
