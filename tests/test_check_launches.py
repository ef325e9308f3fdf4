"""tools/check_launches.py: attune's slime launches through slime's and Megatron-LM's real parsers (issue 21).

The slow test needs the user's checkouts (slime 624b824a, Megatron-LM 1dcf0daf with slime's megatron*.patch
applied) named by ATTUNE_SLIME_DIR and ATTUNE_MEGATRON_DIR, and transformers; it skips with the reason
otherwise. attune ships neither checkout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from attune.spec.baselines import baseline_layout
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import bundled_names, load_model
from attune.spec.rules import check
from tools import check_launches as cl

ROOT = Path(__file__).resolve().parents[1]
SLIME_DIR = os.environ.get("ATTUNE_SLIME_DIR")
MEGATRON_DIR = os.environ.get("ATTUNE_MEGATRON_DIR")


def test_cluster_sizes_follow_the_model():
    assert cl.cluster_for(load_model("Qwen3-30B-A3B")) == "8xH200"
    assert cl.cluster_for(load_model("Qwen3-235B-A22B")) == "8x8xH200"
    assert cl.cluster_for(load_model("DeepSeek-V3")) == "32x8xH200"
    # rows as long as a learned position table allows (attune refuses longer ones), else attune's default
    assert cl.workload_for(load_model("gpt2")).seq_length == 1024
    assert cl.workload_for(load_model("GPT-3-175B")).seq_length == 2048
    assert cl.workload_for(load_model("Qwen3-4B")).seq_length == 8192


def test_precision_variants_run_on_a_gpu_that_has_them():
    assert cl.precision_arch("fp8-blockwise") == "hopper" and cl.precision_arch("fp8-delayed") == "hopper"
    assert cl.precision_arch("mxfp8") == "blackwell" and cl.precision_arch("nvfp4") == "blackwell"
    m = load_model("Qwen3-235B-A22B")
    assert cl.cluster_for(m, cl.GPU_OF_ARCH["blackwell"]) == "8x8xB200"  # the same size as the H200 cluster
    assert cl.DEVICES["blackwell"].major == 10 and cl.DEVICES["hopper"].major == 9


def test_overlap_layout_is_one_attunes_rules_accept():
    m, c = load_model("Qwen3-30B-A3B"), parse_cluster("8xH200")
    base = baseline_layout(m, c, Workload(), get_engine("slime"))[0]
    assert base.recompute_granularity == "full"  # slime's own layout: overlap alone breaks a rule
    o = cl.overlap_layout(m, c, [base])
    assert o.moe_ep_overlap and o.recompute_granularity == "selective" and o.ep == base.ep
    assert not check(o, m, c.world_size, Workload(), get_engine("slime"))
    with pytest.raises(cl.CheckError, match="needs EP > 1"):
        cl.overlap_layout(m, c, [replace(base, ep=1)])
    m, c = load_model("Qwen3-235B-A22B"), parse_cluster("8x8xH200")  # slime's PP 4: overlap needs virtual stages
    base = baseline_layout(m, c, Workload(), get_engine("slime"))[0]
    o = cl.overlap_layout(m, c, [base])
    assert base.pp == o.pp == 4 and base.vpp == 1 and o.vpp == 2 and o.moe_ep_overlap


def test_bad_checkout_is_one_line(tmp_path, capsys):
    assert cl.main(["--slime", str(tmp_path), "--megatron", str(tmp_path), "--no-winner"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a slime checkout" in err[0]
    assert cl.main(["--slime", str(tmp_path), "--megatron", str(tmp_path), "--models", "nope"]) == 2
    assert "unknown model(s) nope" in capsys.readouterr().err
    assert cl.main(["--slime", str(tmp_path), "--megatron", str(tmp_path), "--precision", "fp9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--precision fp9: allowed fp8-delayed" in err[0]


@pytest.fixture(scope="module")
def checkouts():
    """(slime, Megatron-LM) directories, or skip with the reason. The checks run in a subprocess: loading the
    real parsers changes the process (sys.path, torch.cuda queries; the tool's doc lists each)."""
    if not (SLIME_DIR and MEGATRON_DIR):
        msg = ("ATTUNE_SLIME_DIR / ATTUNE_MEGATRON_DIR not set: point them at slime 624b824a and Megatron-LM "
               "1dcf0daf with slime's docker/patch/latest/megatron*.patch applied")
        print(f"SKIP test_check_launches: {msg}")
        pytest.skip(msg)
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("slime's HF config check needs transformers (pip install transformers)")
    return SLIME_DIR, MEGATRON_DIR


MODELS = ("GLM-4.5-Air", "Qwen3-30B-A3B", "Qwen3.5-35B-A3B", "Qwen3-4B", "tiny-llama", "gpt2")


@pytest.mark.slow
def test_every_launch_parses_and_validates(checkouts, tmp_path):
    names = [n for n in MODELS if n in bundled_names()]
    out = tmp_path / "launches.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "check_launches.py"), "--slime", checkouts[0],
                        "--megatron", checkouts[1], "--models", *names, "--precision", "fp8-blockwise",
                        "--json", str(out)], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())
    kinds = ("baseline", "fp8-blockwise", "winner")  # fp8-blockwise: slime's fp8 recipe (issue 22)
    assert {(x["model"], x["kind"]) for x in rows} >= {(n, k) for n in names for k in kinds}
    for x in rows:
        assert x["ok"] and not x["rejected"] and not x["unknown"], x
        assert not any(w.startswith("--moe-token-dispatcher-type") for w in x["rewritten"]), x
    assert "| GLM-4.5-Air | winner |" in r.stdout or "GLM-4.5-Air" not in names


NEGATIVE = """
import json, sys
from dataclasses import replace
from pathlib import Path
from tools import check_launches as cl
sargs = cl.load_real_parsers(Path(sys.argv[1]), Path(sys.argv[2]))[0]
base = cl.build_launches("Qwen3-30B-A3B", Path(sys.argv[3]), winner=False)[0]
def with_value(flag, f):
    a = list(base.flags); i = a.index(flag); a[i + 1] = f(a[i + 1]); return replace(base, flags=a)
out = {}
for key, launch in (("spaced", with_value("--moe-layer-freq", lambda v: v.replace(",", ", "))),
                    ("allgather", with_value("--moe-token-dispatcher-type", lambda v: "allgather")),
                    ("unknown", replace(base, flags=base.flags + ["--no-such-flag"])), ("base", base),
                    ("overlap_full", replace(base, flags=base.flags + ["--overlap-moe-expert-parallel-comm"]))):
    out[key] = cl.check_launch(sargs, launch).row()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_the_real_parsers_catch_what_attune_must_not_emit(checkouts, tmp_path):
    r = subprocess.run([sys.executable, "-c", NEGATIVE, checkouts[0], checkouts[1], str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    assert res["base"]["ok"]
    assert not res["spaced"]["ok"] and res["spaced"]["rejected"] == ["--moe-layer-freq"]  # the pre-issue-21 form
    assert "--moe-token-dispatcher-type: 'allgather' -> 'alltoall'" in res["allgather"]["rewritten"]  # slime's rewrite
    assert res["unknown"]["unknown"] == ["--no-such-flag"] and not res["unknown"]["ok"]
    # slime's baseline recomputes full layers: Megatron's TransformerConfig (built by slime's model provider) refuses
    # the expert all-to-all overlap there, after validate_args has passed it
    assert res["base"]["config"] == "TransformerConfig" and not res["overlap_full"]["ok"]
    assert res["overlap_full"]["failure"].startswith("TransformerConfig: AssertionError: disable full recomputation")


@pytest.mark.slow
def test_low_precision_and_overlap_launches_parse_and_validate(checkouts, tmp_path):
    out = tmp_path / "variants.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "check_launches.py"), "--slime", checkouts[0],
                        "--megatron", checkouts[1], "--models", "Qwen3-30B-A3B", "--no-winner", "--precision",
                        "fp8-blockwise", "--precision", "mxfp8", "--overlap", "--json", str(out)],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {x["kind"]: x for x in json.loads(out.read_text())}
    assert set(rows) == {"baseline", "fp8-blockwise", "mxfp8", "overlap"}
    for x in rows.values():
        assert x["ok"] and not x["rejected"] and not x["unknown"] and not x["rewritten"] and x["config"], x
    assert rows["fp8-blockwise"]["gpus"] == "8xH200" and rows["mxfp8"]["gpus"] == "8xB200"
    for kind, recipe in (("fp8-blockwise", "blockwise"), ("mxfp8", "mxfp8")):
        argv = rows[kind]["argv"]
        assert argv[argv.index("--fp8-recipe") + 1] == recipe and "--fp8-format" in argv
    assert "--overlap-moe-expert-parallel-comm" in rows["overlap"]["argv"]
