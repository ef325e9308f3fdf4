"""slime tools for the CLI, tests and notebooks: the preflight check of a cluster."""

from __future__ import annotations

from pathlib import Path

from attune.runners.ray.cluster import load_cluster
from attune.runners.ray.jobs import RayJobs
from attune.runners.slime.preflight import PreflightReport, run_preflight
from attune.spec.model import load_model

__all__ = ["preflight"]


def preflight(cluster_file: str | Path, model: str | None = None, jobs: RayJobs | None = None,
              timeout_s: float | None = None) -> PreflightReport:
    """Run the preflight job on the cluster of ``cluster_file`` and judge what every node holds; ``model`` (a
    bundled name or a config path) is what the checkpoint's config.json must match (None: not compared).
    jobs: a RayJobs stand-in (tests)."""
    cfg = load_cluster(cluster_file)
    spec = load_model(model) if model else None
    kw = {} if timeout_s is None else {"timeout_s": timeout_s}
    return run_preflight(jobs or RayJobs(cfg.address), cfg, spec, **kw)
