"""Built-in GPU table (shared by `tune` and `build`). Datasheet values; see each entry's source.

NVIDIA datasheets quote tensor-core throughput "with sparsity" (2:4 structured); the table stores the dense
figure (half of it), which is what a GEMM on dense weights can reach. `link_gb_s` is the GPU-to-GPU bandwidth
per direction (half the bidirectional figure the datasheets quote), used for tensor-parallel all-reduce.
Measured rates sit below these (anchors.md: an H200 reaches ~790 of 989 BF16 TFLOP/s in a GEMM and ~4.3 of
4.8 TB/s in a device copy); `tune.efficiency` scales them, or a `specpipe profile` file replaces them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float       # dense
    fp8_tflops: float        # dense (0 where the GPU has no FP8 tensor cores)
    hbm_tb_s: float          # memory bandwidth, TB/s
    memory_gb: float
    source: str
    link_gb_s: float = 0.0   # GPU-to-GPU, per direction, GB/s

    @property
    def has_fp8(self) -> bool:
        return self.fp8_tflops > 0

    def ridge_flop_per_byte(self, dtype: str = "fp8") -> float:
        """Peak / bandwidth: the arithmetic intensity where a kernel stops being memory-bound."""
        peak = self.fp8_tflops if dtype == "fp8" else self.bf16_tflops
        return peak / self.hbm_tb_s


GPUS: dict[str, GPU] = {
    # H100 SXM5 80 GB: FP8 3,958 / BF16 1,979 TFLOPS with sparsity -> 1979 / 989 dense; 3.35 TB/s HBM3;
    # NVLink 900 GB/s (bidirectional). Source: NVIDIA H100 Tensor Core GPU datasheet.
    "h100_sxm": GPU("H100 SXM", 989.0, 1979.0, 3.35, 80, "NVIDIA H100 Tensor Core GPU datasheet (SXM)", 450),
    # H100 PCIe 80 GB: FP8 3,026 / BF16 1,513 with sparsity -> 1513 / 756 dense; 2.0 TB/s HBM2e;
    # PCIe Gen5 x16 128 GB/s (NVLink bridge pairs only). Source: NVIDIA H100 Tensor Core GPU datasheet (PCIe).
    "h100_pcie": GPU("H100 PCIe", 756.0, 1513.0, 2.0, 80, "NVIDIA H100 Tensor Core GPU datasheet (PCIe)", 64),
    # H100 NVL 94 GB: FP8 3,341 / BF16 1,671 with sparsity -> 1671 / 835 dense; 3.9 TB/s; NVLink bridge 600 GB/s.
    # Source: NVIDIA H100 Tensor Core GPU datasheet (NVL).
    "h100_nvl": GPU("H100 NVL", 835.0, 1671.0, 3.9, 94, "NVIDIA H100 Tensor Core GPU datasheet (NVL)", 300),
    # H200 SXM 141 GB: same tensor cores as H100 SXM (FP8 1979 / BF16 989 dense); 4.8 TB/s HBM3e; NVLink 900 GB/s.
    # Source: NVIDIA H200 Tensor Core GPU datasheet.
    "h200": GPU("H200 SXM", 989.0, 1979.0, 4.8, 141, "NVIDIA H200 Tensor Core GPU datasheet (SXM)", 450),
    # H200 NVL 141 GB: FP8 3,341 / BF16 1,671 with sparsity -> 1671 / 835 dense; 4.8 TB/s; NVLink bridge 900 GB/s.
    # Source: NVIDIA H200 Tensor Core GPU datasheet (NVL).
    "h200_nvl": GPU("H200 NVL", 835.0, 1671.0, 4.8, 141, "NVIDIA H200 Tensor Core GPU datasheet (NVL)", 450),
    # B200 (HGX B200, per GPU = 1/8 of the board): FP8 72 PFLOPS / FP16-BF16 36 PFLOPS with sparsity per 8 GPUs
    # -> 4500 / 2250 dense; 64 TB/s over 8 GPUs -> 8 TB/s HBM3e; 1.44 TB -> 180 GB; NVLink 5 1.8 TB/s.
    # Source: NVIDIA HGX B200 / DGX B200 datasheet.
    "b200": GPU("B200", 2250.0, 4500.0, 8.0, 180, "NVIDIA HGX B200 datasheet (per GPU, dense)", 900),
    # A100 80 GB SXM: BF16 312 dense (624 sparse), no FP8 tensor cores; 2,039 GB/s HBM2e; NVLink 600 GB/s.
    # Source: NVIDIA A100 Tensor Core GPU datasheet.
    "a100_80gb": GPU("A100 80GB SXM", 312.0, 0.0, 2.039, 80, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)", 300),
    # L40S 48 GB: FP8 1,466 / BF16 733 with sparsity -> 733 / 362 dense; 864 GB/s GDDR6; PCIe Gen4 x16 64 GB/s,
    # no NVLink. Source: NVIDIA L40S GPU datasheet.
    "l40s": GPU("L40S", 362.0, 733.0, 0.864, 48, "NVIDIA L40S GPU datasheet", 32),
}
