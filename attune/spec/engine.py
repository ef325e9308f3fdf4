"""Training engines: where slime, Megatron-LM and attune's torch runner differ in memory and speed.

Each difference is a plain field with the source that documents it, so the memory and performance
models stay engine-agnostic and read these flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from attune.errors import EngineError


@dataclass(frozen=True)
class Engine:
    name: str
    # slime forces args.use_distributed_optimizer = True and args.bf16 = not args.fp16
    # (slime/backends/megatron_utils/arguments.py _set_default_megatron_args; reference slime-and-qwen.md 1.2)
    forces_distributed_optimizer: bool
    # bytes per logit element alive at the last stage's loss peak, over [tokens, vocab/TP]:
    # slime: fp32 logits (Float16Module upcast) + fp32 softmax saved for backward + one fp32 temporary for the
    # entropy it always logs = 12; Megatron's VocabParallelCrossEntropy: bf16 logits + fp32 copy reused as
    # exp_logits = 6 (reference megatron-memory-and-performance.md section 5).
    logits_bytes_per_element: float
    # slime's Qwen3.5 plugin wraps HF's GatedDeltaNet: not split by TP or CP, full weights and full-sequence
    # compute on every rank (slime-and-qwen.md 1.6); megatron-core's GDN is head-parallel over TP x CP.
    gdn_replicated: bool
    # slime packs rows with --use-dynamic-batch-size / --max-tokens-per-gpu (slime-and-qwen.md 1.5)
    dynamic_batching: bool
    # slime's HF GDN wrapper uses python RMSNorm with fp32 copies of the layer input (slime-and-qwen.md 4.3)
    gdn_fp32_norm_copies: bool
    # fixed per-step overhead of the training loop outside the forward/backward (data preprocessing,
    # rollout-data hand-off, logging), seconds; slime measures train_wait separately (slime-and-qwen.md 2.2)
    step_overhead_s: float
    label: str = ""
    # slime sets args.bf16 = not args.fp16 and trains in bf16 only (_set_default_megatron_args; slime-and-qwen.md 1.2)
    bf16_only: bool = False
    # trials run attune's own PyTorch trainer (attune.runners.torch_worker): fp32 parameters and gradients
    # (bf16 autocast on GPU), rows read on this machine, re-run with `attune run --runner torch`
    attune_trainer: bool = False


ENGINES: dict[str, Engine] = {
    "slime": Engine("slime", True, 12.0, True, True, True, step_overhead_s=1.0, bf16_only=True,
                    label="slime (Megatron-LM backend, Qwen3.5 HF GDN plugin)"),
    "megatron": Engine("megatron", False, 6.0, False, False, False, step_overhead_s=0.3,
                       label="Megatron-LM / Megatron-Bridge"),
    # attune's own PyTorch runner: fp32 log-softmax over full logits (logits + log_softmax + grad)
    "torch": Engine("torch", False, 12.0, True, True, True, step_overhead_s=0.05, attune_trainer=True,
                    label="attune torch runner (PyTorch, gloo/NCCL)"),
}




def get_engine(name: str) -> Engine:
    if name not in ENGINES:
        raise EngineError(f"unknown engine '{name}'; allowed: {', '.join(ENGINES)}")
    return ENGINES[name]
