"""Leave-one-series-out of the low-precision fit stage (issue 22): `python benchmarks/precision_loso.py [--corpus DIR]`.

For every low-precision series of the corpus, the low-precision coefficients are fitted without it (the dense and MoE
coefficients held at the shipped values) and its rows predicted; prints MAPE, bias and Spearman per precision class
(and dense / MoE apart), held out, next to the in-sample figures of the shipped coefficients. About a minute."""

import argparse

from attune.calibrate.corpus import load_corpus
from attune.calibrate.fit import current
from attune.calibrate.precision_fit import leave_one_series_out
from attune.calibrate.report import predict_row, score


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=None)
    corpus = load_corpus(ap.parse_args().corpus)
    held = leave_one_series_out(corpus, current())
    shipped = [predict_row(r) for r in corpus.expressed if r.low_precision and r.has_throughput]
    print(f"{'group':22s} {'rows':>4s} {'held-out MAPE':>13s} {'bias':>7s} {'rho':>5s}   {'in-sample MAPE':>14s}")
    for pc in ("fp8", "mxfp8"):
        for part in ("all", "dense", "MoE"):
            pick = lambda ps, pc=pc, part=part: [p for p in ps if p.row.precision == pc and (  # noqa: E731
                part == "all" or (p.row.model.moe is None) == (part == "dense"))]
            h, s = pick(held), pick(shipped)
            if not h:
                continue
            a, b = score(pc, h), score(pc, s)
            rho = "-" if a.spearman is None else f"{a.spearman:.2f}"
            print(f"{pc + ' ' + part:22s} {a.throughput_rows:4d} {100 * a.mape:12.1f}% {100 * a.bias:+6.1f}% {rho:>5s}"
                  f"   {100 * b.mape:13.1f}%")


if __name__ == "__main__":
    main()
