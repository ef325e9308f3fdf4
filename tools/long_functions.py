#!/usr/bin/env python3
"""List the functions in attune/ longer than N lines (default 60), longest first.

    python3 tools/long_functions.py [N] [--root DIR]

A function's length is the lines of its ``def`` as the ``ast`` module counts them
(``end_lineno - lineno + 1``: decorators excluded, docstring and nested definitions included).
Methods are named ``Class.method``; nested functions ``outer.<locals>.inner``. Always exits 0:
the list is a report, not a gate.
"""

from __future__ import annotations

import argparse
import ast
import pathlib


def long_functions(root: pathlib.Path, limit: int) -> list[tuple[int, str]]:
    """(lines, "path:qualified.name") for every function in ``root`` over ``limit`` lines, longest first."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = path.relative_to(root.parent).as_posix()
        for lines, name in _walk(tree, ""):
            if lines > limit:
                found.append((lines, f"{rel}:{name}"))
    return sorted(found, key=lambda item: (-item[0], item[1]))


def _walk(node: ast.AST, prefix: str):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + child.name
            yield child.end_lineno - child.lineno + 1, name
            yield from _walk(child, name + ".<locals>.")
        elif isinstance(child, ast.ClassDef):
            yield from _walk(child, prefix + child.name + ".")
        else:
            yield from _walk(child, prefix)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("limit", nargs="?", type=int, default=60, help="report functions over this many lines")
    parser.add_argument("--root", default=str(pathlib.Path(__file__).resolve().parent.parent / "attune"),
                        help="package folder to scan (default: attune/ beside tools/)")
    args = parser.parse_args()
    found = long_functions(pathlib.Path(args.root), args.limit)
    for lines, name in found:
        print(f"{lines:5d}  {name}")
    print(f"{len(found)} functions over {args.limit} lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
