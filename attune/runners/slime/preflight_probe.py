"""The preflight job's driver: check every node of the Ray cluster for what a slime study needs.

Run as the Ray job's entrypoint (``attune.runners.slime.preflight`` submits it)::

    python3 -m attune.runners.slime.preflight_probe '<json: paths, python>'

It connects to the job's Ray cluster, runs :func:`node_checks` once on every alive node (a zero-CPU task
pinned to the node with ``NodeAffinitySchedulingStrategy(soft=False)``) and prints one line,
``attune-preflight: {json}``, with each node's findings. Run with ``-m`` this module is ``__main__``, so Ray
ships :func:`node_checks` to the nodes by value: it runs on a node where attune is NOT importable and then
reports that, instead of failing to unpickle.

What a node reports (raw facts; ``attune.runners.slime.preflight`` judges them against the cluster file and
the model): the slime and Megatron-LM checkouts and whether ``import slime`` / ``import megatron.core`` work
in the training image's interpreter with them on PYTHONPATH (a subprocess, as the launch sets PYTHONPATH);
the HF checkpoint's ``config.json``; the torch_dist checkpoint's tracker file
(``latest_checkpointed_iteration.txt``, Megatron-LM's ``get_checkpoint_tracker_filename``); the first bytes of
the data file (a parquet file starts with ``PAR1``); whether ``import attune`` works in the task (what the job's
runtime_env gives slime's actors); the GPUs (``nvidia-smi --query-gpu=name,memory.total``) and the NVLink
count (``nvidia-smi topo -m``, as slime's scripts and attune's launch count it); and whether the data was
tokenized with the checkpoint's tokenizer (:func:`tokenizer_match`: the ``tokenizer_sha256`` that ``attune data
build`` writes into the parquet's schema metadata against the sha256 of the checkpoint's ``tokenizer.json``).
"""
# entry point: run as the preflight Ray job's driver; prints one line

from __future__ import annotations

import json
import sys

__all__ = ["node_checks", "tokenizer_match", "data_tokenizer_sha256", "MARKER", "main"]

MARKER = "attune-preflight: "
# Seconds for the import check of slime and Megatron-LM (importing megatron.core pulls in torch) and nvidia-smi.
IMPORT_TIMEOUT_S = 180
SMI_TIMEOUT_S = 30


# attune.datasets.build: the schema metadata key of the build parameters (SCHEMA_KEY) and the JSON it holds
# (json.dumps(..., sort_keys=True): '"tokenizer_sha256": "<64 hex>"'); written out here because this module
# runs where attune may not be importable.
BUILD_KEY = b"attune.build"
_TOKENIZER_SHA_RE = rb'"tokenizer_sha256": "([0-9a-f]{64})"'
# Parquet files end with the footer (Thrift FileMetaData, which holds the key/value schema metadata as plain
# bytes), its length as 4 little-endian bytes, and the magic PAR1 (Apache Parquet format, "File format").
_PARQUET_TAIL = 8
_MAX_FOOTER_BYTES = 64 << 20


def data_tokenizer_sha256(data_path: str) -> tuple[str | None, str]:
    """(sha256 of the tokenizer.json the rows were built with, '') from an ``attune data build`` parquet's
    footer, or (None, why not). Reads the footer only; needs no pyarrow."""
    import os
    import re

    try:
        size = os.path.getsize(data_path)
        with open(data_path, "rb") as f:
            if size < 12:
                return None, "too short for a parquet file"
            f.seek(size - _PARQUET_TAIL)
            tail = f.read(_PARQUET_TAIL)
            if tail[4:] != b"PAR1":
                return None, "not a parquet file (no PAR1 footer)"
            n = int.from_bytes(tail[:4], "little")
            if not 0 < n <= min(_MAX_FOOTER_BYTES, size - 12):
                return None, f"parquet footer length {n} is not readable"
            f.seek(size - _PARQUET_TAIL - n)
            footer = f.read(n)
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"[:300]
    if BUILD_KEY not in footer:
        return None, "no attune.build metadata (not built by `attune data build`), so its tokenizer is unknown"
    m = re.search(_TOKENIZER_SHA_RE, footer)
    if m is None:
        return None, "attune.build metadata without tokenizer_sha256"
    return m.group(1).decode(), ""


def tokenizer_match(hf_dir: str, data_path: str) -> dict:
    """{"ok": bool, "detail": str}: whether the rows were tokenized with the checkpoint's tokenizer (the
    sha256 ``attune data build`` recorded against the checkpoint's tokenizer.json). Token ids from another
    tokenizer train silently on the wrong text, so anything unproven is a failure. Never raises."""
    import hashlib
    import os

    want, why = data_tokenizer_sha256(data_path)
    if want is None:
        return {"ok": False, "detail": f"the data's tokenizer is unknown: {why}"}
    tok = os.path.join(hf_dir, "tokenizer.json")
    try:
        h = hashlib.sha256()
        with open(tok, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        return {"ok": False, "detail": f"the checkpoint has no readable tokenizer.json to compare: {type(e).__name__}"}
    got = h.hexdigest()
    if got != want:
        return {"ok": False, "detail": f"the data was tokenized with tokenizer sha256 {want[:12]}..., the checkpoint's "
                                       f"tokenizer.json is {got[:12]}...: rebuild the rows with `attune data build "
                                       f"--tokenizer {tok}`"}
    return {"ok": True, "detail": f"the data was tokenized with the checkpoint's tokenizer.json (sha256 {got[:12]}...)"}


def node_checks(paths: dict, python: str) -> dict:
    """Facts about this node (everything a slime trial will need from it). Never raises: each failure is
    reported as text. Self-contained (no attune import outside the attune check; the helpers below import only
    the standard library, inside themselves, so Ray ships them by value with this function)."""
    import socket

    out: dict = {"host": socket.gethostname()}
    out.update(_checkout_facts(paths, python))
    out.update(_checkpoint_and_data_facts(paths))
    out.update(_attune_facts())
    out.update(_gpu_facts())
    return out


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str, str]:
    """(exit status or None when it could not run or timed out, stdout, stderr)."""
    import subprocess

    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return p.returncode, p.stdout, p.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, "", f"{type(e).__name__}: {e}"


def _checkout_facts(paths: dict, python: str) -> dict:
    """The slime and Megatron-LM folders, slime's entrypoint, and whether ``python`` imports both with them on
    PYTHONPATH (a subprocess, as the launch sets PYTHONPATH)."""
    import os

    out: dict = {f"{key}_dir": os.path.isdir(paths.get(key) or "") for key in ("slime", "megatron")}
    out["slime_entrypoint"] = os.path.isfile(os.path.join(paths.get("slime") or "", "train_async.py"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([paths.get("slime") or "", paths.get("megatron") or "",
                                         env.get("PYTHONPATH", "")])
    code = ("import importlib, json\nres = {}\nfor m in ('slime', 'megatron.core'):\n"
            "    try:\n        importlib.import_module(m); res[m] = None\n"
            "    except BaseException as e:\n        res[m] = f'{type(e).__name__}: {e}'.splitlines()[0][:300]\n"
            "print('IMPORTS ' + json.dumps(res))\n")
    rc, stdout, stderr = _run([python, "-c", code], IMPORT_TIMEOUT_S, env)
    line = next((x for x in stdout.splitlines() if x.startswith("IMPORTS ")), None)
    if line is not None:
        out["imports"] = json.loads(line[len("IMPORTS "):])
    else:
        why = (stderr.strip().splitlines() or [f"exit status {rc}"])[-1][:300]
        out["imports"] = {"slime": f"{python} did not run: {why}", "megatron.core": f"{python} did not run: {why}"}
    return out


def _checkpoint_and_data_facts(paths: dict) -> dict:
    """The HF checkpoint's config.json, the torch_dist checkpoint's tracker, the data file's first bytes, and
    whether the data was tokenized with the checkpoint's tokenizer."""
    import os

    hf = paths.get("hf_checkpoint") or ""
    out: dict = {"hf_dir": os.path.isdir(hf)}
    try:
        with open(os.path.join(hf, "config.json"), encoding="utf-8") as f:
            out["hf_config"] = json.load(f)
    except (OSError, ValueError) as e:
        out["hf_config"] = None
        out["hf_config_error"] = f"{type(e).__name__}: {e}"[:300]
    td = paths.get("torch_dist") or ""
    out["torch_dist_dir"] = os.path.isdir(td)
    out["torch_dist_tracker"] = os.path.isfile(os.path.join(td, "latest_checkpointed_iteration.txt"))
    data = paths.get("sft_data") or ""
    try:
        with open(data, "rb") as f:
            out["data_head"] = f.read(4).hex()
        out["data_bytes"] = os.path.getsize(data)
    except OSError as e:
        out["data_head"] = None
        out["data_error"] = f"{type(e).__name__}: {e}"[:300]
    out["tokenizer"] = tokenizer_match(hf, data)
    return out


def _attune_facts() -> dict:
    """Where ``import attune`` finds attune in this task (what the job's runtime_env gives slime's actors)."""
    import importlib
    import os

    try:
        mod = importlib.import_module("attune")
        return {"attune": os.path.dirname(mod.__file__ or "")}
    except BaseException as e:  # noqa: BLE001 - reported, not raised
        return {"attune": None, "attune_error": f"{type(e).__name__}: {e}"[:300]}


def _gpu_facts() -> dict:
    """The GPUs (name, memory in MiB) and NVLink count from nvidia-smi, or why nvidia-smi did not answer."""
    import re

    rc, stdout, stderr = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                              SMI_TIMEOUT_S)
    gpus = []
    if rc == 0:
        for row in stdout.strip().splitlines():
            name, _, mem = row.rpartition(",")
            try:
                gpus.append({"name": name.strip(), "memory_mib": float(mem)})
            except ValueError:
                continue
    out = {"gpus": gpus, "nvidia_smi": None if rc == 0 else (stderr.strip().splitlines() or ["not found"])[-1][:200]}
    rc, stdout, _ = _run(["nvidia-smi", "topo", "-m"], SMI_TIMEOUT_S)
    out["nvlink_count"] = len(re.findall(r"NV\d+", stdout)) if rc == 0 else None
    return out


def main(argv: list[str]) -> int:
    """Run node_checks on every alive node of the job's cluster and print the marker line."""
    spec = json.loads(argv[0])
    import ray  # the job's driver: ray is there (the job runs under Ray)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    task = ray.remote(num_cpus=0)(node_checks)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False))
            .remote(spec["paths"], spec["python"]) for n in nodes]
    results = []
    for n, ref in zip(nodes, refs):
        try:
            r = ray.get(ref, timeout=spec.get("timeout_s", 600))
        except Exception as e:  # noqa: BLE001 - a node that cannot run the task is a finding
            r = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        r.update(node_id=n["NodeID"], node_ip=n.get("NodeManagerAddress"),
                 ray_gpus=float((n.get("Resources") or {}).get("GPU", 0)))
        results.append(r)
    print(MARKER + json.dumps({"nodes": results}, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
