"""The torch trainer's spec.json: what ``TorchRunner`` writes and each ``torch_worker`` rank reads.

Kept apart from the worker so the runner side never imports torch.
"""

from __future__ import annotations

from dataclasses import fields

from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec
from attune.spec.moe import MoESpec, moe_rules

__all__ = ["encode_spec", "decode_spec", "ep_refusal"]


def _dc_to_dict(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def encode_spec(model: ModelSpec, layout: Layout, workload: Workload, engine_name: str, out_dir: str,
                device: str, data_path: str | None, memory_limit_gib: float | None, timeout_s: float | None) -> dict:
    m = _dc_to_dict(model)
    m["layer_types"] = list(m["layer_types"])
    m["moe"] = _dc_to_dict(model.moe) if model.moe is not None else None  # MoE (issue 14)
    w = _dc_to_dict(workload)
    w["window"] = list(w["window"])
    return {"model": m, "layout": _dc_to_dict(layout), "workload": w, "engine": engine_name, "out_dir": str(out_dir),
            "device": device, "data_path": data_path, "memory_limit_gib": memory_limit_gib, "timeout_s": timeout_s}


def decode_spec(cfg: dict) -> tuple[ModelSpec, Layout, Workload]:
    m = dict(cfg["model"])
    m["layer_types"] = tuple(m["layer_types"])
    m["moe"] = MoESpec(**m["moe"]) if m.get("moe") else None
    w = dict(cfg["workload"])
    w["window"] = tuple(w["window"])
    return ModelSpec(**m), Layout(**cfg["layout"]), Workload(**w)




def ep_refusal(layout: Layout, model: ModelSpec) -> str:
    """Why the torch trainer cannot run the layout's expert parallelism, one line; "" when it can: the layout
    rules of ``attune.spec.moe.moe_rules`` (EP divides the experts and DP), plus what the trainer does not
    implement (ETP > 1; a dispatcher other than all-to-all at EP > 1)."""
    errs = moe_rules(layout, model)
    if layout.etp > 1:
        errs.append(f"ETP {layout.etp}: expert tensor parallelism is not implemented by the torch trainer "
                    f"(allowed: ETP 1)")
    if layout.ep > 1 and layout.moe_dispatcher not in (None, "alltoall"):
        errs.append(f"dispatcher {layout.moe_dispatcher}: the torch trainer dispatches tokens by all-to-all only "
                    f"(allowed: alltoall)")
    return f"expert parallelism of {layout.label()}: " + "; ".join(errs) if errs else ""
