import sys

import pytest

from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import load_model

SEED = str(__import__("pathlib").Path(__file__).parent / "fixtures" / "seed_recipe.yaml")


@pytest.fixture(scope="session")
def qwen():
    return load_model("Qwen3.6-27B")


@pytest.fixture(scope="session")
def h200x8():
    return parse_cluster("8xH200")


@pytest.fixture(scope="session")
def slime():
    return get_engine("slime")


def seed_layouts():
    """The four layouts the seed recipe reports on (8 x H200, Qwen3.6-27B, 8,192-token rows, batch 128)."""
    common = dict(max_tokens_per_gpu=8192, precision_aware_optimizer=True)
    tuned = dict(tp=1, pp=4, dp=2, first=16, last=14, recompute_granularity="full", recompute_method="block", **common)
    return {
        "rb12": Layout(recompute_num_layers=12, **tuned),
        "rb10": Layout(recompute_num_layers=10, **tuned),
        "tp1pp2": Layout(tp=1, pp=2, dp=4, recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1, **common),
        "slime": Layout(tp=4, sp=True, pp=2, dp=1, last=30, recompute_granularity="full", recompute_method="uniform",
                        recompute_num_layers=1, optimizer_cpu_offload=True, overlap_cpu_optimizer=True, **common),
    }


@pytest.fixture(scope="session")
def seed_cases():
    return seed_layouts()


@pytest.fixture(scope="session")
def seed_workload():
    return Workload(seq_length=8192, global_batch=128)


def pytest_runtest_setup(item):
    """In-process torch runs on one intra-op thread (the torch runner's workers already do: OMP_NUM_THREADS=1). With
    torch's default of one thread per core, OpenMP's spinning threads make a 2-core machine doing anything else
    several times slower: tests/test_torchmodels.py::test_tiny_qwen35_trains_single_process took 84 s wall / 88 s
    CPU with 2 threads against 25 s / 23 s with 1 beside one other busy process (2026-12-02, benchmarks/RESULTS.md)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
