"""Typed rows of the calibration corpus: what one published run measured and how attune expresses it."""

from __future__ import annotations

from dataclasses import dataclass, field

from attune.errors import UserInputError
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec

THROUGHPUT, MEMORY = "throughput", "memory"


class CorpusError(UserInputError):
    """A corpus folder or file that cannot be read (exit code 2)."""


@dataclass(frozen=True, kw_only=True)
class MemoryObservation:
    """What a memory row measured, per GPU, in GiB (2**30 bytes)."""

    fits: bool | None = None
    """The run's verdict: True ran, False ran out of memory, None not stated."""
    stage: int | None = None
    """The pipeline stage the figures are for (None: the worst stage, i.e. the peak)."""
    components_gib: dict[str, float] = field(default_factory=dict)
    """Component memory: ``states`` (weights + gradients + optimizer states) and ``activations``."""
    peak_reserved_gib: float | None = None
    """Peak reserved by the caching allocator (``torch.cuda.max_memory_reserved``)."""
    peak_allocated_gib: float | None = None
    """Peak allocated by tensors (``torch.cuda.max_memory_allocated``)."""
    metric: str = ""
    """The source's own wording of the metric."""

    def __post_init__(self) -> None:
        for k, v in self.components_gib.items():
            if not v > 0:
                raise ValueError(f"memory component {k} must be positive GiB (got {v})")
        for name in ("peak_reserved_gib", "peak_allocated_gib"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be positive (got {v})")


@dataclass(frozen=True, kw_only=True)
class CorpusRow:
    """One measured run of the corpus, expressed for the estimator or kept with the reason it is not."""

    id: str
    """The row's id in its file (unique across the corpus)."""
    series: str
    """The sweep it belongs to (rows of one weak/strong scaling table); the fit weights series, not rows."""
    file: str
    """Where it was read: ``dense.yaml``, ``moe.yaml``, ``memory.yaml`` or ``seed``."""
    kinds: tuple[str, ...]
    """What it measured: ``throughput`` and/or ``memory``."""
    source: str = ""
    """The URL (or path) it was read from."""
    gpu_name: str = ""
    """The GPU as the source names it."""
    engine_name: str = ""
    """The engine as the source names it."""
    precision: str = ""
    """The precision class (bf16, fp16, fp8, mxfp8, nvfp4)."""
    model: ModelSpec | None = None
    """The model rebuilt from the row's geometry (None when not expressed)."""
    cluster: Cluster | None = None
    """The GPUs it ran on."""
    layout: Layout | None = None
    """The parallel layout that ran."""
    workload: Workload | None = None
    """Row length and global batch."""
    engine: Engine | None = None
    """attune's engine closest to the one that ran."""
    tokens_per_s_per_gpu: float | None = None
    """Measured throughput, tokens per second per GPU."""
    memory: MemoryObservation | None = None
    """Measured memory (memory rows and the seed's verdicts)."""
    reason: str | None = None
    """Why the row is not expressed (None: it is)."""
    assumptions: tuple[str, ...] = ()
    """Values the source does not state, filled from the engine's documented defaults."""

    def __post_init__(self) -> None:
        if not self.id or not self.series:
            raise ValueError("a corpus row needs an id and a series")
        bad = [k for k in self.kinds if k not in (THROUGHPUT, MEMORY)]
        if bad or not self.kinds:
            raise ValueError(f"row {self.id}: kinds {self.kinds}; allowed: {THROUGHPUT}, {MEMORY}")
        if self.tokens_per_s_per_gpu is not None and not self.tokens_per_s_per_gpu > 0:
            raise ValueError(f"row {self.id}: tokens/s/GPU must be positive (got {self.tokens_per_s_per_gpu})")
        if self.reason is None and None in (self.model, self.cluster, self.layout, self.workload, self.engine):
            raise ValueError(f"row {self.id}: an expressed row needs model, cluster, layout, workload and engine")

    @property
    def expressed(self) -> bool:
        return self.reason is None

    @property
    def has_throughput(self) -> bool:
        return THROUGHPUT in self.kinds and self.tokens_per_s_per_gpu is not None

    @property
    def low_precision(self) -> bool:
        """Its GEMMs ran in fp8 / fp4 (issue 22: fitted by the low-precision stage only)."""
        return self.layout is not None and (self.layout.fp8_format is not None or self.layout.fp4_format is not None)

    @property
    def generation(self) -> str:
        return getattr(self.cluster.gpu, "generation", "") if self.cluster else ""


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """Every row read, expressed or not, and where they came from."""

    rows: tuple[CorpusRow, ...]
    """All rows, in file order (seed first)."""
    directory: str
    """The folder the corpus files were read from."""

    def __post_init__(self) -> None:
        ids = [r.id for r in self.rows]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise CorpusError(f"corpus {self.directory}: duplicate row ids {', '.join(dup[:5])}")

    @property
    def expressed(self) -> list[CorpusRow]:
        return [r for r in self.rows if r.expressed]

    @property
    def unexpressed(self) -> list[CorpusRow]:
        return [r for r in self.rows if not r.expressed]

    def series(self) -> dict[str, list[CorpusRow]]:
        out: dict[str, list[CorpusRow]] = {}
        for r in self.rows:
            out.setdefault(r.series, []).append(r)
        return out

    def without_series(self, name: str) -> "Corpus":
        return Corpus(rows=tuple(r for r in self.rows if r.series != name), directory=self.directory)

    def only(self, ids: set[str]) -> "Corpus":
        return Corpus(rows=tuple(r for r in self.rows if r.id in ids), directory=self.directory)
