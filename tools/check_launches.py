#!/usr/bin/env python3
"""Feed every slime launch attune emits to slime's and Megatron-LM's real argument parsers and validate_args.

    python3 tools/check_launches.py --slime DIR --megatron DIR [--models NAME ...] [--no-winner] [--json FILE]

DIR are checkouts the user provides: slime at 624b824a and Megatron-LM at 1dcf0daf with slime's Megatron
patches applied, as slime's Dockerfile applies them (docker/Dockerfile lines 118-133: ``git apply
megatron.patch`` then ``megatron-sglang-aligned.patch``, both from slime's ``docker/patch/latest/``; the
sglang*.patch files there patch SGLang, not Megatron-LM). attune ships neither and downloads nothing.

For each bundled model (``attune models``) on a cluster sized to it (:func:`cluster_for`), the tool builds
three launches with attune's own code: the model's baseline (``attune.spec.baselines``), the baseline with slime's
fp8 recipe (``--fp8-format e4m3 --fp8-recipe blockwise``, slime docs/en/advanced/low-precision.md) and the predicted
winner of ``attune tune`` on the sim runner (``--no-winner`` skips it); each through
``attune.runners.slime.launch`` with a cluster file whose paths are real folders written here (the HF
checkpoint folder holds the model's bundled ``config.json``, so slime's ``_hf_validate_args`` compares the
launch's model arguments against it through transformers' ``AutoConfig``). Each launch's environment is
exported, its argv becomes ``sys.argv``, and slime's ``slime.utils.arguments.parse_args()`` runs as
``train_async.py`` would run it: Megatron's parser (``ignore_unknown_args=True``) with slime's arguments, the
HF config check, slime's defaults, ``slime_validate_args`` and slime's ``validate_args`` (Megatron's
``validate_args`` plus slime's rewrites).

It reports per launch: the flags, the rejected flags (argparse errors, which exit 2, and flags neither parser
knows, which Megatron's ``ignore_unknown_args=True`` drops silently), the flags silently rewritten (the
value argparse parsed against the value after validation), and any validation failure.

What this process changes so the real code runs on a CPU machine without the training image (each is off
the path a ``--debug-train-only`` launch takes through argument parsing, or answers a GPU query):

* ``torch.cuda.get_device_capability`` -> (9, 0) and ``torch.cuda.get_device_properties`` -> an H100/H200-like
  record (major 9): Megatron's validate_args asks under ``--moe-grouped-gemm`` (arguments.py lines 851-853)
  and ``megatron.training.utils.get_device_arch_version`` asks for the architecture. The cluster's GPU is
  Hopper; a real launch asks the real device.
* Modules the training image has and this machine may not, imported by slime at module level but used only
  by SGLang rollouts or logging: ``sglang.srt.server_args`` (ServerArgs), ``sglang_router.launch_router``
  (RouterArgs; both used by ``sglang_parse_args``, which slime skips under ``--debug-train-only``,
  slime/utils/arguments.py lines 1606-1613), ``wandb``, ``httpx``. Where one is importable the real module is
  used; otherwise a stand-in module whose attributes are inert placeholders is registered, and the report
  lists it.
* ``megatron.core.utils.get_te_version`` -> 2.16.1, slime's image's Transformer Engine (docker/Dockerfile line 60),
  when Transformer Engine is not installed here: validate_args compares it (fine-grained activation offloading
  with TE >= 2.10 asserts ``NVTE_CPU_OFFLOAD_V1=1``, arguments.py lines 1245-1250).
* Megatron's ``megatron.core.transformer.custom_layers.batch_invariant_kernels`` (Triton GPU kernels, imported
  by ``megatron.training.initialize``): a stand-in only when ``triton`` is not importable (CPU PyTorch).
* ``argparse.ArgumentParser.parse_known_args`` is wrapped to record the parser and the arguments it left
  unparsed (how the report finds flags Megatron ignores); its result is unchanged.
* Checkpoints whose config class is remote code (Kimi K2 ``kimi_k2``, MiMo ``mimo``) get a minimal
  ``PretrainedConfig`` subclass of their model_type beside config.json, named by ``auto_map``, as the real
  checkpoint's ``configuration_*.py`` is (``_remote_code_config``).
* ``torch.distributed`` is not initialised: slime derives the world size from ``--actor-num-nodes`` x
  ``--actor-num-gpus-per-node`` (slime/backends/megatron_utils/arguments.py ``megatron_parse_args``).

Exit status: 0 when every launch parses and validates with no rejected flag, 1 otherwise, 2 for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import io
import json
import logging
import os
import re
import sys
import tempfile
import types
import warnings
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from attune.api.tune import tune  # noqa: E402
from attune.errors import AttuneError  # noqa: E402
from attune.runners.ray.cluster import parse_cluster_config  # noqa: E402
from attune.runners.slime.launch import ShellText, command_for_recipe, slime_command  # noqa: E402
from attune.spec.baselines import baseline_layout  # noqa: E402
from attune.spec.engine import get_engine  # noqa: E402
from attune.spec.hardware import parse_cluster  # noqa: E402
from attune.spec.layout import Workload  # noqa: E402
from attune.spec.model import bundled_names, load_model  # noqa: E402
from attune.spec.precision import fields_for  # noqa: E402

# The pinned commits attune's flag table describes (attune/spec/megatron_flags.yaml `describes`).
SLIME_COMMIT, MEGATRON_COMMIT = "624b824a", "1dcf0daf"
# A Hopper GPU as torch.cuda reports it (H200: 141 GiB, 132 SMs; compute capability 9.0).
HOPPER = types.SimpleNamespace(major=9, minor=0, name="NVIDIA H200", total_memory=143_771_287_552,
                               multi_processor_count=132)
# Bytes per parameter the cluster must hold (bf16 weights and grads, fp32 master and Adam moments = 18, plus
# activations), and the usable memory per GPU, for sizing the cluster (cluster_for).
BYTES_PER_PARAM = 20
USABLE_BYTES_PER_GPU = 100e9
# Transformer Engine in slime's image (slime 624b824a docker/Dockerfile line 60: transformer_engine[pytorch]==2.16.1):
# what megatron.core.utils.get_te_version answers when TE is not installed here (validate_args compares it).
SLIME_TE_VERSION = "2.16.1"
STAND_IN_MODULES = ("sglang.srt.server_args", "sglang_router.launch_router", "wandb", "httpx")
TRITON_KERNELS = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
_ARGPARSE_ERROR_RE = re.compile(r"error: argument (--[\w-]+)")


class CheckError(AttuneError):
    """Bad input to the tool (one line)."""


# ------------------------------------------------------------------------------------------- stand-ins
class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


def _placeholder(name: str) -> type:
    """An inert class: calls and attribute reads give more placeholders; a decorator returns its function."""
    def getattr_(self, a):
        if a.startswith("__"):
            raise AttributeError(a)
        return _placeholder(a)

    return _PlaceholderMeta(name, (), {
        "__init__": lambda self, *a, **k: None, "__getattr__": getattr_,
        "__call__": lambda self, *a, **k: a[0] if len(a) == 1 and callable(a[0]) and not k else self})


def _register_stand_in(name: str, leaf_only: bool = False) -> None:
    """A stand-in module `name` (and its missing parents, unless leaf_only: the parents are real packages
    imported later from the checkout)."""
    parts = name.split(".")
    for i in range(len(parts) if leaf_only else 1, len(parts) + 1):
        n = ".".join(parts[:i])
        if n in sys.modules:
            continue
        mod = types.ModuleType(n)
        mod.__path__ = []

        def module_getattr(a, _n=n):
            if a.startswith("__"):
                raise AttributeError(a)
            return _placeholder(a)

        mod.__getattr__ = module_getattr
        sys.modules[n] = mod
        parent = ".".join(parts[:i - 1])
        if i > 1 and parent in sys.modules:
            setattr(sys.modules[parent], parts[i - 1], mod)


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


_PARSE_LOG: list[tuple[argparse.ArgumentParser, list[str], dict]] = []


def _record_parse_known_args():
    """Wrap ArgumentParser.parse_known_args to record (parser, leftover args, a copy of the values parsed);
    the result is unchanged."""
    original = argparse.ArgumentParser.parse_known_args

    def recording(self, args=None, namespace=None):
        ns, extra = original(self, args, namespace)
        _PARSE_LOG.append((self, list(extra), copy.deepcopy(vars(ns))))
        return ns, extra

    argparse.ArgumentParser.parse_known_args = recording


def load_real_parsers(slime_dir: Path, megatron_dir: Path) -> tuple[types.ModuleType, list[str]]:
    """Import slime's argument module from the checkouts (with the process changes of the module doc);
    returns (slime.utils.arguments, the stand-in modules registered)."""
    for d, what, marker in ((slime_dir, "slime", "slime/utils/arguments.py"),
                            (megatron_dir, "Megatron-LM", "megatron/training/arguments.py")):
        if not (d / marker).is_file():
            raise CheckError(f"{d}: not a {what} checkout (no {marker})")
    if not (megatron_dir / "megatron/training/arguments.py").read_text().count("moe_freq_type"):
        raise CheckError(f"{megatron_dir}: megatron/training/arguments.py has no moe_freq_type; expected "
                         f"Megatron-LM {MEGATRON_COMMIT}")
    if not _importable("transformers"):
        raise CheckError("slime's HF config check needs transformers (pip install transformers): not importable")
    sys.path[:0] = [str(slime_dir), str(megatron_dir)]
    for name in [n for n in list(sys.modules) if n == "megatron" or n.startswith("megatron.")]:
        del sys.modules[name]  # an installed megatron-core must not shadow the checkout
    import torch

    torch.cuda.get_device_capability = lambda *a, **k: (HOPPER.major, HOPPER.minor)
    torch.cuda.get_device_properties = lambda *a, **k: HOPPER
    stood_in = []
    for name in STAND_IN_MODULES:
        if not _importable(name):
            _register_stand_in(name)
            stood_in.append(name)
    if not _importable("triton"):
        _register_stand_in(TRITON_KERNELS, leaf_only=True)
        stood_in.append(TRITON_KERNELS)
    _record_parse_known_args()
    if not _importable("transformer_engine"):
        from packaging.version import Version  # noqa: PLC0415 - Megatron's own dependency

        importlib.import_module("megatron.core.utils").get_te_version = lambda: Version(SLIME_TE_VERSION)
        stood_in.append(f"transformer_engine version {SLIME_TE_VERSION} (get_te_version)")
    logging.getLogger().setLevel(logging.WARNING)
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" and the like, on CPU
    with contextlib.redirect_stdout(io.StringIO()):  # stderr stays a real file: Megatron calls faulthandler.enable()
        sargs = importlib.import_module("slime.utils.arguments")
        importlib.import_module("slime.backends.megatron_utils.arguments")
    got = Path(importlib.import_module("megatron.training.arguments").__file__).resolve()
    if megatron_dir.resolve() not in got.parents:
        raise CheckError(f"megatron.training.arguments came from {got}, not from {megatron_dir}")
    return sargs, stood_in


# ------------------------------------------------------------------------------------------- launches
@dataclass
class Launch:
    model: str
    kind: str  # baseline | fp8-blockwise | winner
    gpus: str
    layout: str = ""
    flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    error: str = ""  # attune could not build it (the reason)


@dataclass
class Verdict:
    launch: Launch
    ok: bool
    rejected: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    rewritten: list[str] = field(default_factory=list)
    failure: str = ""

    def row(self) -> dict:
        L = self.launch
        return {"model": L.model, "kind": L.kind, "gpus": L.gpus, "layout": L.layout, "ok": self.ok,
                "flags": len(L.flags), "rejected": self.rejected, "unknown": self.unknown,
                "rewritten": self.rewritten, "failure": self.failure or L.error, "argv": L.flags}


def cluster_for(model) -> str:
    """The smallest cluster of 8-GPU H200 nodes (1, 2, 4, ... 32) holding the model's training state at
    BYTES_PER_PARAM bytes per parameter in USABLE_BYTES_PER_GPU per GPU."""
    need = model.total_params * BYTES_PER_PARAM / USABLE_BYTES_PER_GPU
    nodes = 1
    while nodes * 8 < need and nodes < 32:
        nodes *= 2
    return "8xH200" if nodes == 1 else f"{nodes}x8xH200"


REMOTE_CONFIG_MODULE = "configuration_remote"


def _remote_code_config(cfg: dict, folder: Path) -> None:
    """Where transformers has no config class for the checkpoint's model_type (Kimi K2's ``kimi_k2``, MiMo's
    ``mimo``: the real checkpoints ship theirs as remote code, a ``configuration_*.py`` named by ``auto_map``), write
    a minimal one beside config.json (a ``PretrainedConfig`` subclass of that model_type) and name it in
    ``auto_map``, so ``AutoConfig.from_pretrained(..., trust_remote_code=True)`` in slime's HF check loads the
    config's fields as the checkpoint's own code would."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # noqa: PLC0415 - checked at load

    mt = cfg.get("model_type")
    if not mt or mt in CONFIG_MAPPING_NAMES:
        return
    (folder / f"{REMOTE_CONFIG_MODULE}.py").write_text(
        "from transformers import PretrainedConfig\n\n\n"
        f"class RemoteConfig(PretrainedConfig):\n    model_type = {mt!r}\n\n"
        "    def __init__(self, **kwargs):\n"
        "        self.__dict__.update(kwargs)  # every field of config.json, as the checkpoint's class keeps them\n"
        "        super().__init__(**kwargs)\n")
    cfg["auto_map"] = {"AutoConfig": f"{REMOTE_CONFIG_MODULE}.RemoteConfig"}


def _paths(root: Path, model_name: str) -> dict:
    d = root / model_name
    for k in ("slime", "megatron", "hf", "torch_dist", "out"):
        (d / k).mkdir(parents=True, exist_ok=True)
    cfg = json.loads(resources.files("attune.spec").joinpath("model_configs", f"{model_name}.json").read_text())
    _remote_code_config(cfg, d / "hf")
    (d / "hf" / "config.json").write_text(json.dumps(cfg, indent=1))
    (d / "torch_dist" / "latest_checkpointed_iteration.txt").write_text("release")
    (d / "rows.parquet").write_bytes(b"PAR1")
    return {"slime": str(d / "slime"), "megatron": str(d / "megatron"), "hf_checkpoint": str(d / "hf"),
            "torch_dist": str(d / "torch_dist"), "sft_data": str(d / "rows.parquet"), "output": str(d / "out")}


def _from_command(L: Launch, cmd) -> Launch:
    L.flags = [str(x) for x in cmd.flags]
    L.env = {k: str(v) for k, v in cmd.env.items()
             if k != "PYTHONPATH" and not (isinstance(v, ShellText) and v.ray is None)}
    return L


def build_launches(name: str, root: Path, winner: bool) -> list[Launch]:
    """The model's baseline, its fp8-blockwise variant and (optionally) predicted-winner slime launches, as attune
    emits them."""
    model = load_model(name)
    gpus = cluster_for(model)
    cl = parse_cluster(gpus)
    cfg = parse_cluster_config({"ray": {"address": "http://127.0.0.1:8265"}, "nodes": cl.nodes,
                                "gpus_per_node": cl.gpus_per_node, "gpu_type": "H200", "nvlink": 18,
                                "python": "python3", "paths": _paths(root, name)}, f"{name}-cluster.yaml")
    out = []
    L = Launch(name, "baseline", gpus)
    try:
        lay, _ = baseline_layout(model, cl, Workload(), get_engine("slime"))
        L.layout = lay.label()
        _from_command(L, slime_command(model, cl, lay, Workload(), cluster_cfg=cfg))
    except AttuneError as e:
        L.error = f"attune emits no launch: {' '.join(str(e).split())}"
    out.append(L)
    if not L.error:  # the baseline with slime's documented fp8 recipe (issue 22)
        out.append(_low_precision_launch(name, gpus, model, cl, lay, cfg))
    if winner and not L.error:
        W = Launch(name, "winner", gpus)
        try:
            with tempfile.TemporaryDirectory() as t, contextlib.redirect_stdout(io.StringIO()):
                res = tune(model=name, gpus=gpus, out=Path(t) / "study", verify=False)
            W.layout = res.outcome.best.to_layout().label()
            _from_command(W, command_for_recipe(res.recipe, cfg))
        except AttuneError as e:
            W.error = f"attune emits no launch: {' '.join(str(e).split())}"
        out.append(W)
    return out


def _low_precision_launch(name: str, gpus: str, model, cl, lay, cfg) -> Launch:
    """The baseline layout with slime's fp8 recipe: --fp8-format e4m3 --fp8-recipe blockwise, --fp8-param-gather
    where the layout allows it (not with CPU Adam), NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 (slime 624b824a
    docs/en/advanced/low-precision.md lines 62-70)."""
    F = Launch(name, "fp8-blockwise", gpus)
    try:
        fp8 = replace(lay, **fields_for("fp8-blockwise", param_gather=not lay.optimizer_cpu_offload))
        F.layout = fp8.label()
        _from_command(F, slime_command(model, cl, fp8, Workload(), cluster_cfg=cfg))
    except AttuneError as e:
        F.error = f"attune emits no launch: {' '.join(str(e).split())}"
    return F


# ------------------------------------------------------------------------------------------- checking
def _dest_of(parser: argparse.ArgumentParser, flag: str) -> str | None:
    action = parser._option_string_actions.get(flag)  # argparse's own index of option strings
    return None if action is None else action.dest


def check_launch(sargs: types.ModuleType, L: Launch) -> Verdict:
    """Run slime's parse_args on the launch as train_async.py does; compare what Megatron's parser read with
    the values after validation."""
    if L.error:
        return Verdict(L, ok=False)
    saved_env = dict(os.environ)
    os.environ.update(L.env)
    sys.argv = ["train_async.py"] + L.flags
    err = io.StringIO()
    _PARSE_LOG.clear()
    v = Verdict(L, ok=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            final = vars(sargs.parse_args())
    except SystemExit as e:
        text = " ".join(err.getvalue().split())
        v.ok = False
        v.rejected = sorted(set(_ARGPARSE_ERROR_RE.findall(text)))
        v.failure = f"argparse exit {e.code}: {text[-300:]}"
        return v
    except Exception as e:  # noqa: BLE001 - any failure of the real validation is the finding
        v.ok = False
        v.failure = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
        return v
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    # slime parses in two parsers: _pre_parse_mode's (--debug-train-only, --train-backend, ...) and Megatron's
    # with slime's arguments; a flag left over by both is one nobody reads
    megatron = next(p for p in _PARSE_LOG if "--num-layers" in p[0]._option_string_actions)
    pre = next((p for p in _PARSE_LOG if "--debug-train-only" in p[0]._option_string_actions
                and "--num-layers" not in p[0]._option_string_actions), None)
    left = {w for w in megatron[1] if w.startswith("--")}
    if pre is not None:
        left &= {w for w in pre[1] if w.startswith("--")}
    v.unknown = [w for w in dict.fromkeys(L.flags) if w in left]
    if v.unknown:
        v.ok = False
    parser, raw = megatron[0], megatron[2]
    for w in dict.fromkeys(L.flags):
        if not w.startswith("--"):
            continue
        dest = _dest_of(parser, w)
        if dest is None or dest not in final or dest not in raw:
            continue
        if raw[dest] != final[dest] and not (isinstance(raw[dest], list) and raw[dest] == [final[dest]]):
            # (Megatron's validate_args unwraps one-element lists of nargs='+' flags: the same value)
            v.rewritten.append(f"{w}: {raw[dest]!r} -> {final[dest]!r}")
    return v


# ------------------------------------------------------------------------------------------- report
def table(verdicts: list[Verdict]) -> str:
    lines = ["| model | launch | GPUs | layout | flags | result | rejected / unknown | rewritten by validation |",
             "|---|---|---|---|---|---|---|---|"]
    for v in verdicts:
        L = v.launch
        if L.error:
            res = "no launch"
        else:
            res = "PASS" if v.ok else "FAIL"
        bad = ", ".join(v.rejected + [f"{u} (unknown)" for u in v.unknown]) or "-"
        if v.failure and not v.rejected:
            bad = (bad if bad != "-" else "") + (" " if bad != "-" else "") + v.failure[:160]
        if L.error:
            bad = L.error[:160]
        lines.append(f"| {L.model} | {L.kind} | {L.gpus} | {L.layout or '-'} | {len(L.flags)} | {res} | {bad} | "
                     f"{'; '.join(v.rewritten) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="check_launches", description=__doc__.split("\n\n")[0])
    ap.add_argument("--slime", required=True, type=Path, help=f"slime checkout at {SLIME_COMMIT}")
    ap.add_argument("--megatron", required=True, type=Path,
                    help=f"Megatron-LM checkout at {MEGATRON_COMMIT} with slime's megatron*.patch applied")
    ap.add_argument("--models", nargs="*", default=None, help="bundled model names (default: all)")
    ap.add_argument("--no-winner", action="store_true", help="check the baselines only (no attune tune)")
    ap.add_argument("--json", type=Path, default=None, help="also write every launch's argv and verdict here")
    a = ap.parse_args(argv)
    names = a.models or bundled_names()
    try:
        unknown = [n for n in names if n not in bundled_names()]
        if unknown:
            raise CheckError(f"unknown model(s) {', '.join(unknown)}; allowed: {', '.join(bundled_names())}")
        sargs, stood_in = load_real_parsers(a.slime, a.megatron)
    except AttuneError as e:
        print(f"check_launches: error: {e}", file=sys.stderr)
        return 2
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="attune-check-launches-") as t:
        for name in names:
            for L in build_launches(name, Path(t), winner=not a.no_winner):
                v = check_launch(sargs, L)
                verdicts.append(v)
                print(f"{name} {L.kind}: {'no launch' if L.error else 'PASS' if v.ok else 'FAIL'}", file=sys.stderr)
    print(f"slime {a.slime} and Megatron-LM {a.megatron}; stand-in modules: {', '.join(stood_in) or 'none'}\n")
    print(table(verdicts))
    if a.json:
        a.json.write_text(json.dumps([v.row() for v in verdicts], indent=1))
    emitted = [v for v in verdicts if not v.launch.error]
    failed = [v for v in emitted if not v.ok]
    print(f"\n{len(emitted)} launches checked, {len(failed)} failed; "
          f"{len(verdicts) - len(emitted)} models without a slime launch")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
