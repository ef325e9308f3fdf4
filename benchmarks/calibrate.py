"""Thin wrapper kept for old habits: `python benchmarks/calibrate.py [--fit] [--corpus DIR] [--out DIR]` is
`attune calibrate` (predict the public corpus, score it per series; --fit refits the global coefficients and
writes attune/estimator/coefficients.yaml)."""

import sys

from attune.cli import main

if __name__ == "__main__":
    sys.exit(main(["calibrate", *sys.argv[1:]]))
