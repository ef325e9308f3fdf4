"""GPU check of the memory and speed models against real runs of the torch runner (one prepared script).

For a session with a device machine (1 x H200): runs the torch runner on one GPU for a few layouts of a model
large enough to matter (default Qwen3.5-0.8B, 4,096-token rows), and prints, per layout, the estimator's
per-stage prediction (`--engine torch`) against `torch.cuda.max_memory_allocated` (which counts PyTorch's
allocator only, so the predicted fixed overhead is left out of the comparison) and the predicted against
the measured step time. Writes `gpu_memory_check.json` into $OUT (or the current folder).

    PYTHONUNBUFFERED=1 python benchmarks/gpu_memory_check.py                 # on the GPU machine
    python benchmarks/gpu_memory_check.py --model tiny-qwen3.5 --gpus 1xcpu --seq 256 --steps 4   # CPU smoke run

Not run yet: the sessions so far had no device machine. Commit its output under benchmarks/ with the date
and the GPU when it has run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import tempfile
from pathlib import Path

from attune.estimator import estimate
from attune.runners.base import TrialSpec
from attune.runners.torch_runner import TorchRunner
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import load_model

LAYOUTS = {  # one GPU: PP 1, DP 1; what changes is recompute and microbatch size
    "no recompute": dict(),
    "full uniform 1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full block half": dict(recompute_granularity="full", recompute_method="block"),
    "selective": dict(recompute_granularity="selective"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen3.5-0.8B")
    ap.add_argument("--gpus", default="1xH200")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    model, cluster, engine = load_model(args.model), parse_cluster(args.gpus), get_engine("torch")
    wl = Workload(seq_length=args.seq, global_batch=args.global_batch, steps=args.steps, window=(2, args.steps - 1))
    runner = TorchRunner()
    rows = []
    for name, kw in LAYOUTS.items():
        if kw.get("recompute_method") == "block":
            kw = dict(kw, recompute_num_layers=max(1, model.num_layers // 2))
        lay = Layout(max_tokens_per_gpu=args.seq, **kw)
        est = estimate(model, cluster, lay, wl, engine)
        st = est.memory.stages[0]
        with tempfile.TemporaryDirectory() as d:
            res = runner.run(TrialSpec(model=model, cluster=cluster, layout=lay, workload=wl, engine=engine,
                                       trial_dir=Path(d), timeout_s=900))
        pred_alloc = st.total_gib - st.overhead_gib
        meas = res.peak_memory_gib[0] if res.peak_memory_gib else None
        row = {"layout": name, "status": res.status, "predicted_allocated_gib": round(pred_alloc, 3),
               "measured_max_allocated_gib": meas, "predicted_step_s": round(est.perf.step_time_s, 4),
               "measured_step_s": res.step_time_s, "tokens_per_s_per_gpu": res.tokens_per_s_per_gpu,
               "reason": res.reason}
        if meas:
            row["memory_error_percent"] = round(100 * (pred_alloc - meas) / meas, 1)
        if res.step_time_s:
            row["step_error_percent"] = round(100 * (est.perf.step_time_s - res.step_time_s) / res.step_time_s, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", ".")) / "gpu_memory_check.json"
    out.write_text(json.dumps({"date": dt.date.today().isoformat(), "model": model.name, "gpus": cluster.spec,
                               "seq": args.seq, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
