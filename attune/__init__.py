"""attune: find the fastest distributed-training layout that fits in memory, and write it down as a recipe."""

__version__ = "0.1.0"
