"""Verifying a low-precision recipe (issue 22): the emulated fp8 GEMMs of the torch trainer, the component:precision
test and its negative controls (fast), and a real two-arm verify of an fp8 recipe of a tiny model against bf16 with
the wrong-scale and E5M2-forward controls (slow lane)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attune.api.verify import verify  # noqa: E402
from attune.correctness.convergence import compare_curves  # noqa: E402
from attune.correctness.precision_check import PRECISION_THRESHOLDS, precision_component, thresholds_for, unit_roundoff  # noqa: E402
from attune.recipe import load_recipe, write_recipe  # noqa: E402
from attune.spec.layout import Layout  # noqa: E402
from attune.spec.model import load_model  # noqa: E402
from attune.spec.precision import fields_for  # noqa: E402
from attune.torchmodels import apply_low_precision, build_model, quantize  # noqa: E402
from tests.test_verify import make_recipe  # noqa: E402

TINY = load_model("tiny-llama")


def test_quantize_per_recipe():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g, dtype=torch.float64)
    for recipe in ("delayed", "tensorwise", "blockwise", "mxfp8"):
        q = quantize(x, "e4m3", recipe)
        err = float((q - x).norm() / x.norm())
        assert 0 < err < unit_roundoff("e4m3"), recipe
        assert float((quantize(x, "e5m2", recipe) - x).norm() / x.norm()) > err  # one mantissa bit fewer
    # blockwise scales per block: a block of tiny values keeps its precision beside a block of large ones
    y = torch.cat([x[:, :128] * 1e-4, x[:, 128:] * 1e3], dim=1)
    tiny_block = lambda r: float((quantize(y, "e4m3", r)[:, :128] - y[:, :128]).norm() / y[:, :128].norm())  # noqa
    assert tiny_block("blockwise") < 0.05 < tiny_block("tensorwise")


def test_component_precision_passes_recipes_and_fails_controls():
    for recipe in ("fp8-delayed", "fp8-tensorwise", "fp8-blockwise", "mxfp8"):
        lay = Layout(**fields_for(recipe))
        assert precision_component(TINY, lay).passed, recipe
        assert not precision_component(TINY, lay, "wrong_scale").passed
        assert not precision_component(TINY, lay, "e5m2_forward").passed
    assert thresholds_for(Layout()) is None and thresholds_for(Layout(**fields_for("mxfp8"))) is PRECISION_THRESHOLDS


def test_precision_tolerance_is_tighter_than_the_layout_one():
    ref = {s: 6.2 - 0.01 * s for s in range(20)}
    close = {s: v * 1.002 for s, v in ref.items()}  # 0.2%: what the emulated fp8 recipes show
    off = {s: v * 1.02 for s, v in ref.items()}  # 2%: passes the layout check (5-10%), not the precision one
    assert compare_curves(ref, close, PRECISION_THRESHOLDS).passed
    assert compare_curves(ref, off).passed and not compare_curves(ref, off, PRECISION_THRESHOLDS).passed


def test_emulated_linears_train_and_keep_their_parameters():
    net = build_model(TINY, seed=0)
    before = [id(p) for p in net.parameters()]
    n = apply_low_precision(net.layers, "e4m3", "blockwise")
    assert n == 7 * TINY.num_layers and [id(p) for p in net.parameters()] == before  # q, k, v, o, gate, up, down
    assert type(net.lm_head).__name__ == "Linear" or net.lm_head is None  # the output layer stays
    ids = torch.randint(0, TINY.vocab, (2, 32))
    out = net(ids)
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def fp8_verified(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify-fp8")
    lay = Layout(dp=2, max_tokens_per_gpu=256, **fields_for("fp8-blockwise"))
    path = d / "recipe.yaml"
    write_recipe(make_recipe(lay, "tiny-llama"), path)
    lines: list[str] = []
    # 8 steps (was 12): the margins hold (2026-12-02, 8 steps: candidate final loss difference 0.0002 against 0.005 and
    # 0 point-wise failures; lr x10 correlation 0.16, inverted mask 0.73 against 0.95; wrong scale 7 and E5M2 forward
    # 4 point-wise failures at the precision tolerance, both also failing component:precision, which does not train)
    outcome = verify(path, steps=8, negative_control=True, out_dir=d / "out", progress=lines.append)
    return outcome, load_recipe(outcome.recipe_path), lines  # the verdict goes to out/recipe.yaml (issue 23)


@pytest.mark.slow
def test_fp8_recipe_verifies_against_bf16_and_its_controls_fail(fp8_verified):
    outcome, r, lines = fp8_verified
    assert r["status"] == "verified", r["correctness"]["summary"]
    conv = r["correctness"]["convergence"]
    assert conv["thresholds"]["final_loss_tolerance"] == 0.005 and conv["final_loss_difference"] <= 0.005
    assert any(line.startswith("component:precision (fp8-blockwise) passed") for line in lines)
    ctl = {c["changed"]: c for c in r["correctness"]["negative_controls"]}
    scale = next(c for k, c in ctl.items() if "too large" in k)
    e5m2 = next(c for k, c in ctl.items() if "E5M2 forward" in k)
    assert scale["observed"] == "fail" and e5m2["observed"] == "fail"
    assert all(c["observed"] == "fail" for c in ctl.values())
