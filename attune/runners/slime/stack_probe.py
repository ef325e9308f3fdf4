"""Probe the software stack of a slime training image; print one JSON object.

Run inside the training pod:  ``python -m attune.runners.slime.stack_probe`` (prints one JSON line; the only
place this module prints). Import:  ``from attune.runners.slime.stack_probe import probe, stack_block,
probe_json``. The launch script runs it non-fatally: where attune is not importable it says so and training
goes on.

Every field is null when the component is absent. Nothing here raises: each import is lazy and guarded,
and subprocesses (git, nvcc) run with a timeout. Package versions come from installed distribution metadata
first (cheap, no import), and from the module's ``__version__`` otherwise.

Fields (the recipe's ``stack`` mapping is built from them by :func:`stack_block`):
python, pytorch, pytorch_cuda (torch.version.cuda), cuda (toolkit: $CUDA_VERSION, then nvcc, then
/usr/local/cuda/version.json), cuda_driver (pynvml), nccl (torch.cuda.nccl.version()), transformer_engine,
megatron_core, megatron_lm_commit (git rev-parse HEAD in $MEGATRON_DIR or the checkout holding the imported
``megatron`` package), slime_commit ($SLIME_DIR or the checkout holding ``slime``), deepep,
flash_linear_attention, ray, gpus (GPU names via pynvml), nvidia_driver, probed_at (UTC date).
"""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from typing import Any

__all__ = ["probe", "stack_block", "probe_json"]

# Seconds allowed for each helper subprocess (git rev-parse, nvcc --version).
SUBPROCESS_TIMEOUT_S = 10
# Distribution names tried per component, in order (PyPI names and the names NVIDIA/source builds register).
DISTS = {
    "pytorch": ("torch",),
    "transformer_engine": ("transformer_engine", "transformer-engine", "transformer_engine_torch"),
    "megatron_core": ("megatron-core", "megatron_core"),
    "deepep": ("deep_ep", "deep-ep", "deepep"),
    "flash_linear_attention": ("flash-linear-attention", "fla-core", "fla"),
    "ray": ("ray",),
}
# Modules whose __version__ is the fallback when no distribution metadata is found.
MODULE_VERSION = {
    "transformer_engine": "transformer_engine",
    "megatron_core": "megatron.core.package_info",
    "deepep": "deep_ep",
    "flash_linear_attention": "fla",
    "ray": "ray",
}


def _dist_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except Exception:
            continue
    return None


def _module_version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
        v = getattr(mod, "__version__", None)
        return str(v) if v is not None else None
    except BaseException:  # a broken extension can raise anything, even SystemExit
        return None


def _version(key: str) -> str | None:
    return _dist_version(DISTS[key]) or (_module_version(MODULE_VERSION[key]) if key in MODULE_VERSION else None)


def _run(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False)
    except Exception:
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _package_dir(module: str) -> str | None:
    """Directory holding a top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except Exception:
        return None
    if spec is None:
        return None
    locs = list(spec.submodule_search_locations or [])
    if locs:
        return os.path.dirname(os.path.abspath(locs[0]))
    if spec.origin:
        return os.path.dirname(os.path.abspath(spec.origin))
    return None


def _git_commit(env_var: str, module: str) -> str | None:
    for d, from_import in ((os.environ.get(env_var), False), (_package_dir(module), True)):
        if d and os.path.isdir(d):
            if from_import:
                # the package must sit at the top of its own checkout; a package installed into site-packages
                # inside some other git repository (a pyenv checkout, a venv in a project) is not one
                top = _run(["git", "rev-parse", "--show-toplevel"], cwd=d)
                if not top or os.path.realpath(top) != os.path.realpath(d):
                    continue
            commit = _run(["git", "rev-parse", "HEAD"], cwd=d)
            if commit and re.fullmatch(r"[0-9a-f]{40}", commit):
                return commit
    return None


def _torch_info() -> dict[str, Any]:
    info: dict[str, Any] = {"pytorch": None, "pytorch_cuda": None, "nccl": None}
    try:
        import torch
    except BaseException:
        info["pytorch"] = _dist_version(DISTS["pytorch"])
        return info
    info["pytorch"] = str(getattr(torch, "__version__", "")) or _dist_version(DISTS["pytorch"])
    try:
        info["pytorch_cuda"] = torch.version.cuda
    except BaseException:
        pass
    try:
        v = torch.cuda.nccl.version()
        if isinstance(v, tuple):
            info["nccl"] = ".".join(str(x) for x in v[:3])
        elif isinstance(v, int):  # old torch: NCCL_VERSION_CODE, e.g. 21803 -> 2.18.3 (nccl.h encoding)
            info["nccl"] = f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"
    except BaseException:
        pass
    return info


def _cuda_toolkit() -> str | None:
    v = os.environ.get("CUDA_VERSION")  # set by NVIDIA's CUDA container images
    if v:
        return v
    out = _run(["nvcc", "--version"])
    if out:
        m = re.search(r"release (\d+\.\d+)", out)
        if m:
            return m.group(1)
    try:
        with open("/usr/local/cuda/version.json", encoding="utf-8") as f:
            return json.load(f)["cuda"]["version"]
    except Exception:
        return None


def _nvml() -> dict[str, Any]:
    info: dict[str, Any] = {"gpus": None, "nvidia_driver": None, "cuda_driver": None}
    try:
        import pynvml
    except BaseException:
        return info
    try:
        pynvml.nvmlInit()
    except BaseException:
        return info
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            n = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(n.decode() if isinstance(n, bytes) else str(n))
        info["gpus"] = names
        d = pynvml.nvmlSystemGetDriverVersion()
        info["nvidia_driver"] = d.decode() if isinstance(d, bytes) else str(d)
        c = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12090 -> 12.9 (NVML encoding 1000*major + 10*minor)
        info["cuda_driver"] = f"{c // 1000}.{c % 1000 // 10}"
    except BaseException:
        pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except BaseException:
            pass
    return info


def probe() -> dict[str, Any]:
    """Collect the versions; never raises (a failing probe yields null)."""
    result: dict[str, Any] = {}
    try:
        result["python"] = platform.python_version()
    except BaseException:
        result["python"] = None
    for _key, fn in (
        ("torch", _torch_info),
        ("nvml", _nvml),
    ):
        try:
            result.update(fn())
        except BaseException:
            pass
    steps = {
        "cuda": _cuda_toolkit,
        "transformer_engine": lambda: _version("transformer_engine"),
        "megatron_core": lambda: _version("megatron_core"),
        "megatron_lm_commit": lambda: _git_commit("MEGATRON_DIR", "megatron"),
        "slime_commit": lambda: _git_commit("SLIME_DIR", "slime"),
        "deepep": lambda: _version("deepep"),
        "flash_linear_attention": lambda: _version("flash_linear_attention"),
        "ray": lambda: _version("ray"),
    }
    for key, fn in steps.items():
        try:
            result[key] = fn()
        except BaseException:
            result[key] = None
    for key in ("pytorch", "pytorch_cuda", "nccl", "gpus", "nvidia_driver", "cuda_driver"):
        result.setdefault(key, None)
    try:
        result["probed_at"] = _dt.datetime.now(_dt.timezone.utc).date().isoformat()
    except BaseException:
        result["probed_at"] = None
    order = ("python", "pytorch", "pytorch_cuda", "cuda", "cuda_driver", "nccl", "transformer_engine",
             "megatron_core", "megatron_lm_commit", "slime_commit", "deepep", "flash_linear_attention", "ray",
             "gpus", "nvidia_driver", "probed_at")
    return {k: result.get(k) for k in order}


def stack_block(probe: dict[str, Any]) -> dict[str, Any]:
    """The recipe's ``stack`` mapping (seed format) from a probe dict; absent components stay None."""
    p = probe
    slime = p.get("slime_commit")
    mc, mlm = p.get("megatron_core"), p.get("megatron_lm_commit")
    if mlm and mc:
        megatron = f"commit {mlm[:8]} (megatron-core {mc})"
    elif mlm:
        megatron = f"commit {mlm[:8]}"
    elif mc:
        megatron = f"megatron-core {mc}"
    else:
        megatron = None
    torch_v, torch_cuda = p.get("pytorch"), p.get("pytorch_cuda")
    pytorch = None if not torch_v else (f"{torch_v} (CUDA {torch_cuda} build)" if torch_cuda else f"{torch_v} (no CUDA build)")
    nccl = p.get("nccl")
    if nccl:
        nccl = f"{nccl} (torch.cuda.nccl.version()" + (f"; CUDA {torch_cuda} build)" if torch_cuda else ")")
    found = [k for k in ("pytorch", "cuda", "nccl", "transformer_engine", "megatron_core", "megatron_lm_commit",
                         "slime_commit", "deepep", "python") if p.get(k)]
    date = p.get("probed_at") or "unknown date"
    return {
        "framework": f"slime: THUDM/slime {slime[:7]}" if slime else None,
        "megatron_lm": megatron,
        "transformer_engine": p.get("transformer_engine"),
        "pytorch": pytorch,
        "cuda": p.get("cuda"),
        "nccl": nccl,
        "deepep": p.get("deepep"),
        "python": p.get("python"),
        "source": (f"in-pod version check by attune.runners.slime.stack_probe, {date}: "
                   + (", ".join(found) if found else "nothing found")),
    }


def probe_json(argv: list[str] | None = None) -> str:
    """The probe as one JSON object (``--stack`` in argv: the recipe ``stack`` block instead); never raises."""
    args = list(argv or [])
    try:
        data = probe()
        return json.dumps(stack_block(data) if "--stack" in args else data, sort_keys=False)
    except BaseException as exc:  # never raise, even here
        return json.dumps({"error": f"stack probe failed: {exc.__class__.__name__}"})


if __name__ == "__main__":
    # The one place this module prints: `python3 -m attune.runners.slime.stack_probe [--stack]` on a node.
    print(probe_json(sys.argv[1:]))
    sys.exit(0)
