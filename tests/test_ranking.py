"""Issue 18 item 5: the rank inside a sweep (one model, GPU and precision of a series) and the dense
leave-one-series-out table, on hand-made corpora (the real corpus's table is in reports/calibration/)."""

import pytest
import yaml

from attune.calibrate.corpus import load_corpus
from attune.calibrate.ranking import leave_one_series_out_table, loso_markdown, sweeps, sweeps_markdown
from attune.calibrate.report import predict
from attune.cli import main

GEOMETRY = dict(name="Nemotron-4 15B", layers=32, hidden=6144, ffn=24576, heads=48, kv_heads=8, vocab=256000,
                mlp="squared_relu")


def _row(rid: str, series: str, tps: float, **kw) -> dict:
    row = dict(id=rid, series=series, model=dict(GEOMETRY), engine="Megatron-LM (Megatron-Core)",
               gpu="H100-SXM-80GB (DGX-H100)", num_gpus=16, precision="bf16", precision_class="bf16",
               low_precision=False, seq_len=4096, global_batch=64, micro_batch=1, tp=4, pp=1, vpp=None, cp=1,
               dp=4, sp=True, recompute=None, dist_optimizer=True, measured=dict(metric="step_time_s", value=1.0),
               derived=dict(tokens_per_s_per_gpu=tps), source=dict(url="hand-made"))
    row.update(kw)
    return row


def _sweep_rows(series: str, reverse: bool = False) -> list[dict]:
    layouts = [dict(tp=4, dp=4), dict(tp=2, dp=8), dict(tp=8, dp=2), dict(tp=4, dp=4, micro_batch=2)]
    return [_row(f"{series}-{i}", series, 1000.0, **lay) for i, lay in enumerate(layouts)]


def _write(tmp_path, rows):
    (tmp_path / "dense.yaml").write_text(yaml.safe_dump(rows))
    return load_corpus(tmp_path, include_seed=False)


def test_sweep_rank_follows_the_measured_order(tmp_path):
    rows = _sweep_rows("s")
    preds = predict(_write(tmp_path, rows))
    order = sorted(range(len(rows)), key=lambda i: preds[i].tokens_per_s_per_gpu)
    for i in order:  # measured in the predicted order, 20% off: rank 1, fastest right
        rows[i]["derived"]["tokens_per_s_per_gpu"] = preds[i].tokens_per_s_per_gpu * 1.2
    (s,) = sweeps(predict(_write(tmp_path, rows)))
    assert (s.series, s.rows, s.layouts) == ("s", 4, 4)
    assert s.spearman == pytest.approx(1.0) and s.best_right and s.mape == pytest.approx(1 / 6, rel=1e-6)
    for i, j in zip(order, reversed(order)):  # the reverse order: rank -1, the fastest wrong
        rows[i]["derived"]["tokens_per_s_per_gpu"] = preds[j].tokens_per_s_per_gpu
    (s,) = sweeps(predict(_write(tmp_path, rows)))
    assert s.spearman == pytest.approx(-1.0) and not s.best_right
    assert "| s | Nemotron-4 15B |" in "\n".join(sweeps_markdown([s]))


def test_weak_scaling_and_other_gpus_are_not_one_sweep(tmp_path):
    # DP alone varies (weak scaling): not a sweep; the same layouts on another GPU type: a sweep of their own
    weak = [_row(f"w{i}", "w", 1000.0, num_gpus=16 * k, dp=4 * k, global_batch=64 * k) for i, k in enumerate((1, 2, 4))]
    a100 = [dict(r, id=r["id"] + "-a", gpu="A100-SXM-80GB") for r in _sweep_rows("s")[:3]]
    table = sweeps(predict(_write(tmp_path, weak + _sweep_rows("s")[:3] + a100)))
    assert [(s.series, s.gpu) for s in table] == [("s", "H100-SXM-80GB (DGX-H100)"), ("s", "A100-SXM-80GB")]


def test_leave_one_series_out_table_refits_without_the_series(tmp_path):
    corpus = _write(tmp_path, _sweep_rows("a") + _sweep_rows("b"))
    preds = predict(corpus)
    table = leave_one_series_out_table(corpus, preds)
    assert [t["series"] for t in table] == ["a", "b"]
    for t in table:
        assert t["rows"] == 4 and t["left_out"].mape is not None and t["in_sample"].mape is not None
    assert "## Dense: leave one series out" in "\n".join(loso_markdown(table))


def test_calibrate_command_reports_the_sweeps(tmp_path, capsys):
    rows = _sweep_rows("s")
    _write(tmp_path, rows)
    assert main(["calibrate", "--corpus", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "rank inside each sweep" in text and "s / Nemotron-4 15B" in text
    assert "## Rank inside each sweep" in (tmp_path / "out" / "calibration.md").read_text()
