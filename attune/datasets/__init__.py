"""attune datasets: build fixed-length pretokenized SFT rows for slime trials (see attune.datasets.build)."""
