"""GPU and cluster specifications, with the source of every number.

Units: bytes for memory sizes (GiB = 2**30 bytes where printed), TFLOP/s for compute, GB/s (1e9 bytes/s)
for bandwidths, USD per GPU-hour for prices. Bandwidths are per direction.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from attune.errors import HardwareError

GiB = 2**30




@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int  # what the driver reports as total memory (torch.cuda.get_device_properties().total_memory)
    bf16_tflops: float  # dense BF16/FP16 tensor-core peak, TFLOP/s
    hbm_gbps: float  # HBM bandwidth, GB/s
    nvlink_gbps: float  # NVLink bandwidth per GPU per direction, GB/s
    gpus_per_node: int  # default node size
    internode_gbps: float  # scale-out bandwidth per node per direction, GB/s
    pcie_gbps: float  # host link per GPU per direction, GB/s
    host_memory_bytes: int  # host RAM per node
    host_mem_gbps: float  # host DRAM bandwidth per node, GB/s (CPU optimizer)
    usd_per_hour: float  # default on-demand price per GPU-hour
    price_source: str
    source: str
    is_cpu: bool = False
    nvlink_domain: int = 0
    """GPUs on one NVLink fabric (NVL72: 72); 0: the node (HGX boards: 8 GPUs behind NVSwitch)."""
    nvls: bool = False
    """NVLink SHARP (in-switch reductions) available: third-generation NVSwitch and later (Hopper,
    Blackwell); NCCL then allocates NVLS buffers for intra-domain collectives unless NCCL_NVLS_ENABLE=0."""
    # architecture generation (ampere | hopper | blackwell; "" for CPU workers): the fitted coefficients
    # are per generation at most (attune.estimator.coefficients.coefficients_for)
    generation: str = ""
    fp8_tflops: float = 0.0
    """Dense FP8 tensor-core peak, TFLOP/s (MXFP8 runs at it on Blackwell); 0: no fp8 tensor cores (issue 22)."""
    fp4_tflops: float = 0.0
    """Dense NVFP4 tensor-core peak, TFLOP/s; 0: no fp4 tensor cores."""
    blackwell_ultra: bool = False
    """A Blackwell Ultra part (B300, GB300): the datasheets give it the same dense BF16 / FP8 peak as B200 /
    GB200, but on 160 SMs instead of 148, under a higher power limit (GB300 1,400 W vs GB200 1,200 W per GPU;
    B300 1,100 W vs B200 1,000 W) and with twice the SFU exponent rate for attention softmax (10.7 vs ~5
    TeraExponentials/s) (NVIDIA Technical Blog "Inside NVIDIA Blackwell Ultra: The Chip Powering the AI Factory
    Era", Aug 2025; DGX B300 and GB300 NVL72 datasheets). What it sustains above the nominal peak is fitted
    (``Coefficients.blackwell_ultra_compute_ratio``), not assumed."""

    @property
    def nvlink_span(self) -> int:
        """GPUs reachable over NVLink from one GPU (the node, or the NVL rack)."""
        return self.nvlink_domain or self.gpus_per_node

    @property
    def capacity_gib(self) -> float:
        """Usable device memory in GiB: the driver's total; fixed overheads are modelled separately."""
        return self.memory_bytes / GiB


# Each entry: memory as reported by the CUDA driver (the figure OOM messages quote as "total capacity").
GPUS: dict[str, GPU] = {
    "H100": GPU(
        name="H100 SXM 80GB",
        fp8_tflops=1978.9,  # NVIDIA H100 SXM datasheet: FP8 3,958 TFLOP/s with sparsity, half dense
        generation="hopper",  # NVIDIA architecture of the part
        memory_bytes=85_029_158_912,  # 79.19 GiB reported by torch on H100 SXM5 80GB HBM3
        bf16_tflops=989.4,  # NVIDIA H100 datasheet: BF16 1,979 TFLOP/s with sparsity, half dense
        hbm_gbps=3350.0,  # NVIDIA H100 SXM datasheet: 3.35 TB/s
        nvlink_gbps=450.0,  # NVLink 4: 900 GB/s bidirectional per GPU (datasheet)
        gpus_per_node=8,
        internode_gbps=400.0,  # 8 x 400 Gb/s NDR / EFA 3.2 Tb/s per node (AWS p5)
        pcie_gbps=55.0,  # PCIe Gen5 x16: 64 GB/s raw, ~55 GB/s achieved (nvbandwidth-class measurements)
        host_memory_bytes=2 * 1024**4,  # AWS p5.48xlarge: 2 TiB
        host_mem_gbps=600.0,  # 2 sockets x 8-12 DDR5 channels, ~300 GB/s achieved each (STREAM-class)
        usd_per_hour=6.88,  # AWS p5.48xlarge on-demand 55.04 USD/h / 8 GPUs (after the 2025 price cut) [unverified]
        price_source="AWS p5.48xlarge on-demand, us-east-1, 55.04 USD/h for 8 GPUs [unverified]",
        source="NVIDIA H100 Tensor Core GPU datasheet; NVIDIA nccl-tests#212 for achieved NVLink",
        nvls=True,  # third-generation NVSwitch (HGX H100): NVLink SHARP
    ),
    "H200": GPU(
        name="H200 SXM 141GB",
        fp8_tflops=1978.9,  # NVIDIA H200 SXM datasheet: FP8 3,958 TFLOP/s with sparsity, half dense
        generation="hopper",  # NVIDIA architecture of the part
        memory_bytes=150_119_374_848,  # 139.81 GiB, the "total capacity" in CUDA OOM messages on H200
        bf16_tflops=989.4,  # same Hopper SXM tensor cores as H100: 989 dense (reference notes section 6.3)
        hbm_gbps=4800.0,  # NVIDIA H200 datasheet: 4.8 TB/s HBM3e
        nvlink_gbps=450.0,  # NVLink 4: 900 GB/s bidirectional per GPU
        gpus_per_node=8,
        internode_gbps=400.0,  # AWS p5en: 3.2 Tb/s EFA per node (seed recipe stack.network)
        pcie_gbps=55.0,  # PCIe Gen5 x16
        host_memory_bytes=2 * 1024**4,  # AWS p5en.48xlarge: 2 TiB
        host_mem_gbps=600.0,  # 2-socket DDR5 host, STREAM-class
        usd_per_hour=7.91,  # AWS p5en.48xlarge 63.30 USD/h / 8; the seed's 0.88 USD/Mtok at 2,499.5 tok/s/GPU implies 7.9
        price_source="AWS p5en.48xlarge on-demand, 63.30 USD/h for 8 GPUs; consistent with the seed recipe's 0.88 USD per million tokens",
        source="NVIDIA H200 datasheet; seed recipe (instance AWS p5en.48xlarge)",
        nvls=True,  # HGX H200: third-generation NVSwitch
    ),
    "A100": GPU(
        name="A100 SXM 80GB",
        generation="ampere",  # NVIDIA architecture of the part
        memory_bytes=85_899_345_920 - 911_605_760,  # 79.15 GiB reported by torch on A100-SXM4-80GB
        bf16_tflops=312.0,  # NVIDIA A100 datasheet: BF16 312 TFLOP/s dense
        hbm_gbps=2039.0,  # A100 80GB SXM datasheet: 2,039 GB/s
        nvlink_gbps=300.0,  # NVLink 3: 600 GB/s bidirectional
        gpus_per_node=8,
        internode_gbps=50.0,  # AWS p4de: 400 Gb/s EFA per node
        pcie_gbps=25.0,  # PCIe Gen4 x16: 32 GB/s raw
        host_memory_bytes=1152 * 1024**3,  # AWS p4de.24xlarge: 1,152 GiB
        host_mem_gbps=300.0,
        usd_per_hour=5.12,  # AWS p4de.24xlarge on-demand 40.97 USD/h / 8 [unverified]
        price_source="AWS p4de.24xlarge on-demand, 40.97 USD/h for 8 GPUs [unverified]",
        source="NVIDIA A100 datasheet",
    ),
    "B200": GPU(
        name="B200 180GB",
        fp8_tflops=4500.0,  # NVIDIA HGX B200 datasheet: FP8/FP6 72 PFLOPS sparse per 8 GPUs -> 9 sparse, 4.5 dense each
        fp4_tflops=9000.0,  # HGX B200: FP4 144 PFLOPS sparse per 8 GPUs -> 18 sparse, 9 dense each
        generation="blackwell",  # NVIDIA architecture of the part
        memory_bytes=191_503_138_816,  # 178.35 GiB as reported on HGX B200 (180 GB usable of 192 GB) [unverified]
        bf16_tflops=2250.0,  # NVIDIA HGX B200: 2.25 PFLOP/s dense FP16/BF16 per GPU (18 PF sparse FP4 class sheet)
        hbm_gbps=7700.0,  # HGX B200 datasheet: 7.7 TB/s per GPU (62 TB/s per 8)
        nvlink_gbps=900.0,  # NVLink 5: 1.8 TB/s bidirectional per GPU
        gpus_per_node=8,
        internode_gbps=400.0,  # AWS p6-b200: 3.2 Tb/s EFA per node
        pcie_gbps=55.0,  # PCIe Gen5 x16
        host_memory_bytes=2 * 1024**4,
        host_mem_gbps=600.0,
        usd_per_hour=14.24,  # AWS p6-b200.48xlarge on-demand 113.93 USD/h / 8 [unverified]
        price_source="AWS p6-b200.48xlarge on-demand, 113.93 USD/h for 8 GPUs [unverified]",
        source="NVIDIA HGX B200 datasheet",
        nvls=True,  # HGX B200: fifth-generation NVLink switch
    ),
    "GB200": GPU(
        name="GB200 NVL72 (Blackwell, 186GB)",
        fp8_tflops=5000.0,  # GB200 NVL72 datasheet: FP8/FP6 720 PFLOPS sparse for 72 GPUs -> 10 sparse, 5 dense each
        fp4_tflops=10000.0,  # GB200 NVL72: FP4 1,440 PFLOPS sparse for 72 GPUs -> 20 sparse, 10 dense each
        memory_bytes=186_000_000_000,  # GB200 NVL72 datasheet: 13.4 TB HBM3e / 72 GPUs = 186 GB [unverified driver figure]
        bf16_tflops=2500.0,  # GB200 NVL72 datasheet: FP16/BF16 360 PFLOPS with sparsity for 72 GPUs -> 2.5 PF dense each
        hbm_gbps=8000.0,  # GB200 NVL72 datasheet: 576 TB/s HBM3e for 72 GPUs = 8 TB/s each
        nvlink_gbps=900.0,  # NVLink 5: 1.8 TB/s bidirectional per GPU (GB200 NVL72 datasheet: 130 TB/s for 72)
        gpus_per_node=4,  # one compute tray: 2 GB200 superchips = 2 Grace CPUs + 4 Blackwell GPUs
        internode_gbps=200.0,  # 4 x ConnectX-7 400 Gb/s per tray (one per GPU); NVLink covers the 72-GPU rack
        pcie_gbps=225.0,  # NVLink-C2C 900 GB/s bidirectional per superchip, shared by 2 GPUs: 225 GB/s per direction each
        host_memory_bytes=960 * 10**9,  # 2 Grace CPUs x 480 GB LPDDR5X per tray (GB200 datasheet: up to 480 GB each)
        host_mem_gbps=1024.0,  # Grace: up to 512 GB/s LPDDR5X each, 2 per tray
        usd_per_hour=10.50,  # CoreWeave GB200 NVL72 list price 42.00 USD/h per 4-GPU instance [unverified]
        price_source="CoreWeave GB200 NVL72 on-demand list price, 42.00 USD/h for 4 GPUs [unverified]",
        source="NVIDIA GB200 NVL72 datasheet (per-rack figures divided by 72 GPUs)",
        nvlink_domain=72,  # NVL72: 72 GPUs on one NVLink switch fabric
        nvls=True,
        generation="blackwell",  # NVIDIA architecture of the part
    ),
    "B300": GPU(
        name="B300 288GB (Blackwell Ultra, HGX/DGX B300)",
        fp8_tflops=4500.0,  # DGX B300 datasheet: 72 PFLOPS FP8 training per 8 GPUs (sparse) -> 4.5 PF dense each [unverified]
        fp4_tflops=13500.0,  # DGX B300: FP4 108 PFLOPS dense inference per 8 GPUs -> 13.5 dense each [unverified]
        generation="blackwell",  # Blackwell Ultra: the same tensor-core generation as B200
        memory_bytes=288 * 10**9,  # DGX B300 datasheet: 2.3 TB HBM3e for 8 GPUs = 288 GB each [unverified driver figure]
        bf16_tflops=2250.0,  # DGX B300 datasheet: 72 PFLOPS FP8 training per 8 GPUs (sparse) -> 4.5 PF dense FP8, 2.25 PF dense BF16 each [unverified]
        hbm_gbps=8000.0,  # HGX B300: 8 TB/s HBM3e per GPU [unverified]
        nvlink_gbps=900.0,  # NVLink 5: 1.8 TB/s bidirectional per GPU (DGX B300 datasheet: 14.4 TB/s for 8)
        gpus_per_node=8,
        internode_gbps=800.0,  # DGX B300: 8 x ConnectX-8 SuperNIC 800 Gb/s per node = 6.4 Tb/s
        pcie_gbps=55.0,  # PCIe Gen5 x16 to the x86 host
        host_memory_bytes=2 * 1024**4,  # DGX B300: 2 TB host memory
        host_mem_gbps=600.0,  # 2 x86 sockets, DDR5 (as HGX B200)
        usd_per_hour=14.24,  # [assumed: no public on-demand list price found; the B200 price]
        price_source="assumed equal to AWS p6-b200.48xlarge per GPU (no public B300 list price found) [unverified]",
        source="NVIDIA DGX B300 datasheet",
        nvls=True,
        blackwell_ultra=True,  # Blackwell Ultra (NVIDIA Blackwell Ultra technical blog, Aug 2025)
    ),
    "GB300": GPU(
        name="GB300 NVL72 (Blackwell Ultra, 288GB)",
        fp8_tflops=5000.0,  # GB300 NVL72 datasheet: FP8/FP6 720 PFLOPS sparse for 72 GPUs -> 5 PF dense each [unverified]
        fp4_tflops=15000.0,  # GB300 NVL72: FP4 1,080 PFLOPS dense for 72 GPUs -> 15 each [unverified]
        memory_bytes=288 * 10**9,  # GB300 NVL72 datasheet: up to 21 TB HBM3e for 72 GPUs = 288 GB each [unverified driver figure]
        bf16_tflops=2500.0,  # GB300 NVL72 datasheet: FP16/BF16 360 PFLOPS with sparsity for 72 GPUs -> 2.5 PF dense each
        hbm_gbps=8000.0,  # GB300 NVL72 datasheet: 576 TB/s HBM3e for 72 GPUs = 8 TB/s each
        nvlink_gbps=900.0,  # NVLink 5: 130 TB/s for 72 GPUs = 1.8 TB/s bidirectional per GPU
        gpus_per_node=4,  # one compute tray: 2 Grace CPUs + 4 Blackwell Ultra GPUs
        internode_gbps=400.0,  # 4 x ConnectX-8 SuperNIC 800 Gb/s per tray (one per GPU); NVLink covers the rack
        pcie_gbps=225.0,  # NVLink-C2C 900 GB/s bidirectional per Grace, shared by 2 GPUs (as GB200)
        host_memory_bytes=960 * 10**9,  # 2 Grace CPUs x 480 GB LPDDR5X per tray (GB300 NVL72: 17 TB LPDDR5X / 36 CPUs)
        host_mem_gbps=1024.0,  # Grace: up to 512 GB/s LPDDR5X each, 2 per tray
        usd_per_hour=10.50,  # [assumed: no public on-demand list price found; the GB200 price]
        price_source="assumed equal to CoreWeave GB200 NVL72 per GPU (no public GB300 list price found) [unverified]",
        source="NVIDIA GB300 NVL72 datasheet (per-rack figures divided by 72 GPUs)",
        nvlink_domain=72,
        nvls=True,
        generation="blackwell",
        blackwell_ultra=True,  # Blackwell Ultra (NVIDIA Blackwell Ultra technical blog, Aug 2025)
    ),
    "H800": GPU(
        name="H800 SXM 80GB",
        fp8_tflops=1978.9,  # the H100 SXM's Hopper tensor cores (NVIDIA H800 product brief; DeepSeek-V3 trained FP8 on it)
        generation="hopper",  # NVIDIA architecture of the part
        memory_bytes=85_029_158_912,  # 80 GB HBM3 as H100 SXM: 79.19 GiB reported by torch [assumed equal to H100's]
        bf16_tflops=989.4,  # same SXM Hopper compute as H100: 989 dense BF16 (NVIDIA H800 product brief) [recalled]
        hbm_gbps=3350.0,  # HBM3 3.35 TB/s as H100 SXM [recalled]
        nvlink_gbps=200.0,  # NVLink cut to 400 GB/s bidirectional for export; DeepSeek-V3 report 3.2.2: 160 GB/s achieved
        gpus_per_node=8,
        internode_gbps=400.0,  # 8 x 400 Gb/s InfiniBand per node: DeepSeek-V3 report 3.2.2 "IB (50 GB/s)" per GPU
        pcie_gbps=55.0,  # PCIe Gen5 x16, as H100
        host_memory_bytes=2 * 1024**4,  # [assumed: as the H100 nodes of this table]
        host_mem_gbps=600.0,  # 2-socket DDR5 host, STREAM-class [assumed]
        usd_per_hour=6.88,  # [assumed: no public on-demand list price (export part); the H100 price]
        price_source="assumed equal to AWS p5.48xlarge per GPU (no public H800 list price) [unverified]",
        source="NVIDIA H800 product brief (H100 SXM compute, NVLink 400 GB/s); DeepSeek-V3 Technical Report "
               "(arXiv 2412.19437) section 3.2.2: NVLink 160 GB/s and IB 50 GB/s achieved per GPU, 8 GPUs per node",
        nvls=True,  # third-generation NVSwitch (HGX H800) [assumed as HGX H100]
    ),
}


def _cpu_device() -> GPU:
    """The local CPU as a 'device' for the torch runner (gloo): host RAM split across workers."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * GiB
    return GPU(
        name="CPU worker", memory_bytes=ram,
        bf16_tflops=0.1,  # fp32 peak of one core: 2 AVX2 FMA units x 8 lanes x 2 FLOP x ~3 GHz ~ 100 GFLOP/s
        hbm_gbps=10.0,  # one core's share of DRAM bandwidth, nominal
        nvlink_gbps=2.0,  # gloo over loopback TCP, nominal
        gpus_per_node=os.cpu_count() or 1, internode_gbps=1.0, pcie_gbps=10.0, host_memory_bytes=ram,
        host_mem_gbps=10.0, usd_per_hour=0.05, price_source="nominal price of one cloud vCPU-hour",
        source="local machine (os.sysconf)", is_cpu=True,
    )


def gpu_names() -> list[str]:
    return list(GPUS) + ["cpu"]


def get_gpu(name: str, price: float | None = None) -> GPU:
    key = {k.lower(): k for k in GPUS}.get(name.lower())
    if name.lower() == "cpu":
        gpu = _cpu_device()
    elif key is None:
        raise HardwareError(f"unknown GPU type '{name}'; known: {', '.join(gpu_names())}")
    else:
        gpu = GPUS[key]
    return replace(gpu, usd_per_hour=price) if price is not None else gpu


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    nodes: int
    gpus_per_node: int
    type_key: str  # the name used in the spec, e.g. H200

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def spec(self) -> str:
        return f"{self.world_size}x{self.type_key}" if self.nodes == 1 else f"{self.nodes}x{self.gpus_per_node}x{self.type_key}"

    @property
    def host_memory_per_gpu_bytes(self) -> float:
        return self.gpu.host_memory_bytes / self.gpus_per_node


_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*(?:(\d+)\s*[xX]\s*)?([A-Za-z][A-Za-z0-9_-]*)\s*$")


def parse_cluster(spec: str, gpus_per_node: int | None = None, price: float | None = None) -> Cluster:
    """`8xH200`, `16xH100` (8 per node unless told), `2x8xH100` (nodes x GPUs per node x type), `2xcpu`."""
    m = _SPEC.match(spec or "")
    if not m:
        raise HardwareError(f"malformed GPU spec '{spec}'; expected COUNTxTYPE (8xH200) or NODESxPER_NODExTYPE (2x8xH100)")
    a, b, name = int(m.group(1)), m.group(2), m.group(3)
    if a < 1 or (b is not None and int(b) < 1):
        raise HardwareError(f"GPU spec '{spec}': GPU and node counts must be at least 1")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise HardwareError(f"--gpus-per-node {gpus_per_node}: must be at least 1")
    if price is not None and not price > 0:
        raise HardwareError(f"--price {price}: USD per GPU-hour must be positive")
    gpu = get_gpu(name, price)
    type_key = "cpu" if gpu.is_cpu else {k.lower(): k for k in GPUS}[name.lower()]
    if b is not None:
        nodes, per = a, int(b)
    else:
        per = gpus_per_node or min(a, gpu.gpus_per_node)
        if a % per:
            raise HardwareError(f"GPU spec '{spec}': {a} GPUs is not a multiple of {per} per node")
        nodes = a // per
    if nodes < 1 or per < 1:
        raise HardwareError(f"GPU spec '{spec}': counts must be positive")
    return Cluster(gpu=gpu, nodes=nodes, gpus_per_node=per, type_key=type_key)


def detect_local_gpus() -> list[str]:
    """Names of the local NVIDIA GPUs via NVML (nvidia-ml-py); [] without a driver or the package."""
    try:
        import pynvml  # type: ignore
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: NVMLError_LibraryNotFound / DriverNotLoaded
        return []
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            n = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(n.decode() if isinstance(n, bytes) else n)
        return names
    finally:
        pynvml.nvmlShutdown()
