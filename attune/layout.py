"""One parallel layout, its workload, their constraints, and Megatron-LM / slime flags in and out."""

from __future__ import annotations

import math
import shlex
from dataclasses import asdict, dataclass, field, replace

from .engines import Engine
from .models import ModelSpec


class LayoutError(ValueError):
    """A layout or workload that breaks a rule; the message names the rule and what is allowed."""


@dataclass(frozen=True)
class Workload:
    seq_length: int = 8192  # tokens per packed row
    global_batch: int = 128  # rows per optimizer step
    steps: int = 20
    window: tuple[int, int] = (5, 19)  # measured steps, inclusive
    lr: float = 1e-5
    min_lr: float = 1e-6
    lr_decay_style: str = "cosine"
    warmup_fraction: float = 0.1
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    seed: int = 42

    @property
    def tokens_per_step(self) -> int:
        return self.seq_length * self.global_batch


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False
    first: int | None = None  # layers on the first pipeline stage (None: even split)
    last: int | None = None  # layers on the last pipeline stage
    vpp: int = 1  # virtual stages per pipeline rank
    micro_batch_size: int = 1  # rows per microbatch (static batching)
    max_tokens_per_gpu: int | None = None  # slime dynamic batching: tokens per GPU per microbatch
    recompute_granularity: str = "none"  # none | selective | full
    recompute_method: str | None = None  # block | uniform (full only)
    recompute_num_layers: int | None = None
    distributed_optimizer: bool = True
    precision_aware_optimizer: bool = False
    optimizer_cpu_offload: bool = False
    offload_fraction: float = 1.0
    overlap_cpu_optimizer: bool = False
    precision: str = "bf16"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def label(self) -> str:
        parts = [f"TP{self.tp}"] + (["SP"] if self.sp else []) + [f"PP{self.pp}"]
        if self.pp > 1 and (self.first is not None or self.last is not None):
            parts.append(f"{self.first if self.first is not None else '-'}/{self.last if self.last is not None else '-'}")
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        parts.append(f"DP{self.dp}")
        if self.recompute_granularity == "full":
            parts.append(f"R{self.recompute_method[0]}{self.recompute_num_layers}")
        elif self.recompute_granularity == "selective":
            parts.append("Rsel")
        if self.optimizer_cpu_offload:
            parts.append(f"off{self.offload_fraction:g}")
        if self.max_tokens_per_gpu:
            parts.append(f"mt{self.max_tokens_per_gpu}")
        elif self.micro_batch_size > 1:
            parts.append(f"mbs{self.micro_batch_size}")
        return " ".join(parts)

    def slug(self) -> str:
        s = f"tp{self.tp}-pp{self.pp}"
        if self.pp > 1 and self.first is not None:
            s += f"-split{self.first}"
        if self.vpp > 1:
            s += f"-vpp{self.vpp}"
        if self.cp > 1:
            s += f"-cp{self.cp}"
        if self.recompute_granularity == "full":
            s += f"-r{self.recompute_method[0]}{self.recompute_num_layers}"
        elif self.recompute_granularity == "selective":
            s += "-rsel"
        if self.optimizer_cpu_offload:
            s += "-offload"
        return s

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------- derived quantities
def stage_layer_counts(layout: Layout, num_layers: int) -> list[int]:
    """Layers per pipeline rank, Megatron's rule: first/last as given, the middle stages even."""
    p = layout.pp
    if p == 1:
        return [num_layers]
    first, last = layout.first, layout.last
    fixed = (first is not None) + (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    n_mid = p - fixed
    if n_mid == 0:
        if rest != 0:
            raise LayoutError(f"layer split {first}/{last} sums to {first + last}, the model has {num_layers} layers")
        return [first, last]
    if rest <= 0 or rest % n_mid:
        raise LayoutError(
            f"layer split: {rest} layers left for {n_mid} middle stage(s) after first={first} last={last} "
            f"(model has {num_layers}); they must divide evenly and leave each stage at least one layer")
    mid = rest // n_mid
    counts = [mid] * p
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def chunk_ranges(layout: Layout, num_layers: int) -> list[list[tuple[int, int]]]:
    """For each pipeline rank, the [start, stop) layer ranges of its virtual chunks (Megatron order)."""
    counts = stage_layer_counts(layout, num_layers)
    v, p = layout.vpp, layout.pp
    sizes = [c // v for c in counts]
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    start = 0
    for chunk in range(v):
        for r in range(p):
            ranges[r].append((start, start + sizes[r]))
            start += sizes[r]
    return ranges


@dataclass(frozen=True)
class Batching:
    rows_per_microbatch: int
    tokens_per_microbatch: int  # tokens of one microbatch of the whole CP group
    tokens_per_gpu: int  # tokens one GPU processes per microbatch (after CP)
    microbatches: int  # per DP rank per optimizer step


def batching(layout: Layout, workload: Workload, engine: Engine) -> Batching:
    s = workload.seq_length
    if engine.dynamic_batching and layout.max_tokens_per_gpu:
        # slime packs rows into bins of max_tokens_per_gpu * CP tokens; a longer row forms its own bin
        rows = max(1, (layout.max_tokens_per_gpu * layout.cp) // s)
    else:
        rows = layout.micro_batch_size
    rows_per_dp = workload.global_batch / layout.dp
    m = max(1, math.ceil(rows_per_dp / rows))
    tokens = rows * s
    return Batching(rows, tokens, tokens // layout.cp, m)


# ---------------------------------------------------------------------- constraints
def check(layout: Layout, model: ModelSpec, world_size: int, workload: Workload, engine: Engine) -> list[str]:
    """Every rule the layout breaks, one message each (empty when valid)."""
    e: list[str] = []
    L = layout
    for name in ("tp", "pp", "dp", "cp", "vpp", "micro_batch_size"):
        if getattr(L, name) < 1:
            e.append(f"{name} must be >= 1 (got {getattr(L, name)})")
    if e:
        return e
    if L.world_size != world_size:
        e.append(f"world size {world_size} GPUs != TP {L.tp} x PP {L.pp} x CP {L.cp} x DP {L.dp} = {L.world_size}")
    if L.ep != 1:
        e.append(f"EP {L.ep}: only dense models (EP = 1) are supported for now")
    if model.heads % L.tp:
        e.append(f"TP {L.tp} must divide the {model.heads} attention heads")
    if model.kv_heads % L.tp:
        e.append(f"TP {L.tp} must divide the {model.kv_heads} query groups (KV heads)")
    if model.family == "qwen3_5" and not engine.gdn_replicated:
        for n, v in (("linear key heads", model.lin_k_heads), ("linear value heads", model.lin_v_heads)):
            if v % (L.tp * L.cp):
                e.append(f"TP x CP = {L.tp * L.cp} must divide the {v} {n} (megatron-core GDN)")
    if L.sp and L.tp == 1:
        e.append("sequence parallelism needs TP > 1")
    if L.pp > model.num_layers:
        e.append(f"PP {L.pp} exceeds the {model.num_layers} layers")
    if L.pp == 1 and (L.first is not None or L.last is not None):
        e.append("first/last stage layer counts need PP > 1")
    counts = None
    if not e:
        try:
            counts = stage_layer_counts(L, model.num_layers)
        except LayoutError as err:
            e.append(str(err))
    if counts is not None:
        if any(c < 1 for c in counts) or sum(counts) != model.num_layers:
            e.append(f"layer split {'/'.join(map(str, counts))} must sum to {model.num_layers} with at least one layer per stage")
        if L.vpp > 1:
            if L.pp < 2:
                e.append("virtual pipeline stages need PP >= 2")
            bad = [c for c in counts if c % L.vpp]
            if bad:
                e.append(f"VPP {L.vpp} must divide every stage's layers ({'/'.join(map(str, counts))})")
    g, meth, n = L.recompute_granularity, L.recompute_method, L.recompute_num_layers
    if g not in ("none", "selective", "full"):
        e.append(f"recompute granularity '{g}'; allowed: none, selective, full")
    elif g == "full":
        if meth not in ("block", "uniform"):
            e.append(f"full recompute needs a method: block or uniform (got {meth})")
        if n is None or n < 1:
            e.append("full recompute needs --recompute-num-layers >= 1")
        elif counts is not None and L.vpp >= 1 and not any(c < 1 for c in counts):
            per_chunk = min(counts) // L.vpp
            if meth == "uniform" and n > per_chunk:
                e.append(f"uniform recompute of {n} layers exceeds the {per_chunk} layers of the smallest chunk")
            if meth == "block" and n > max(counts) // L.vpp:
                e.append(f"block recompute of {n} layers exceeds the {max(counts) // L.vpp} layers per chunk")
    elif meth is not None or n is not None:
        e.append(f"recompute method/num-layers only apply to full recompute (granularity is {g})")
    if L.precision not in ("bf16", "fp16"):
        e.append(f"precision '{L.precision}'; allowed: bf16, fp16")
    if engine.forces_distributed_optimizer and not L.distributed_optimizer:
        e.append(f"{engine.name} always uses the distributed optimizer")
    if engine.name == "slime" and L.precision != "bf16":
        e.append("slime trains in bf16 only")
    if L.optimizer_cpu_offload:
        if not L.precision_aware_optimizer:
            e.append("optimizer CPU offload needs --use-precision-aware-optimizer (Megatron asserts it)")
        if not 0.0 < L.offload_fraction <= 1.0:
            e.append(f"offload fraction {L.offload_fraction} must be in (0, 1]")
    if L.precision_aware_optimizer and not L.distributed_optimizer:
        e.append("the precision-aware optimizer needs the distributed optimizer")
    if workload.global_batch % L.dp:
        e.append(f"global batch {workload.global_batch} rows must be divisible by DP {L.dp}")
    elif not (engine.dynamic_batching and L.max_tokens_per_gpu) and workload.global_batch % (L.dp * L.micro_batch_size):
        e.append(f"global batch {workload.global_batch} must be divisible by micro batch {L.micro_batch_size} x DP {L.dp}")
    if L.cp > 1 and workload.seq_length % (2 * L.cp):
        e.append(f"sequence length {workload.seq_length} must be divisible by 2 x CP = {2 * L.cp} (load-balanced chunks)")
    if L.max_tokens_per_gpu is not None and L.max_tokens_per_gpu < 1:
        e.append("max tokens per GPU must be positive")
    return e


def validate(layout: Layout, model: ModelSpec, world_size: int, workload: Workload, engine: Engine) -> None:
    errs = check(layout, model, world_size, workload, engine)
    if errs:
        raise LayoutError("; ".join(errs))


def derive_dp(world_size: int, tp: int, pp: int, cp: int) -> int:
    mp = tp * pp * cp
    if mp < 1 or world_size % mp:
        raise LayoutError(f"TP {tp} x PP {pp} x CP {cp} = {mp} does not divide the {world_size} GPUs")
    return world_size // mp


# ---------------------------------------------------------------------- flags in and out
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


# ---------------------------------------------------------------------- recipe blocks in and out
def from_recipe_blocks(layout_block: dict, workload_block: dict | None = None, base: Workload | None = None) -> tuple[Layout, Workload]:
    """Read the `layout` and `workload` blocks of a recipe (the seed's format)."""
    b = layout_block or {}
    if not isinstance(b, dict):
        raise LayoutError("recipe layout block must be a mapping")
    split = b.get("layer_split") or {}
    rec = b.get("recompute") or {}
    off = b.get("offload")
    gran = rec.get("granularity") or "none"
    kw = dict(
        tp=int(b.get("tp", 1)), pp=int(b.get("pp", 1)), dp=int(b.get("dp", 1)), cp=int(b.get("cp", 1)),
        ep=int(b.get("ep", 1)), sp=bool(b.get("sequence_parallel", False)),
        first=split.get("first"), last=split.get("last"), vpp=int(b.get("vpp") or 1),
        micro_batch_size=int(b.get("rows_per_microbatch") or 1),
        max_tokens_per_gpu=b.get("max_tokens_per_gpu"),
        recompute_granularity=gran,
        recompute_method=rec.get("method") if gran == "full" else None,
        recompute_num_layers=rec.get("num_layers") if gran == "full" else None,
        distributed_optimizer=bool(b.get("distributed_optimizer", True)),
        precision_aware_optimizer=bool(b.get("precision_aware_optimizer", True)),
        precision=(workload_block or {}).get("precision", "bf16"),
    )
    if isinstance(off, dict):
        kw.update(optimizer_cpu_offload=True, offload_fraction=float(off.get("fraction", 1.0)),
                  overlap_cpu_optimizer=bool(off.get("overlap", True)), precision_aware_optimizer=True)
    elif off not in (None, False, "none"):
        raise LayoutError(f"recipe layout.offload must be null or a mapping (got {off!r})")
    w = workload_block or {}
    wl = replace(base or Workload(), **{k: v for k, v in dict(
        seq_length=w.get("row_tokens"), global_batch=w.get("global_batch")).items() if v is not None})
    return Layout(**kw), wl


def to_recipe_block(layout: Layout, model: ModelSpec, batch: Batching | None = None) -> dict:
    L = layout
    counts = stage_layer_counts(L, model.num_layers)
    rec = ({"granularity": "full", "method": L.recompute_method, "num_layers": L.recompute_num_layers}
           if L.recompute_granularity == "full" else {"granularity": L.recompute_granularity, "method": None, "num_layers": None})
    rec_text = {"none": "no recompute", "selective": "selective recompute (core attention)"}.get(
        L.recompute_granularity,
        f"full recompute of the first {L.recompute_num_layers} layers of each stage (block)" if L.recompute_method == "block"
        else f"full recompute in groups of {L.recompute_num_layers} layer(s) (uniform)")
    opt = "precision-aware distributed optimizer" if L.precision_aware_optimizer else (
        "distributed optimizer" if L.distributed_optimizer else "optimizer")
    off = (f"CPU optimizer offload (fraction {L.offload_fraction:g})" if L.optimizer_cpu_offload else "no offload")
    split = "/".join(map(str, counts))
    mb = (f"{batch.rows_per_microbatch} row(s) of {batch.tokens_per_microbatch // max(batch.rows_per_microbatch, 1):,} tokens per microbatch"
          if batch else "")
    summary = (f"TP {L.tp}{' with sequence parallelism' if L.sp else ''}, PP {L.pp}"
               f"{f' ({split} layers)' if L.pp > 1 else ''}{f', VPP {L.vpp}' if L.vpp > 1 else ''}, CP {L.cp}, DP {L.dp}; "
               f"{mb + '; ' if mb else ''}{rec_text}; {opt}; {off}; dense model, no experts")
    return {
        "label": f"TP{L.tp} PP{L.pp} DP{L.dp}" + (f" CP{L.cp}" if L.cp > 1 else ""),
        "summary": summary,
        "highlights": f"{split} layer split, {rec_text}, {off}",
        "tp": L.tp, "pp": L.pp, "vpp": L.vpp, "cp": L.cp, "ep": L.ep, "etp": 1, "dp": L.dp,
        "sequence_parallel": L.sp,
        "layer_split": {"first": counts[0], "last": counts[-1]} if L.pp > 1 else None,
        "max_tokens_per_gpu": L.max_tokens_per_gpu,
        "rows_per_microbatch": batch.rows_per_microbatch if batch else L.micro_batch_size,
        "recompute": rec,
        "offload": ({"fraction": L.offload_fraction, "overlap": L.overlap_cpu_optimizer} if L.optimizer_cpu_offload else None),
        "dispatcher": None,
        "distributed_optimizer": L.distributed_optimizer,
        "precision_aware_optimizer": L.precision_aware_optimizer,
    }
