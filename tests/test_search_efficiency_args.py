"""benchmarks/search_efficiency.py's `--groups`: world ranges parsed once, a bad range a one-line argparse error."""

import argparse
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "search_efficiency.py"
_spec = importlib.util.spec_from_file_location("search_efficiency", _PATH)
se = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(se)


def test_groups_parse_ranges_and_single_worlds():
    assert se.world_groups("0-7,8-14, 20") == ((0, 7), (8, 14), (20, 20))


@pytest.mark.parametrize("bad", ["x", "0-7,a-b", "7-3", "-2", "0-"])
def test_bad_groups_are_one_line_errors(bad, capsys):
    with pytest.raises(argparse.ArgumentTypeError):
        se.world_groups(bad)
    with pytest.raises(SystemExit) as e:
        se.main(["--kind", "structural", "--merge", "none.json", "--groups", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("search_efficiency.py: error: argument --groups:") or "error: argument --groups" in err[-1]
