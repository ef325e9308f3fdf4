"""Per-rank training program of the torch runner; torchrun starts one per device.  # entry point

    python -m torch.distributed.run --standalone --nproc-per-node N -m attune.runners.torch_worker --spec SPEC.json

Rank layout (Megatron's default order with TP = CP = 1): rank = stage * DP + dp_rank, so the DP
replicas of a stage are adjacent ranks and a pipeline is the ranks dp_rank, dp_rank + DP, ...
Expert parallelism (MoE models) folds into each stage's DP group as Megatron does: EP adjacent DP ranks form
an EP group (each holds experts / EP of the routed experts; tokens travel by all-to-all), and the DP / EP
ranks holding the same experts form the expert-data-parallel group (``attune.torchmodels.expert_parallel``).
Dense gradients are all-reduced over the stage's DP group, expert gradients over the expert-DP group only;
expert parameters have their own optimizer (sharded over the expert-DP group with the distributed optimizer).

Each rank writes `rank<R>.json` into the spec's `out_dir`: status (ok | oom | failed), the reason,
its pipeline stage, step times, losses and peak memory. Memory on CPU is the process's peak RSS.

Test-only fault injection (never set these in a real study):
  ATTUNE_TORCH_FAULT=hang|crash    hang (sleep forever) or raise at the start of a step
  ATTUNE_TORCH_FAULT_RANK=R        the rank that misbehaves (default: the last rank)
  ATTUNE_TORCH_FAULT_STEP=S        the step it misbehaves at (default: 1)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

# The worker is a torchrun entry point: torch is its reason to exist (torch_runner requires the extra), and
# every import happens here, before any memory limit applies.
import torch
import torch.distributed as dist

from attune.runners.torch_spec import decode_spec, ep_refusal
from attune.spec.engine import get_engine
from attune.spec.layout import Workload
from attune.spec.moe import expert_data_parallel
from attune.spec.placement import batching, stage_layer_counts
from attune.torchmodels import build_model, token_loss_sum
from attune.torchmodels.data import load_rows, shift_labels, step_row_indices
from attune.torchmodels.expert_parallel import ExpertParallel, ep_group_ranks, expert_dp_group_ranks
from attune.torchmodels.lowp import apply_low_precision
from attune.torchmodels.moe_block import LocalExperts

FAULT_ENV, FAULT_RANK_ENV, FAULT_STEP_ENV = "ATTUNE_TORCH_FAULT", "ATTUNE_TORCH_FAULT_RANK", "ATTUNE_TORCH_FAULT_STEP"
# issue 22: a negative control of the emulated low-precision GEMMs (attune.torchmodels.lowp.CONTROLS), set by
# attune verify's precision controls only
LOWP_CONTROL_ENV = "ATTUNE_LOWP_CONTROL"
# p2p tags: activations travel forward with one tag, gradients backward with another (gloo matches on tags).
FWD_TAG, BWD_TAG = 1, 2
# AdamW epsilon: Megatron-LM's --adam-eps default.
ADAM_EPS = 1e-8
# Collective timeout when the spec gives no trial timeout: torch.distributed's own default, 30 min.
DEFAULT_PG_TIMEOUT_S = 1800.0
KIB = 1024  # ru_maxrss is in KiB on Linux (getrusage(2))
OOM_MARKERS = ("can't allocate memory", "out of memory", "std::bad_alloc", "cannot allocate memory")


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (CUDA)
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in OOM_MARKERS)


def lr_at(step: int, w: Workload) -> float:
    """Megatron-style schedule: linear warm-up over warmup_fraction of the steps, then cosine/linear decay to min_lr."""
    warm = int(round(w.warmup_fraction * w.steps))
    if step < warm:
        return w.lr * (step + 1) / warm
    if w.lr_decay_style == "constant":
        return w.lr
    ratio = min(1.0, (step - warm) / max(1, w.steps - warm))
    if w.lr_decay_style == "linear":
        return w.min_lr + (w.lr - w.min_lr) * (1.0 - ratio)
    return w.min_lr + (w.lr - w.min_lr) * 0.5 * (1.0 + math.cos(math.pi * ratio))


def _vm_size_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * KIB
    return 0


# ---------------------------------------------------------------------- training
class Trainer:
    def __init__(self, cfg: dict, rank: int, world: int, local_rank: int, record: dict):
        self.torch, self.dist = torch, dist
        self.cfg, self.rank, self.world, self.record = cfg, rank, world, record
        self.model, self.layout, self.wl = decode_spec(cfg)
        self.engine = get_engine(cfg["engine"])
        L = self.layout
        if L.world_size != world:
            raise RuntimeError(f"layout needs {L.world_size} ranks, torchrun started {world}")
        self.pp, self.dp = L.pp, L.dp
        self.stage, self.dp_rank = divmod(rank, L.dp)
        refusal = ep_refusal(L, self.model)
        if refusal:
            raise ValueError(refusal)
        self.ep, self.edp = L.ep, expert_data_parallel(L)
        self.cuda = cfg["device"] == "cuda"
        self.device = torch.device(f"cuda:{local_rank}" if self.cuda else "cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
        timeout = cfg.get("timeout_s") or DEFAULT_PG_TIMEOUT_S
        dist.init_process_group("nccl" if self.cuda else "gloo", timeout=timedelta(seconds=float(timeout)))
        # every rank creates every group, in the same order
        self.dp_group = self.pp_group = self.emb_group = None
        for s in range(self.pp):
            g = dist.new_group([s * self.dp + d for d in range(self.dp)])
            if s == self.stage:
                self.dp_group = g
        # expert parallelism: EP groups, then expert-DP groups, every stage's, in the same order on every rank
        self.ep_group = self.edp_group = None
        for s in range(self.pp):
            for ranks in ep_group_ranks(s * self.dp, self.dp, self.ep) if self.ep > 1 else []:
                g = dist.new_group(ranks)
                if rank in ranks:
                    self.ep_group = g
            for ranks in expert_dp_group_ranks(s * self.dp, self.dp, self.ep) if self.ep > 1 and self.edp > 1 else []:
                g = dist.new_group(ranks)
                if rank in ranks:
                    self.edp_group = g
        self.ep_rank = self.dp_rank % self.ep
        tied_split = self.model.tied_embeddings and self.pp > 1
        for d in range(self.dp):
            if tied_split:
                g = dist.new_group([d, (self.pp - 1) * self.dp + d])
                if d == self.dp_rank and self.stage in (0, self.pp - 1):
                    self.emb_group = g
        self.prev_rank = rank - self.dp if self.stage > 0 else None
        self.next_rank = rank + self.dp if self.stage < self.pp - 1 else None

    def limit_memory(self) -> None:
        gib = self.cfg.get("memory_limit_gib")
        if gib is None or self.cuda:
            return
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = _vm_size_bytes() + int(gib * 2**30)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        self.record["address_space_limit_bytes"] = limit

    # -------------------------------------------------------------- p2p
    def _exchange(self, sends: list, recvs: list) -> None:
        dist = self.dist
        if self.cuda:  # NCCL: paired sends/receives must be grouped or they deadlock
            ops = [dist.P2POp(dist.isend, t, p) for t, p, _ in sends] + [dist.P2POp(dist.irecv, t, p) for t, p, _ in recvs]
            reqs = dist.batch_isend_irecv(ops) if ops else []
        else:
            reqs = [dist.isend(t, p, tag=tag) for t, p, tag in sends] + [dist.irecv(t, p, tag=tag) for t, p, tag in recvs]
        for r in reqs:
            r.wait()

    def _act(self, rows: int):
        return self.torch.empty(rows, self.wl.seq_length, self.model.hidden, device=self.device, dtype=self.torch.float32)

    def recv_forward(self, rows: int):
        if self.prev_rank is None:
            return None
        buf = self._act(rows)
        self._exchange([], [(buf, self.prev_rank, FWD_TAG)])
        return buf

    def send_forward(self, y) -> None:
        if self.next_rank is not None:
            self._exchange([(y.detach().float().contiguous(), self.next_rank, FWD_TAG)], [])

    def send_forward_recv_backward(self, y, rows: int):
        if self.next_rank is None:
            return None
        buf = self._act(rows)
        self._exchange([(y.detach().float().contiguous(), self.next_rank, FWD_TAG)], [(buf, self.next_rank, BWD_TAG)])
        return buf

    def send_backward(self, dx) -> None:
        if self.prev_rank is not None:
            self._exchange([(dx.contiguous(), self.prev_rank, BWD_TAG)], [])

    def send_backward_recv_forward(self, dx, rows: int):
        if self.prev_rank is None:
            return None
        buf = self._act(rows)
        self._exchange([(dx.contiguous(), self.prev_rank, BWD_TAG)], [(buf, self.prev_rank, FWD_TAG)])
        return buf

    def recv_backward(self, rows: int):
        if self.next_rank is None:
            return None
        buf = self._act(rows)
        self._exchange([], [(buf, self.next_rank, BWD_TAG)])
        return buf

    # -------------------------------------------------------------- compute
    def forward_step(self, mb: dict, x_in):
        torch = self.torch
        inp = mb["ids"] if self.stage == 0 else x_in.requires_grad_(True)
        if self.cuda and self.layout.precision == "bf16":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = self.net(inp)
        else:
            out = self.net(inp)
        if self.stage == self.pp - 1:
            loss = token_loss_sum(out, mb["labels"], mb["mask"]) / self.step_supervised
            self.loss_acc += loss.detach()
            return inp, loss
        return inp, out

    def backward_step(self, inp, out, grad):
        if grad is None:
            out.backward()
        else:
            self.torch.autograd.backward(out, grad)
        return inp.grad if self.stage > 0 else None

    def run_pipeline(self, mbs: list[dict]) -> None:
        """Megatron's non-interleaved 1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
        m = len(mbs)
        if self.pp == 1:
            for mb in mbs:
                inp, out = self.forward_step(mb, None)
                self.backward_step(inp, out, None)
            return
        rows = [mb["rows"] for mb in mbs]
        warm = min(self.pp - self.stage - 1, m)
        rest = m - warm
        saved: list[tuple] = []
        for i in range(warm):
            x = self.recv_forward(rows[i])
            inp, out = self.forward_step(mbs[i], x)
            self.send_forward(out)
            saved.append((inp, out))
        x = self.recv_forward(rows[warm]) if rest > 0 else None
        for i in range(rest):
            f = warm + i
            inp, out = self.forward_step(mbs[f], x)
            g = self.send_forward_recv_backward(out, rows[i])
            saved.append((inp, out))
            b_inp, b_out = saved.pop(0)
            dx = self.backward_step(b_inp, b_out, g)
            if i == rest - 1:
                self.send_backward(dx)
                x = None
            else:
                x = self.send_backward_recv_forward(dx, rows[f + 1])
        for i in range(rest, m):
            g = self.recv_backward(rows[i])
            b_inp, b_out = saved.pop(0)
            self.send_backward(self.backward_step(b_inp, b_out, g))

    def reduce_grads(self) -> None:
        torch, dist = self.torch, self.dist
        if self.emb_group is not None:  # tied embedding copies on the first and last stage: sum their grads
            w = self.net.embed.weight if self.stage == 0 else self.net.lm_head.weight
            dist.all_reduce(w.grad, group=self.emb_group)
        for p in self.params:  # a parameter no token reached this step (an idle expert) still joins the reduction
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.dp > 1:
            self._all_reduce([p.grad for p in self.dense_params], self.dp_group)
        if self.edp_group is not None:  # expert parameters: only the ranks holding the same experts
            self._all_reduce([p.grad for p in self.expert_params], self.edp_group)

    def _all_reduce(self, grads: list, group) -> None:
        if not grads:
            return
        flat = self.torch.cat([g.reshape(-1) for g in grads])
        self.dist.all_reduce(flat, group=group)
        off = 0
        for g in grads:
            g.copy_(flat[off: off + g.numel()].view_as(g))
            off += g.numel()

    def build(self) -> None:
        L, w = self.layout, self.wl
        counts = stage_layer_counts(L, self.model.num_layers)
        start = sum(counts[: self.stage])
        stop = start + counts[self.stage]
        ep = ExpertParallel(size=self.ep, rank=self.ep_rank, group=self.ep_group)
        self.net = build_model(self.model, start, stop, first=self.stage == 0, last=self.stage == self.pp - 1,
                               seed=w.seed, device=self.device, ep=ep)
        self.net.set_recompute(L.recompute_granularity, L.recompute_method, L.recompute_num_layers)
        # low precision (issue 22): the decoder layers' linears on emulated fp8 / fp4 operands
        lowp = apply_low_precision(self.net.layers, L.fp8_format, L.fp8_recipe, L.fp4_format,
                                   os.environ.get(LOWP_CONTROL_ENV) or None)
        self.params = [p for p in self.net.parameters() if p.requires_grad]
        expert_ids = {id(p) for m in self.net.modules() if isinstance(m, LocalExperts) for p in m.parameters()}
        # EP 1: every rank holds every expert, so experts are reduced and optimised as dense parameters
        split = self.ep > 1
        self.expert_params = [p for p in self.params if split and id(p) in expert_ids]
        self.dense_params = [p for p in self.params if not (split and id(p) in expert_ids)]
        self.opts = [self._optimizer(self.dense_params, self.dp, self.dp_group)]
        if self.expert_params:
            self.opts.append(self._optimizer(self.expert_params, self.edp, self.edp_group))
        self.rows = load_rows(self.cfg.get("data_path"), w.steps * w.global_batch, w.seq_length, self.model.vocab, w.seed)
        self.batch = batching(L, w, self.engine)
        self.record.update(low_precision_linears=lowp, layers=[start, stop], stage_params=sum(p.numel() for p in self.params),
                           expert_params=sum(p.numel() for p in self.params if id(p) in expert_ids),
                           ep=self.ep, ep_rank=self.ep_rank, expert_dp=self.edp,
                           rows_per_microbatch=self.batch.rows_per_microbatch, microbatches=self.batch.microbatches)

    def _optimizer(self, params: list, replicas: int, group):
        """AdamW over ``params``; sharded over ``group`` (its ``replicas`` ranks) with the distributed optimizer."""
        torch, w = self.torch, self.wl
        # Megatron applies weight decay to matrices only, not to biases and norm weights (1-D)
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": w.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        kw = dict(lr=w.lr, betas=(w.adam_beta1, w.adam_beta2), eps=ADAM_EPS)
        if self.layout.distributed_optimizer and replicas > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=group, **kw)
        return torch.optim.AdamW(groups, **kw)

    def microbatches(self, step: int) -> list[dict]:
        torch, w = self.torch, self.wl
        all_t, all_m = self.rows.take(step_row_indices(step, w.global_batch, 1, 0))
        _, all_lm = shift_labels(all_t, all_m)
        self.step_supervised = float(all_lm.sum())  # the global per-token loss denominator
        if self.step_supervised <= 0:
            raise RuntimeError(f"step {step}: no supervised tokens in the global batch")
        idx = step_row_indices(step, w.global_batch, self.dp, self.dp_rank)
        r = self.batch.rows_per_microbatch
        out = []
        for lo in range(0, len(idx), r):
            t, m = self.rows.take(idx[lo: lo + r])
            lab, lm = shift_labels(t, m)
            out.append({"rows": len(t), "ids": torch.from_numpy(t).to(self.device),
                        "labels": torch.from_numpy(lab).to(self.device), "mask": torch.from_numpy(lm).to(self.device)})
        return out

    def fault(self, step: int) -> None:
        kind = os.environ.get(FAULT_ENV, "")
        if not kind:
            return
        if self.rank != int(os.environ.get(FAULT_RANK_ENV, self.world - 1)) or step != int(os.environ.get(FAULT_STEP_ENV, 1)):
            return
        if kind == "crash":
            raise RuntimeError(f"injected crash at step {step} ({FAULT_ENV}=crash, test-only)")
        if kind == "hang":
            print(f"rank {self.rank}: injected hang at step {step} ({FAULT_ENV}=hang, test-only)", flush=True)
            while True:
                time.sleep(1.0)

    def train(self) -> None:
        torch, dist, w = self.torch, self.dist, self.wl
        self.record["step_times_s"], self.record["losses"] = [], []
        for step in range(w.steps):
            self.fault(step)
            mbs = self.microbatches(step)
            lr = lr_at(step, w)
            for opt in self.opts:
                for g in opt.param_groups:
                    g["lr"] = lr
            t0 = time.perf_counter()
            for opt in self.opts:
                opt.zero_grad(set_to_none=False)
            self.loss_acc = torch.zeros((), device=self.device, dtype=torch.float64)
            self.run_pipeline(mbs)
            self.reduce_grads()
            for opt in self.opts:
                opt.step()
            dist.all_reduce(self.loss_acc)  # only last-stage ranks hold loss; the sum is the global per-token loss
            loss = float(self.loss_acc.item())
            if self.cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            self.record["step_times_s"].append(dt)
            self.record["losses"].append(loss)
            if self.rank == 0:
                print(f"step {step} loss {loss:.6f} step_time_s {dt:.4f} lr {lr:.3e}", flush=True)
        self.record["peak_memory_bytes"] = self.peak_memory_bytes()

    def peak_memory_bytes(self) -> int:
        if self.cuda:
            return int(self.torch.cuda.max_memory_allocated(self.device))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * KIB


def _write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="attune torch runner worker (one rank)")
    ap.add_argument("--spec", required=True, help="trial spec JSON written by TorchRunner")
    args = ap.parse_args(argv)
    cfg = json.loads(Path(args.spec).read_text())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    out = Path(cfg["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    dp = int(cfg["layout"]["dp"])
    record: dict = {"rank": rank, "stage": rank // dp, "dp_rank": rank % dp, "status": "ok", "reason": ""}
    trainer = None
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        trainer = Trainer(cfg, rank, world, local_rank, record)
        trainer.limit_memory()
        trainer.build()
        trainer.train()
    except BaseException as e:  # noqa: BLE001 - every failure is recorded, then the rank exits non-zero
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))  # room to write the record
        oom = is_oom(e)
        why = f"{type(e).__name__}: {e}".strip()
        if oom and "address_space_limit_bytes" in record:
            why += f" (under the worker's memory limit of {cfg.get('memory_limit_gib')} GiB above start-up)"
        record.update(status="oom" if oom else "failed", reason=why[:2000],
                      failed_at=time.time())
        if trainer is not None:
            record["peak_memory_bytes"] = trainer.peak_memory_bytes() if not oom or not trainer.cuda else None
        traceback.print_exc()
        _write(out / f"rank{rank}.json", record)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    _write(out / f"rank{rank}.json", record)
    trainer.dist.barrier()
    trainer.dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # The rank's record is written and its process group destroyed: skip the interpreter's teardown of torch (it
    # took 1.5 s per rank on 2 CPU cores, measured 2026-12-02, i.e. per trial and per verify arm), as the failure
    # path above does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
