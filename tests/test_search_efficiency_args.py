"""benchmarks/search_efficiency.py's `--groups`, `--targets` and `--world-list`: parsed once by argparse, a bad
value a one-line argparse error (exit 2), not a traceback."""

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
    assert "error: argument --groups" in err[-1]


def test_targets_and_world_lists_parse_numbers():
    assert se.numbers("0,1, 2") == (0, 1, 2)


@pytest.mark.parametrize("flag", ["--targets", "--world-list"])
@pytest.mark.parametrize("bad", ["x", "0,,1", "-1", "1.5"])
def test_bad_number_lists_are_one_line_errors(flag, bad, capsys):
    with pytest.raises(SystemExit) as e:
        se.main(["--kind", "structural", "--merge", "none.json", flag, bad])
    assert e.value.code == 2
    assert f"error: argument {flag}" in capsys.readouterr().err.strip().splitlines()[-1]
