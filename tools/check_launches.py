#!/usr/bin/env python3
"""Feed every slime launch attune emits to slime's and Megatron-LM's real argument parsers and validate_args.

    python3 tools/check_launches.py --slime DIR --megatron DIR [--models NAME ...] [--no-winner]
        [--precision RECIPE ...] [--overlap] [--json FILE]

DIR are checkouts the user provides: slime at 624b824a and Megatron-LM at 1dcf0daf with slime's Megatron
patches applied, as slime's Dockerfile applies them (docker/Dockerfile lines 118-133: ``git apply
megatron.patch`` then ``megatron-sglang-aligned.patch``, both from slime's ``docker/patch/latest/``; the
sglang*.patch files there patch SGLang, not Megatron-LM). attune ships neither and downloads nothing.

For each bundled model (``attune models``) on a cluster sized to it (:func:`cluster_for`), the tool builds
two launches with attune's own code: the model's baseline (``attune.spec.baselines``) and the predicted
winner of ``attune tune`` on the sim runner (``--no-winner`` skips it); each through
``attune.runners.slime.launch`` with a cluster file whose paths are real folders written here (the HF
checkpoint folder holds the model's bundled ``config.json``, so slime's ``_hf_validate_args`` compares the
launch's model arguments against it through transformers' ``AutoConfig``). Each launch's environment is
exported, its argv becomes ``sys.argv``, and slime's ``slime.utils.arguments.parse_args()`` runs as
``train_async.py`` would run it: Megatron's parser (``ignore_unknown_args=True``) with slime's arguments, the
HF config check, slime's defaults, ``slime_validate_args`` and slime's ``validate_args`` (Megatron's
``validate_args`` plus slime's rewrites). Then Megatron's ``TransformerConfig`` is built from the validated
arguments, as slime's model provider does before it builds the model (slime/backends/megatron_utils/
model_provider.py line 134, ``core_transformer_config_from_args``): its ``__post_init__`` holds the rules of the
expert all-to-all overlap, recompute and low precision that validate_args does not check.

Variants: ``--precision RECIPE`` (repeatable; fp8-delayed, fp8-tensorwise, fp8-blockwise, mxfp8, nvfp4) adds the
low-precision best of ``attune tune --allow-numerics RECIPE``, on H200 where Hopper runs the recipe and on a B200
cluster of the same size where only Blackwell does (mxfp8, nvfp4); ``--overlap`` adds, for MoE models, a layout
with ``--overlap-moe-expert-parallel-comm`` (:func:`overlap_layout`).

It reports per launch: the flags, the rejected flags (argparse errors, which exit 2, and flags neither parser
knows, which Megatron's ``ignore_unknown_args=True`` drops silently), the flags silently rewritten (the
value argparse parsed against the value after validation), and any validation failure.

What this process changes so the real code runs on a CPU machine without the training image (each is off
the path a ``--debug-train-only`` launch takes through argument parsing, or answers a GPU query):

* ``torch.cuda.get_device_capability`` -> (9, 0) and ``torch.cuda.get_device_properties`` -> an H200-like
  record (major 9), or (10, 0) and a B200-like record for a Blackwell launch (``DEVICES``): Megatron's
  validate_args asks under ``--moe-grouped-gemm`` (arguments.py lines 851-853) and
  ``megatron.training.utils.get_device_arch_version`` asks for the architecture (arguments.py line 927). A real
  launch asks the real device.
* Modules the training image has and this machine may not, imported by slime at module level but used only
  by SGLang rollouts or logging: ``sglang.srt.server_args`` (ServerArgs), ``sglang_router.launch_router``
  (RouterArgs; both used by ``sglang_parse_args``, which slime skips under ``--debug-train-only``,
  slime/utils/arguments.py lines 1606-1613), ``wandb``, ``httpx``. Where one is importable the real module is
  used; otherwise a stand-in module whose attributes are inert placeholders is registered, and the report
  lists it.
* ``megatron.core.utils.get_te_version`` -> 2.16.1, slime's image's Transformer Engine (docker/Dockerfile line 60),
  when Transformer Engine is not installed here: validate_args compares it (fine-grained activation offloading
  with TE >= 2.10 asserts ``NVTE_CPU_OFFLOAD_V1=1``, arguments.py lines 1245-1250); and, without TE, the TE
  kernels whose presence ``TransformerConfig.__post_init__`` checks (fused RoPE, fused MoE permutation:
  ``TE_KERNELS``) are functions that are never called.
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
from attune.recipe.io import load_recipe_model  # noqa: E402
from attune.runners.ray.cluster import parse_cluster_config  # noqa: E402
from attune.runners.slime.launch import ShellText, command_for_recipe, slime_command  # noqa: E402
from attune.spec.baselines import baseline_layout  # noqa: E402
from attune.spec.engine import get_engine  # noqa: E402
from attune.spec.hardware import GPUS, parse_cluster  # noqa: E402
from attune.spec.layout import Layout, Workload  # noqa: E402
from attune.spec.model import bundled_names, load_model  # noqa: E402
from attune.spec.precision import LOW_PRECISION, fields_for, hardware_refusal  # noqa: E402
from attune.spec.rules import check  # noqa: E402

# The pinned commits attune's flag table describes (attune/spec/megatron_flags.yaml `describes`).
SLIME_COMMIT, MEGATRON_COMMIT = "624b824a", "1dcf0daf"
# The cluster's GPU as torch.cuda reports it, per architecture: compute capability 9.0 (Hopper, H200: 132 SMs) or
# 10.0 (Blackwell, B200: 148 SMs, NVIDIA Blackwell datasheet); memory from attune's GPU table. Hopper clusters
# check bf16 and fp8 launches; a Blackwell one (B200) the microscaling formats Hopper lacks (--precision mxfp8).
DEVICES = {
    "hopper": types.SimpleNamespace(major=9, minor=0, name="NVIDIA H200", total_memory=GPUS["H200"].memory_bytes,
                                    multi_processor_count=132),
    "blackwell": types.SimpleNamespace(major=10, minor=0, name="NVIDIA B200", total_memory=GPUS["B200"].memory_bytes,
                                       multi_processor_count=148)}
GPU_OF_ARCH = {"hopper": "H200", "blackwell": "B200"}
_DEVICE = [DEVICES["hopper"]]  # what the torch.cuda stand-ins answer for the launch being checked
# Bytes per parameter the cluster must hold (bf16 weights and grads, fp32 master and Adam moments = 18, plus
# activations), and the usable memory per GPU, for sizing the cluster (cluster_for).
BYTES_PER_PARAM = 20
USABLE_BYTES_PER_GPU = 100e9
# Transformer Engine in slime's image (slime 624b824a docker/Dockerfile line 60: transformer_engine[pytorch]==2.16.1):
# what megatron.core.utils.get_te_version answers when TE is not installed here (validate_args compares it).
SLIME_TE_VERSION = "2.16.1"
STAND_IN_MODULES = ("sglang.srt.server_args", "sglang_router.launch_router", "wandb", "httpx")
# Transformer Engine kernels whose presence TransformerConfig.__post_init__ checks (megatron-core 1dcf0daf
# transformer_config.py lines 1573-1581: fused RoPE under --apply-rope-fusion; lines 1863-1879: fused permutation
# under --moe-permute-fusion); None here without TE, present in slime's image (TE 2.16.1). Never called.
TE_KERNELS = {"megatron.core.models.common.embeddings.rope_utils": ("fused_apply_rotary_pos_emb",
                                                                   "fused_apply_rotary_pos_emb_thd"),
              "megatron.core.transformer.moe.moe_utils": ("fused_permute", "fused_permute_with_probs",
                                                          "fused_sort_chunks_by_index",
                                                          "fused_sort_chunks_by_index_with_probs", "fused_unpermute")}
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


def _te_kernel(name: str):
    def kernel(*a, **k):
        raise RuntimeError(f"{name}: a stand-in for a Transformer Engine kernel; it is never called here")
    kernel.__name__ = name
    return kernel


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

    torch.cuda.get_device_capability = lambda *a, **k: (_DEVICE[0].major, _DEVICE[0].minor)
    torch.cuda.get_device_properties = lambda *a, **k: _DEVICE[0]
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
        for mod, names in TE_KERNELS.items():
            m = importlib.import_module(mod)
            for n in names:
                if getattr(m, n, None) is None:
                    setattr(m, n, _te_kernel(n))
        stood_in.append("Transformer Engine kernels (fused RoPE, fused MoE permutation: present, never called)")
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
    kind: str  # baseline | winner | a precision recipe (fp8-blockwise, mxfp8, ...) | overlap
    gpus: str
    arch: str = "hopper"  # the cluster GPU's architecture (DEVICES): what torch.cuda answers while it is checked
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
    config: str = ""  # the TransformerConfig class built from the validated arguments ("" when not reached)

    def row(self) -> dict:
        L = self.launch
        return {"model": L.model, "kind": L.kind, "gpus": L.gpus, "layout": L.layout, "ok": self.ok,
                "flags": len(L.flags), "rejected": self.rejected, "unknown": self.unknown,
                "rewritten": self.rewritten, "config": self.config, "failure": self.failure or L.error,
                "argv": L.flags, "env": L.env}


def cluster_for(model, gpu: str = "H200") -> str:
    """The smallest cluster of 8-GPU nodes of `gpu` (1, 2, 4, ... 32) holding the model's training state at
    BYTES_PER_PARAM bytes per parameter in USABLE_BYTES_PER_GPU per GPU (the same node count for every GPU type)."""
    need = model.total_params * BYTES_PER_PARAM / USABLE_BYTES_PER_GPU
    nodes = 1
    while nodes * 8 < need and nodes < 32:
        nodes *= 2
    return f"8x{gpu}" if nodes == 1 else f"{nodes}x8x{gpu}"


def workload_for(model) -> Workload:
    """attune's default workload (8,192-token rows), in rows no longer than the positions of a model with learned
    positions (GPT-2: 1,024, GPT-3: 2,048), where attune refuses longer rows."""
    if model.positions == "learned" and Workload().seq_length > model.max_positions:
        return Workload(seq_length=model.max_positions)
    return Workload()


def precision_arch(recipe: str) -> str:
    """The architecture a precision recipe is checked on: Hopper where it runs there (bf16, fp8 delayed,
    tensorwise, blockwise), else Blackwell (mxfp8, nvfp4; attune.spec.precision.hardware_refusal)."""
    return "hopper" if hardware_refusal(Layout(**fields_for(recipe)), "hopper") is None else "blackwell"


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


def _cluster_file(root: Path, name: str, gpus: str):
    cl = parse_cluster(gpus)
    return cl, parse_cluster_config({"ray": {"address": "http://127.0.0.1:8265"}, "nodes": cl.nodes,
                                     "gpus_per_node": cl.gpus_per_node, "gpu_type": cl.type_key, "nvlink": 18,
                                     "python": "python3", "paths": _paths(root, name)}, f"{name}-cluster.yaml")


def _no_launch(e: AttuneError) -> str:
    return f"attune emits no launch: {' '.join(str(e).split())}"


def build_launches(name: str, root: Path, winner: bool, precisions: tuple[str, ...] = (),
                   overlap: bool = False) -> list[Launch]:
    """The model's slime launches, as attune emits them: its baseline; (winner) the predicted winner of
    ``attune tune``; per precision recipe, the low-precision best of ``attune tune --allow-numerics RECIPE`` on a
    cluster of the same size whose GPUs run it (``precision_arch``); (overlap, MoE models) a layout with
    ``--overlap-moe-expert-parallel-comm``: the winner's or else the baseline's, switched on where attune's
    rules allow it (``overlap_layout``)."""
    model = load_model(name)
    gpus, work = cluster_for(model), workload_for(model)
    cl, cfg = _cluster_file(root, name, gpus)
    out = []
    L = Launch(name, "baseline", gpus)
    base = win = None
    try:
        base, _ = baseline_layout(model, cl, work, get_engine("slime"))
        L.layout = base.label()
        _from_command(L, slime_command(model, cl, base, work, cluster_cfg=cfg))
    except AttuneError as e:
        L.error = _no_launch(e)
    out.append(L)
    if L.error:
        return out
    if winner:
        W = Launch(name, "winner", gpus)
        try:
            with tempfile.TemporaryDirectory() as t, contextlib.redirect_stdout(io.StringIO()):
                res = tune(model=name, gpus=gpus, out=Path(t) / "study", verify=False, seq=work.seq_length)
            win = res.outcome.best.to_layout()
            W.layout = win.label()
            _from_command(W, command_for_recipe(res.recipe, cfg))
        except AttuneError as e:
            W.error = _no_launch(e)
        out.append(W)
    for r in precisions:
        arch = precision_arch(r)
        P = Launch(name, r, cluster_for(model, GPU_OF_ARCH[arch]), arch=arch)
        try:
            pcl, pcfg = _cluster_file(root, name, P.gpus)
            with tempfile.TemporaryDirectory() as t, contextlib.redirect_stdout(io.StringIO()):
                res = tune(model=name, gpus=P.gpus, out=Path(t) / "study", verify=False, allow_numerics=[r],
                           seq=work.seq_length)
                if res.low_precision_recipe_path is None:
                    raise CheckError(f"no {r} layout fits {P.gpus} ({'; '.join(res.low_precision.refused) or 'memory'})"
                                     if res.low_precision is not None else f"attune tune priced no {r} layout")
                recipe = load_recipe_model(res.low_precision_recipe_path)
            P.layout = res.low_precision.low.layout.label()
            _from_command(P, command_for_recipe(recipe, pcfg))
        except AttuneError as e:
            P.error = _no_launch(e)
        out.append(P)
    if overlap and model.moe is not None:
        O = Launch(name, "overlap", gpus)
        try:
            lay = overlap_layout(model, cl, [x for x in (win, base) if x is not None])
            O.layout = lay.label()
            _from_command(O, slime_command(model, cl, lay, work, cluster_cfg=cfg))
        except AttuneError as e:
            O.error = _no_launch(e)
        out.append(O)
    return out


def overlap_layout(model, cluster, layouts: list[Layout]) -> Layout:
    """The first of `layouts` with ``moe_ep_overlap`` switched on that attune's rules accept for slime (EP > 1,
    alltoall or flex, VPP with PP > 1, no full recompute: attune.spec.moe.ep_overlap_rules); where full recompute,
    the allgather dispatcher or a pipeline without virtual stages stands in the way, the same layout with selective
    recompute, the alltoall dispatcher and 2, 3 or 4 virtual stages. A CheckError naming each try's reasons
    otherwise."""
    why = []
    for lay in layouts:
        tries = [replace(lay, moe_ep_overlap=True)]
        if lay.recompute_granularity == "full" or lay.moe_dispatcher not in ("alltoall", "flex"):
            tries.append(replace(tries[0], moe_dispatcher=lay.moe_dispatcher if lay.moe_dispatcher == "flex" else "alltoall",
                                 **({"recompute_granularity": "selective", "recompute_method": None,
                                     "recompute_num_layers": None} if lay.recompute_granularity == "full" else {})))
        if lay.pp > 1 and lay.vpp <= 1:  # PP > 1 needs virtual stages: the fewest that attune's rules accept
            tries += [replace(t, vpp=v) for t in list(tries) for v in (2, 3, 4)]
        for o in tries:
            errs = check(o, model, cluster.world_size, Workload(), get_engine("slime"))
            if not errs:
                return o
            why.append(f"{o.label()}: {'; '.join(errs)}")
    raise CheckError("no layout of attune's takes --overlap-moe-expert-parallel-comm: " + " | ".join(why))


# ------------------------------------------------------------------------------------------- checking
def _dest_of(parser: argparse.ArgumentParser, flag: str) -> str | None:
    action = parser._option_string_actions.get(flag)  # argparse's own index of option strings
    return None if action is None else action.dest


def check_launch(sargs: types.ModuleType, L: Launch) -> Verdict:
    """Run slime's parse_args on the launch as train_async.py does, then build Megatron's TransformerConfig from
    the validated arguments as slime's model provider does first (slime/backends/megatron_utils/model_provider.py
    line 134: ``core_transformer_config_from_args(args)``; its ``__post_init__`` holds the layout rules of MoE
    overlap, recompute and fp8); compare what Megatron's parser read with the values after validation."""
    if L.error:
        return Verdict(L, ok=False)
    saved_env = dict(os.environ)
    os.environ.update(L.env)
    sys.argv = ["train_async.py"] + L.flags
    _DEVICE[0] = DEVICES[L.arch]
    err = io.StringIO()
    _PARSE_LOG.clear()
    v = Verdict(L, ok=True)
    stage = "validation"
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            ns = sargs.parse_args()
            final = dict(vars(ns))
            stage = "TransformerConfig"
            v.config = type(importlib.import_module("megatron.training.arguments")
                            .core_transformer_config_from_args(ns)).__name__
    except SystemExit as e:
        text = " ".join(err.getvalue().split())
        v.ok = False
        v.rejected = sorted(set(_ARGPARSE_ERROR_RE.findall(text)))
        v.failure = f"argparse exit {e.code}: {text[-300:]}"
        return v
    except Exception as e:  # noqa: BLE001 - any failure of the real validation is the finding
        v.ok = False
        v.failure = f"{stage}: {type(e).__name__}: {' '.join(str(e).split())[:400]}"
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
    """One markdown row per launch: flags (words of argv), rejected or unknown flags, flags rewritten by validation,
    the validation result (slime's validate_args, then Megatron's TransformerConfig) and PASS / FAIL."""
    lines = ["| model | launch | GPUs | layout | flags | rejected / unknown | rewritten by validation | "
             "validate_args, TransformerConfig | result |", "|---|---|---|---|---|---|---|---|---|"]
    for v in verdicts:
        L = v.launch
        bad = ", ".join(v.rejected + [f"{u} (unknown)" for u in v.unknown]) or "-"
        if L.error:
            res, valid = "no launch", L.error[:200]
        else:
            res = "PASS" if v.ok else "FAIL"
            valid = f"ok ({v.config})" if v.config and not v.failure else (v.failure[:200] or "-")
        lines.append(f"| {L.model} | {L.kind} | {L.gpus} | {L.layout or '-'} | {len(L.flags)} | {bad} | "
                     f"{'; '.join(v.rewritten) or '-'} | {valid.replace('|', '/')} | {res} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="check_launches", description=__doc__.split("\n\n")[0])
    ap.add_argument("--slime", required=True, type=Path, help=f"slime checkout at {SLIME_COMMIT}")
    ap.add_argument("--megatron", required=True, type=Path,
                    help=f"Megatron-LM checkout at {MEGATRON_COMMIT} with slime's megatron*.patch applied")
    ap.add_argument("--models", nargs="*", default=None, help="bundled model names (default: all)")
    ap.add_argument("--no-winner", action="store_true", help="check the baselines only (no attune tune)")
    ap.add_argument("--precision", action="append", default=[], metavar="RECIPE",
                    help=f"also the low-precision best of attune tune --allow-numerics RECIPE (one of "
                         f"{', '.join(LOW_PRECISION)}; fp8 on H200, mxfp8 and nvfp4 on B200); repeatable")
    ap.add_argument("--overlap", action="store_true",
                    help="also, for MoE models, a layout with --overlap-moe-expert-parallel-comm")
    ap.add_argument("--json", type=Path, default=None, help="also write every launch's argv and verdict here")
    a = ap.parse_args(argv)
    names = a.models or bundled_names()
    try:
        unknown = [n for n in names if n not in bundled_names()]
        if unknown:
            raise CheckError(f"unknown model(s) {', '.join(unknown)}; allowed: {', '.join(bundled_names())}")
        bad = [r for r in a.precision if r not in LOW_PRECISION]
        if bad:
            raise CheckError(f"--precision {', '.join(bad)}: allowed {', '.join(LOW_PRECISION)}")
        sargs, stood_in = load_real_parsers(a.slime, a.megatron)
    except AttuneError as e:
        print(f"check_launches: error: {e}", file=sys.stderr)
        return 2
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="attune-check-launches-") as t:
        for name in names:
            for L in build_launches(name, Path(t), winner=not a.no_winner, precisions=tuple(a.precision),
                                    overlap=a.overlap):
                v = check_launch(sargs, L)
                verdicts.append(v)
                print(f"{name} {L.kind}: {'no launch' if L.error else 'PASS' if v.ok else 'FAIL'}", file=sys.stderr)
            if a.json:  # after every model: a long run that is stopped keeps what it checked
                a.json.write_text(json.dumps([v.row() for v in verdicts], indent=1))
    print(f"slime {a.slime} and Megatron-LM {a.megatron}; stand-in modules: {', '.join(stood_in) or 'none'}\n")
    print(table(verdicts))
    emitted = [v for v in verdicts if not v.launch.error]
    failed = [v for v in emitted if not v.ok]
    print(f"\n{len(emitted)} launches checked, {len(failed)} failed; "
          f"{len(verdicts) - len(emitted)} launches attune does not emit")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
