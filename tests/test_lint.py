"""ruff (pyproject [tool.ruff]: pyflakes, pycodestyle errors and warnings, import order, bugbear) is clean."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    exe = shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    proc = subprocess.run([exe, "check", "--no-cache", "--output-format", "concise", "attune", "tests", "benchmarks",
                           "tools"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
