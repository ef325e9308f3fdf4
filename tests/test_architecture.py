"""The layer contract (pyproject [tool.importlinter]) holds: a cycle or an upward import fails CI."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("import-linter is not installed: pip install -e '.[test]'")
    proc = subprocess.run([exe, str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_no_function_local_imports_of_attune():
    """Imports of attune's own modules sit at the top of a module, where the graph can see them."""
    offenders = []
    for path in (ROOT / "attune").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.lstrip()
            if line != stripped and (stripped.startswith("from attune") or stripped.startswith("from .")
                                     or stripped.startswith("import attune")):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {stripped}")
    assert not offenders, "\n".join(offenders)


def test_library_code_does_not_print_or_exit():
    """Only attune.cli prints and exits (entry points run on cluster nodes are marked `# entry point`)."""
    offenders = []
    for path in (ROOT / "attune").rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[1] == "cli":
            continue
        text = path.read_text()
        if "# entry point" in text:  # runs as `python3 -m ...` on a node or in a worker process
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if line.startswith('if __name__ == "__main__"'):
                break  # a module's own __main__ block may print and exit
            s = line.strip()
            if s.startswith("print(") or "sys.exit(" in s:
                offenders.append(f"{rel}:{n}: {s}")
    assert not offenders, "\n".join(offenders)
