"""Layouts as columns: a batch of layouts held as one numpy array per `Layout` field (structure of arrays).

The search space is enumerated, checked and estimated as columns; `Layout` objects are built only for the
layouts that are proposed, reported or written (`LayoutColumns.layout`). A single layout is a batch of one
(`LayoutColumns.from_layouts([layout])`).

Encoding, one rule per field type (read from `Layout`'s annotations, so a new field needs no edit here):
- ``int``: ``int64``; ``int | None``: ``int64`` with ``NONE_INT`` (-1) for None (every such field is >= 1
  when set: `Layout.__post_init__` and the rules refuse 0 and negatives);
- ``bool``: ``bool``;
- ``float``: ``float64``; ``float | None``: ``float64`` with NaN for None;
- strings, literals and module tuples: ``object`` arrays holding the values themselves (None stays None).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterable, Mapping

import numpy as np

from attune.errors import LayoutError
from attune.spec.layout import Layout

NONE_INT = -1
"""How an ``int | None`` column writes None."""

_HINTS = typing.get_type_hints(Layout)
FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Layout))
"""Every Layout field, in declaration order: the columns of a batch."""
DEFAULTS: dict[str, object] = {f.name: f.default for f in dataclasses.fields(Layout)}


def _kind(hint: object) -> str:
    """'int', 'opt_int', 'bool', 'float', 'opt_float' or 'object' for one field's annotation."""
    args = set(typing.get_args(hint))
    if hint is bool:
        return "bool"
    if hint is int:
        return "int"
    if hint is float:
        return "float"
    if args == {int, type(None)}:
        return "opt_int"
    if args == {float, type(None)}:
        return "opt_float"
    return "object"


KINDS: dict[str, str] = {name: _kind(_HINTS[name]) for name in FIELDS}
"""Each field's column encoding (see the module docstring)."""
_DTYPES = {"int": np.int64, "opt_int": np.int64, "bool": np.bool_, "float": np.float64, "opt_float": np.float64,
           "object": object}


def _encode(name: str, values: list) -> np.ndarray:
    kind = KINDS[name]
    if kind == "opt_int":
        values = [NONE_INT if v is None else v for v in values]
    elif kind == "opt_float":
        values = [math.nan if v is None else v for v in values]
    if kind == "object":
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out
    return np.asarray(values, dtype=_DTYPES[kind])


def _decode(name: str, value: object) -> object:
    kind = KINDS[name]
    if kind == "opt_int":
        return None if value == NONE_INT else int(value)
    if kind == "opt_float":
        return None if math.isnan(value) else float(value)
    if kind == "int":
        return int(value)
    if kind == "bool":
        return bool(value)
    if kind == "float":
        return float(value)
    return value


class LayoutColumns:
    """A batch of layouts: one numpy array per `Layout` field, all of one length.

    Columns not given are filled with the field's default. The arrays are not copied; treat them as read-only.
    """

    __slots__ = ("_cols", "_n", "_source")

    def __init__(self, columns: Mapping[str, np.ndarray | Iterable], n: int | None = None) -> None:
        unknown = sorted(set(columns) - set(FIELDS))
        if unknown:
            raise LayoutError(f"layout columns {', '.join(unknown)}: not Layout fields; allowed: {', '.join(FIELDS)}")
        cols: dict[str, np.ndarray] = {}
        for name, arr in columns.items():
            arr = arr if isinstance(arr, np.ndarray) and arr.dtype == _DTYPES[KINDS[name]] else _encode(name, list(arr))
            cols[name] = arr
        lengths = {len(a) for a in cols.values()}
        if n is None:
            if len(lengths) != 1:
                raise LayoutError("layout columns: give at least one column, all of one length")
            n = lengths.pop()
        elif lengths - {n}:
            raise LayoutError(f"layout columns: lengths {sorted(lengths)} differ from the batch size {n}")
        for name in FIELDS:
            if name not in cols:
                cols[name] = _encode(name, [DEFAULTS[name]] * n)
        self._cols = cols
        self._n = n
        self._source: list[Layout] | None = None

    @classmethod
    def from_layouts(cls, layouts: Iterable[Layout]) -> "LayoutColumns":
        """The batch of these layouts, in order (a single layout is a batch of one)."""
        layouts = list(layouts)
        out = cls({name: _encode(name, [getattr(lay, name) for lay in layouts]) for name in FIELDS}, n=len(layouts))
        out._source = layouts  # ``layout(i)`` hands these back instead of rebuilding them
        return out

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, name: str) -> np.ndarray:
        """One field's column."""
        return self._cols[name]

    def columns(self) -> dict[str, np.ndarray]:
        """Every column by field name (the arrays themselves)."""
        return dict(self._cols)

    def take(self, index: np.ndarray | slice | list[int]) -> "LayoutColumns":
        """The rows selected by a boolean mask, an index array or a slice, in that order."""
        cols = {name: arr[index] for name, arr in self._cols.items()}
        n = len(next(iter(cols.values())))
        out = LayoutColumns(cols, n=n)
        if self._source is not None:
            out._source = [self._source[i] for i in np.arange(self._n)[index].tolist()]
        return out

    def layout(self, i: int) -> Layout:
        """Row i as a `Layout` (its field checks run here; the layout itself for a batch made by ``from_layouts``)."""
        if self._source is not None:
            return self._source[i]
        return Layout(**{name: _decode(name, arr[i]) for name, arr in self._cols.items()})

    def source(self) -> tuple[Layout, ...] | None:
        """The layouts the batch was made of (``from_layouts``, and ``take`` of such a batch), else None."""
        return None if self._source is None else tuple(self._source)

    def layouts(self) -> list[Layout]:
        """Every row as a `Layout`, in order."""
        return [self.layout(i) for i in range(self._n)]
