"""GPU and link specifications from public datasheets.

Every rate is *dense* (no structured sparsity): NVIDIA datasheets print the 2:4-sparse
figure first, so dense = printed / 2 where the footnote says "with sparsity". Bandwidths are
per GPU and per direction (NVLink figures on datasheets are bidirectional: we halve them).
Units: bytes, bytes/s, FLOP/s, seconds.

Sources (checked 2025-2026; numbers rounded as printed):
- H100 SXM: https://www.nvidia.com/en-us/data-center/h100/ (datasheet table, SXM column).
- H800 SXM: same silicon as H100 SXM with NVLink cut to 400 GB/s bidirectional; DeepSeek's
  "Fire-Flyer"/inference posts state 400 GB/s NVLink and one 400 Gb/s CX7 IB NIC per GPU.
- H200 SXM: https://www.nvidia.com/en-us/data-center/h200/ (141 GB, 4.8 TB/s).
- B200 (HGX B200): https://www.nvidia.com/en-us/data-center/hgx/ (8-GPU totals / 8).
- B300 (HGX B300): https://www.nvidia.com/en-us/data-center/hgx/ (8-GPU totals / 8).
- GB200 NVL72: https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (72-GPU totals / 72).
- GB300 NVL72: https://www.nvidia.com/en-us/data-center/gb300-nvl72/ (72-GPU totals / 72).
- Vera Rubin NVL72 (announced, not shipping when written; treat as preliminary):
  NVIDIA GTC 2025 / CES 2026 keynote figures, https://www.nvidia.com/en-us/data-center/
  technologies/rubin/ (NVFP4 inference 50 PF per GPU, HBM4 288 GB at ~22 TB/s,
  NVLink 6 at 3.6 TB/s per GPU, ConnectX-9 1.6 Tb/s).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
TB = 1e12
TFLOPS = 1e12
PFLOPS = 1e15


@dataclass(frozen=True)
class GpuSpec:
    """One GPU as the cost model sees it.

    ``flops`` maps a compute precision ("bf16", "fp8", "fp4") to dense FLOP/s; a precision
    the GPU lacks falls back to the next wider one (H100 runs FP4 weights as FP8 math).
    ``nvlink_bw`` and ``nic_bw`` are bytes/s per GPU per direction. ``nvlink_domain`` is
    how many GPUs share one NVLink fabric (8 for HGX boards, 72 for NVL72 racks).
    """

    name: str
    hbm_bytes: float
    hbm_bw: float
    flops: tuple[tuple[str, float], ...]
    nvlink_bw: float
    nic_bw: float
    nvlink_domain: int
    memory_domains: int = 1  # HBM stacks seen as one pool unless noted (see Rubin note)

    def peak_flops(self, precision: str) -> float:
        """Dense FLOP/s at ``precision``, falling back to the next wider precision."""
        rates = dict(self.flops)
        for p in {"fp4": ("fp4", "fp8", "bf16"), "fp8": ("fp8", "bf16")}.get(
            precision, (precision,)
        ):
            if p in rates:
                return rates[p]
        raise ValueError(f"{self.name} has no rate for precision {precision!r}")


def _gpu(
    name: str,
    hbm_gb: float,
    hbm_tb_s: float,
    bf16_tf: float,
    fp8_tf: float,
    fp4_tf: float | None,
    nvlink_bidir_gb_s: float,
    nic_gbit_s: float,
    domain: int,
    memory_domains: int = 1,
) -> GpuSpec:
    flops = [("bf16", bf16_tf * TFLOPS), ("fp8", fp8_tf * TFLOPS)]
    if fp4_tf is not None:
        flops.append(("fp4", fp4_tf * TFLOPS))
    return GpuSpec(
        name=name,
        hbm_bytes=hbm_gb * GB,
        hbm_bw=hbm_tb_s * TB,
        flops=tuple(flops),
        nvlink_bw=nvlink_bidir_gb_s * GB / 2,  # per direction
        nic_bw=nic_gbit_s * GB / 8,  # Gb/s -> bytes/s
        nvlink_domain=domain,
        memory_domains=memory_domains,
    )


def hardware_presets() -> dict[str, GpuSpec]:
    """All known GPUs by CLI name. A function, not a module dict, so nothing is mutable."""
    return {
        # H100 SXM: 80 GB HBM3, 3.35 TB/s; BF16 1,979 / FP8 3,958 TFLOPS with sparsity
        # -> 989 / 1,979 dense; NVLink 900 GB/s; ConnectX-7 400 Gb/s per GPU.
        "h100": _gpu("H100", 80, 3.35, 989, 1979, None, 900, 400, 8),
        # H800 SXM: H100 compute and HBM, NVLink 400 GB/s, one 400 Gb/s IB NIC per GPU.
        "h800": _gpu("H800", 80, 3.35, 989, 1979, None, 400, 400, 8),
        # H200 SXM: 141 GB HBM3e, 4.8 TB/s; H100 compute; NVLink 900 GB/s.
        "h200": _gpu("H200", 141, 4.8, 989, 1979, None, 900, 400, 8),
        # HGX B200: 1.44 TB and 64 TB/s per 8 GPUs; FP4 144 / FP8 72 / BF16 36 PFLOPS
        # sparse per 8 GPUs -> 9 / 4.5 / 2.25 PF dense per GPU; NVLink 5 1.8 TB/s.
        "b200": _gpu("B200", 180, 8.0, 2250, 4500, 9000, 1800, 400, 8),
        # HGX B300: 2.3 TB and 64 TB/s per 8 GPUs; FP4 108 PF dense per 8 GPUs (13.5 per
        # GPU); FP8 72 / BF16 36 PF sparse per 8 -> 4.5 / 2.25 dense; ConnectX-8 800 Gb/s.
        "b300": _gpu("B300", 288, 8.0, 2250, 4500, 13500, 1800, 800, 8),
        # GB200 NVL72: 13.4 TB HBM3e, 576 TB/s; FP4 1,440 PF sparse (720 dense), FP8 720 PF
        # sparse, BF16 360 PF sparse, per 72 GPUs; NVLink 130 TB/s (1.8 TB/s per GPU).
        "gb200-nvl72": _gpu("GB200", 186, 8.0, 2500, 5000, 10000, 1800, 400, 72),
        # GB300 NVL72: 20.7 TB HBM3e (288 GB per GPU), 576 TB/s; FP4 1,440 | 1,080 PF
        # (sparse | dense) -> 15 PF dense per GPU; FP8 720 PF and BF16 360 PF sparse;
        # NVLink 130 TB/s; ConnectX-8 800 Gb/s per GPU.
        "gb300-nvl72": _gpu("GB300", 288, 8.0, 2500, 5000, 15000, 1800, 800, 72),
        # Vera Rubin NVL72 (preliminary): 288 GB HBM4 at ~22 TB/s; NVFP4 50 PF inference;
        # FP8 and BF16 not itemised in the keynote: assumed 1/3 and 1/6 of NVFP4 (the
        # Blackwell ratio FP8 = FP4 / 2 would overstate them). Each Rubin package holds two
        # reticle dies, hence two memory domains per GPU.
        "vr-nvl72": _gpu("Rubin", 288, 22.0, 8300, 16600, 50000, 3600, 1600, 72, 2),
    }


def get_hardware(name: str) -> GpuSpec:
    presets = hardware_presets()
    try:
        return presets[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; choose one of {sorted(presets)}") from None


@dataclass(frozen=True)
class Link:
    """A point-to-point path for collectives: latency per collective call, bytes/s."""

    name: str
    latency_s: float
    bandwidth: float


# Latency per dispatch/combine call. NVLink: a few microseconds of kernel launch and
# barrier (DeepEP intranode kernels). RDMA: ~20 us of queue-pair and completion round trips
# (DeepEP low-latency kernels at tiny batches take ~20-40 us end to end).
NVLINK_LATENCY_S = 8e-6
NIC_LATENCY_S = 20e-6


def ep_links(gpu: GpuSpec, ep_size: int) -> tuple[Link, Link | None, float]:
    """The links an all-to-all over ``ep_size`` ranks uses.

    Returns (nvlink, nic or None, fraction of peer traffic that leaves the NVLink domain).
    Ranks fill NVLink domains first; a peer outside the rank's domain is reached over the NIC.
    """
    nvlink = Link("nvlink", NVLINK_LATENCY_S, gpu.nvlink_bw)
    if ep_size <= gpu.nvlink_domain:
        return nvlink, None, 0.0
    peers = ep_size - 1
    local_peers = gpu.nvlink_domain - 1
    return nvlink, Link("nic", NIC_LATENCY_S, gpu.nic_bw), (peers - local_peers) / peers
