"""Trials as Ray jobs: WHERE a trial runs when it runs on a Ray cluster.

``cluster`` (the cluster file), ``jobs`` (the Jobs API: submit, follow, stop), ``runner`` (RayRunner and the
RayPayload interface; the torch trainer's payload), ``torch_job`` (the torch trainer's job entrypoint).
What slime runs on it lives in ``attune.runners.slime``, which imports this package, never the reverse.
"""
