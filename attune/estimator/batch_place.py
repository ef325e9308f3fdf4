"""Where the layers and tokens of a batch of layouts sit, as arrays (the array engine's ``attune.spec.placement``).

Every quantity of ``attune.spec.placement.place`` for a whole `LayoutColumns` batch at once: batching per row;
stages and virtual chunks as padded arrays ``[rows, stages, chunks]`` (stages up to the batch's largest PP, chunks up
to its largest VPP) with masks; each chunk's [start, stop) layer range and its layers of every kind (prefix sums
over the model's layer-kind sequence, ``ModelSpec.kinds`` order); the microbatches in flight per stage.

Stage boundaries follow ``placement.chunk_ranges``: the first/last/even split is computed as arrays; explicit
``pipeline_layout`` strings and the embedding / loss accounting are few distinct values in a batch, each parsed once
by ``placement.virtual_stage_counts``. Virtual stage ``i`` sits on rank ``i % PP`` as its chunk ``i // PP``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from attune.spec.columns import NONE_INT, LayoutColumns
from attune.spec.engine import Engine
from attune.spec.layout import Workload
from attune.spec.model import ModelSpec
from attune.spec.placement import stage_layer_counts, virtual_stage_counts


@dataclass
class BatchPlacement:
    """A batch of layouts placed on one model (arrays; N rows, S stages, C chunks, K layer kinds)."""

    pp: np.ndarray  # [N] pipeline stages
    vpp: np.ndarray  # [N] virtual chunks per stage
    stage: np.ndarray  # [N, S] bool: the stage exists (rank < PP)
    chunk: np.ndarray  # [N, S, C] bool: the chunk exists (stage exists and chunk < VPP)
    start: np.ndarray  # [N, S, C] first layer of the chunk (0 where it does not exist)
    stop: np.ndarray  # [N, S, C] one past its last layer
    kinds: np.ndarray  # [N, S, C, K] layers of each kind (ModelSpec.kinds order) in the chunk
    rows_per_microbatch: np.ndarray  # [N]
    tokens_per_gpu: np.ndarray  # [N] tokens one GPU processes per microbatch (after CP)
    microbatches: np.ndarray  # [N] microbatches per DP rank per step
    inflight: np.ndarray  # [N, S] microbatches in flight at each rank's activation peak (0 for absent stages)

    @property
    def layers(self) -> np.ndarray:
        """[N, S, C] layers of each chunk."""
        return self.stop - self.start

    @cached_property
    def is_first(self) -> np.ndarray:
        """[N, S] the stage holds the input embedding."""
        return (np.arange(self.stage.shape[1]) == 0)[None, :] & self.stage

    @cached_property
    def is_last(self) -> np.ndarray:
        """[N, S] the stage holds the output layer and the loss."""
        return np.arange(self.stage.shape[1])[None, :] == (self.pp - 1)[:, None]


def kind_prefix(model: ModelSpec) -> np.ndarray:
    """[K, layers + 1] prefix counts of each layer kind (``ModelSpec.kinds`` order), read-only; once per model (a
    batch of one would otherwise pay for it on every estimate)."""
    hit = _PREFIX.get(id(model))
    if hit is None or hit[0] is not model:  # the held model makes an id reused after garbage collection a miss
        if len(_PREFIX) >= 256:
            _PREFIX.clear()
        seq = np.array([model.kinds.index(model.layer_kind(i)) for i in range(model.num_layers)], dtype=np.int64)
        onehot = seq[None, :] == np.arange(len(model.kinds))[:, None]
        prefix = np.concatenate([np.zeros((len(model.kinds), 1), np.int64), np.cumsum(onehot, axis=1)], axis=1)
        prefix.setflags(write=False)
        hit = _PREFIX[id(model)] = (model, prefix)
    return hit[1]


_PREFIX: dict[int, tuple[ModelSpec, np.ndarray]] = {}


def kinds_between(prefix: np.ndarray, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Layers of each kind in [start, stop) for arrays of ranges: shape ``start.shape + (K,)``."""
    return np.stack([p[stop] - p[start] for p in prefix], axis=-1)


def batching(cols: LayoutColumns, workload: Workload, engine: Engine) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows per microbatch, tokens per GPU per microbatch, microbatches per DP rank): ``placement.batching``."""
    s, cp, dp = workload.seq_length, cols["cp"], cols["dp"]
    mt = cols["max_tokens_per_gpu"]
    rows = cols["micro_batch_size"].copy()
    if engine.dynamic_batching:
        dyn = mt != NONE_INT
        rows[dyn] = np.maximum(1, (mt[dyn] * cp[dyn]) // s)
    m = np.maximum(1, np.ceil(workload.global_batch / dp / rows)).astype(np.int64)
    return rows, rows * s // cp, m


def _even_counts(cols: LayoutColumns, num_layers: int, P: int) -> tuple[np.ndarray, np.ndarray]:
    """([N, P] layers per rank of the first/last/even split, [N] bool rows whose split is invalid)."""
    p, first, last = cols["pp"], cols["first"], cols["last"]
    has_f, has_l = first != NONE_INT, last != NONE_INT
    rest = num_layers - np.where(has_f, first, 0) - np.where(has_l, last, 0)
    n_mid = p - has_f - has_l
    safe = np.maximum(n_mid, 1)
    bad = (p > 1) & np.where(n_mid == 0, rest != 0, (rest <= 0) | (rest % safe != 0))
    r = np.arange(P)[None, :]
    counts = np.where(r < p[:, None], (rest // safe)[:, None], 0)
    counts = np.where((r == 0) & has_f[:, None], first[:, None], counts)
    counts = np.where((r == (p - 1)[:, None]) & has_l[:, None], last[:, None], counts)
    counts = np.where((p == 1)[:, None] & (r == 0), num_layers, counts)
    return counts, bad & (p > 1)


def virtual_counts(cols: LayoutColumns, num_layers: int, P: int, V: int) -> np.ndarray:
    """[N, P x V] layers per virtual stage in Megatron order (padded with 0 past PP x VPP)."""
    p, v = cols["pp"], cols["vpp"]
    counts, bad = _even_counts(cols, num_layers, P)
    i = np.arange(P * V)[None, :]
    rank = i % p[:, None]
    vs = np.where(i < (p * v)[:, None], np.take_along_axis(counts, rank, axis=1) // v[:, None], 0)
    special = np.flatnonzero(np.not_equal(cols["pipeline_layout"], None) | cols["account_for_embedding"]
                             | cols["account_for_loss"])
    if special.size:
        seen: dict[tuple, list[int]] = {}
        for j in special:
            key = (cols["pipeline_layout"][j], int(p[j]), int(v[j]), bool(cols["account_for_embedding"][j]),
                   bool(cols["account_for_loss"][j]))
            got = seen.get(key)
            if got is None:
                got = seen[key] = virtual_stage_counts(cols.layout(int(j)), num_layers)
            vs[j, :] = 0
            vs[j, :len(got)] = got
        bad[special] = False
    if bad.any():  # the scalar rule's own one-line error for the first invalid row
        stage_layer_counts(cols.layout(int(np.flatnonzero(bad)[0])), num_layers)
    return vs


def place_batch(model: ModelSpec, cols: LayoutColumns, workload: Workload, engine: Engine) -> BatchPlacement:
    """Stages, chunks, kinds, batching and in-flight microbatches of every row (``placement.place`` as arrays)."""
    p, v = cols["pp"], cols["vpp"]
    P, V = int(p.max()), int(v.max())
    vs = virtual_counts(cols, model.num_layers, P, V)
    bounds = np.concatenate([np.zeros((len(cols), 1), np.int64), np.cumsum(vs, axis=1)], axis=1)
    r = np.arange(P)[None, :, None]
    c = np.arange(V)[None, None, :]
    stage = np.arange(P)[None, :] < p[:, None]
    chunk = stage[:, :, None] & (c < v[:, None, None])
    idx = np.where(chunk, c * p[:, None, None] + r, 0)
    start = np.where(chunk, np.take_along_axis(bounds, idx.reshape(len(cols), -1), axis=1).reshape(idx.shape), 0)
    stop = np.where(chunk, np.take_along_axis(bounds, (idx + 1).reshape(len(cols), -1), axis=1).reshape(idx.shape), 0)
    kinds = kinds_between(kind_prefix(model), start, stop)
    rows, tokens, m = batching(cols, workload, engine)
    rank = np.arange(P)[None, :]
    pc, vc, mc = p[:, None], v[:, None], m[:, None]
    one_f1b = np.minimum(pc - rank, mc).astype(np.float64)
    inter = np.minimum(2 * (pc - rank - 1) + (vc - 1) * pc + 1, mc * vc) / vc
    inflight = np.where(stage, np.where(vc == 1, one_f1b, inter), 0.0)
    return BatchPlacement(pp=p, vpp=v, stage=stage, chunk=chunk, start=start, stop=stop, kinds=kinds,
                          rows_per_microbatch=rows, tokens_per_gpu=tokens, microbatches=m, inflight=inflight)
