"""Megatron-LM / slime command-line flags in and out of a ``Layout`` and a ``Workload``."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace

from attune.errors import LayoutError
from .engine import Engine
from .layout import Layout, Workload
from .model import ModelSpec
from .placement import stage_layer_counts
from .rules import derive_dp


# flag -> (field, kind); kind: int, float, bool (store_true), str
LAYOUT_FLAGS: dict[str, tuple[str, str]] = {
    "--tensor-model-parallel-size": ("tp", "int"),
    "--pipeline-model-parallel-size": ("pp", "int"),
    "--context-parallel-size": ("cp", "int"),
    "--expert-model-parallel-size": ("ep", "int"),
    "--sequence-parallel": ("sp", "bool"),
    "--decoder-first-pipeline-num-layers": ("first", "int"),
    "--decoder-last-pipeline-num-layers": ("last", "int"),
    "--num-virtual-stages-per-pipeline-rank": ("vpp", "int"),
    "--micro-batch-size": ("micro_batch_size", "int"),
    "--max-tokens-per-gpu": ("max_tokens_per_gpu", "int"),
    "--recompute-granularity": ("recompute_granularity", "str"),
    "--recompute-method": ("recompute_method", "str"),
    "--recompute-num-layers": ("recompute_num_layers", "int"),
    "--use-distributed-optimizer": ("distributed_optimizer", "bool"),
    "--use-precision-aware-optimizer": ("precision_aware_optimizer", "bool"),
    "--optimizer-cpu-offload": ("optimizer_cpu_offload", "bool"),
    "--optimizer-offload-fraction": ("offload_fraction", "float"),
    "--overlap-cpu-optimizer-d2h-h2d": ("overlap_cpu_optimizer", "bool"),
}
WORKLOAD_FLAGS: dict[str, tuple[str, str]] = {
    "--global-batch-size": ("global_batch", "int"),
    "--seq-length": ("seq_length", "int"),
    "--lr": ("lr", "float"),
    "--min-lr": ("min_lr", "float"),
    "--lr-decay-style": ("lr_decay_style", "str"),
    "--lr-warmup-fraction": ("warmup_fraction", "float"),
    "--weight-decay": ("weight_decay", "float"),
    "--adam-beta1": ("adam_beta1", "float"),
    "--adam-beta2": ("adam_beta2", "float"),
    "--seed": ("seed", "int"),
    "--num-rollout": ("steps", "int"),
}
# flags handled specially or accepted without effect on memory/speed modelling
SPECIAL_FLAGS = {"--num-layers-per-virtual-pipeline-stage", "--use-dynamic-batch-size", "--bf16", "--fp16",
                 "--expert-tensor-parallel-size"}


@dataclass
class ParsedFlags:
    layout: Layout
    workload: Workload
    ignored: list[str] = field(default_factory=list)
    dynamic_batching: bool = False


def _split_argv(argv: list[str] | str) -> list[tuple[str, str | None]]:
    if isinstance(argv, str):
        argv = shlex.split(argv.replace("\\\n", " "))
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--"):
            i += 1
            continue
        if "=" in tok:
            k, v = tok.split("=", 1)
            out.append((k, v))
            i += 1
            continue
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if nxt is not None and not nxt.startswith("--"):
            out.append((tok, nxt))
            i += 2
        else:
            out.append((tok, None))
            i += 1
    return out


def _convert(flag: str, kind: str, value: str | None):
    if kind == "bool":
        return True
    if value is None:
        raise LayoutError(f"{flag} needs a value")
    try:
        return int(value) if kind == "int" else float(value) if kind == "float" else value
    except ValueError:
        raise LayoutError(f"{flag} {value!r}: expected {'an integer' if kind == 'int' else 'a number'}") from None


def from_flags(argv: list[str] | str, model: ModelSpec, world_size: int, base: Workload | None = None) -> ParsedFlags:
    """Read a layout and workload from Megatron-LM / slime command-line flags."""
    lay: dict = {"distributed_optimizer": False}
    wl: dict = {}
    ignored: list[str] = []
    dynamic = False
    layers_per_vstage = None
    for flag, value in _split_argv(argv):
        if flag in LAYOUT_FLAGS:
            name, kind = LAYOUT_FLAGS[flag]
            lay[name] = _convert(flag, kind, value)
        elif flag in WORKLOAD_FLAGS:
            name, kind = WORKLOAD_FLAGS[flag]
            wl[name] = _convert(flag, kind, value)
        elif flag == "--num-layers-per-virtual-pipeline-stage":
            layers_per_vstage = _convert(flag, "int", value)
        elif flag == "--use-dynamic-batch-size":
            dynamic = True
        elif flag == "--fp16":
            lay["precision"] = "fp16"
        elif flag == "--bf16":
            lay["precision"] = "bf16"
        elif flag == "--expert-tensor-parallel-size":
            if _convert(flag, "int", value) != 1:
                raise LayoutError("--expert-tensor-parallel-size: only 1 is supported (dense models)")
        else:
            ignored.append(flag)
    if dynamic and "max_tokens_per_gpu" not in lay:
        raise LayoutError("--use-dynamic-batch-size needs --max-tokens-per-gpu")
    if not dynamic:
        lay.pop("max_tokens_per_gpu", None)
    if "recompute_granularity" not in lay:
        lay["recompute_granularity"] = "none"
    tp, pp, cp = lay.get("tp", 1), lay.get("pp", 1), lay.get("cp", 1)
    lay["dp"] = derive_dp(world_size, tp, pp, cp)
    if layers_per_vstage is not None:
        counts = stage_layer_counts(Layout(pp=pp, first=lay.get("first"), last=lay.get("last")), model.num_layers)
        if counts[0] % layers_per_vstage:
            raise LayoutError(f"--num-layers-per-virtual-pipeline-stage {layers_per_vstage} must divide the {counts[0]} layers per stage")
        lay["vpp"] = counts[0] // layers_per_vstage
    return ParsedFlags(Layout(**lay), replace(base or Workload(), **wl), ignored, dynamic)


def to_flags(layout: Layout, workload: Workload | None = None, engine: Engine | None = None) -> list[str]:
    """Megatron-LM / slime flags for a layout (and workload); from_flags reads them back unchanged."""
    L = layout
    f = ["--tensor-model-parallel-size", str(L.tp)]
    if L.sp:
        f.append("--sequence-parallel")
    f += ["--pipeline-model-parallel-size", str(L.pp)]
    if L.first is not None:
        f += ["--decoder-first-pipeline-num-layers", str(L.first)]
    if L.last is not None:
        f += ["--decoder-last-pipeline-num-layers", str(L.last)]
    if L.vpp > 1:
        f += ["--num-virtual-stages-per-pipeline-rank", str(L.vpp)]
    f += ["--context-parallel-size", str(L.cp), "--expert-model-parallel-size", str(L.ep),
          "--expert-tensor-parallel-size", "1"]
    if L.recompute_granularity != "none":
        f += ["--recompute-granularity", L.recompute_granularity]
        if L.recompute_granularity == "full":
            f += ["--recompute-method", str(L.recompute_method), "--recompute-num-layers", str(L.recompute_num_layers)]
    if L.max_tokens_per_gpu:
        f += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(L.max_tokens_per_gpu)]
    else:
        f += ["--micro-batch-size", str(L.micro_batch_size)]
    if L.distributed_optimizer:
        f.append("--use-distributed-optimizer")
    if L.precision_aware_optimizer:
        f.append("--use-precision-aware-optimizer")
    if L.optimizer_cpu_offload:
        f += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", f"{L.offload_fraction:g}"]
        if L.overlap_cpu_optimizer:
            f.append("--overlap-cpu-optimizer-d2h-h2d")
    f.append("--bf16" if L.precision == "bf16" else "--fp16")
    if workload is not None:
        f += ["--global-batch-size", str(workload.global_batch), "--seq-length", str(workload.seq_length)]
    return f
