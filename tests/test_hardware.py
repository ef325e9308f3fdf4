import pytest

from attune.errors import HardwareError
from attune.estimator.coefficients import DEFAULT
from attune.estimator.performance import _link_gbps
from attune.spec.hardware import GPUS, get_gpu, parse_cluster


def test_specs():
    c = parse_cluster("8xH200")
    assert (c.nodes, c.gpus_per_node, c.world_size) == (1, 8, 8)
    c = parse_cluster("16xH100")
    assert (c.nodes, c.gpus_per_node) == (2, 8)
    c = parse_cluster("2x8xH100")
    assert (c.nodes, c.gpus_per_node, c.spec) == (2, 8, "2x8xH100")
    c = parse_cluster("16xH100", gpus_per_node=4)
    assert c.nodes == 4
    assert parse_cluster("2xcpu").gpu.is_cpu


def test_unknown_and_malformed():
    with pytest.raises(HardwareError, match="known: H100, H200, A100, B200, GB200"):
        parse_cluster("8xV100")
    with pytest.raises(HardwareError, match="malformed"):
        parse_cluster("eight H200")
    with pytest.raises(HardwareError, match="multiple"):
        parse_cluster("12xH100")


def test_table_sane_and_price_override():
    for g in GPUS.values():
        assert g.capacity_gib > 70 and g.bf16_tflops > 300 and g.usd_per_hour > 0 and g.price_source
    h200 = get_gpu("h200")
    assert 139 < h200.capacity_gib < 141
    # the seed: 0.88 USD per million tokens at 2,499.52 tokens/s/GPU
    assert h200.usd_per_hour / 3600 / 2499.52 * 1e6 == pytest.approx(0.88, abs=0.005)
    assert parse_cluster("8xH200", price=2.0).gpu.usd_per_hour == 2.0


def test_gb200_nvl72():
    """GB200 NVL72: 4 GPUs per compute tray, 72 on one NVLink fabric, 2.5 PFLOP/s dense BF16 each."""
    c = parse_cluster("128xGB200")
    assert (c.gpus_per_node, c.nodes) == (4, 32)
    g = c.gpu
    assert g.nvlink_span == 72 and g.nvls and g.generation == "blackwell"
    assert g.bf16_tflops == 2500.0 and 170 < g.capacity_gib < 180
    assert get_gpu("H200").nvlink_span == 8 and not get_gpu("A100").nvls


def test_nvl72_collectives_stay_on_nvlink():
    """A 64-GPU DP group spans 16 GB200 trays but one NVLink domain: NVLink bandwidth, not the NICs."""
    gb = parse_cluster("128xGB200")
    h = parse_cluster("128xH100")
    assert _link_gbps(64, 1, gb, DEFAULT) == pytest.approx(900 * DEFAULT.nvlink_efficiency)
    assert _link_gbps(64, 1, h, DEFAULT) < 100


def test_h800_is_hopper_with_the_export_nvlink():
    """H800: H100 SXM compute with NVLink cut to 400 GB/s bidirectional (DeepSeek-V3 report: 160 GB/s achieved, IB
    50 GB/s per GPU); published runs on H800 (DeepSeek's, DeepEP's figures) are readable."""
    from attune.calibrate.corpus import _gpu_key

    h800, h100 = GPUS["H800"], GPUS["H100"]
    assert (h800.generation, h800.bf16_tflops, h800.fp8_tflops) == ("hopper", h100.bf16_tflops, h100.fp8_tflops)
    assert h800.nvlink_gbps < h100.nvlink_gbps and h800.internode_gbps / h800.gpus_per_node == 50.0
    assert _gpu_key("H800 (DeepSeek cluster)") == "H800" and _gpu_key("DGX-H100") == "H100"
