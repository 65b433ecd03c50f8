"""Built-in GPU table (shared by `tune` and `build`). Datasheet values; see each entry's source."""
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


GPUS: dict[str, GPU] = {
    # NVIDIA H100 datasheet (SXM5): 989 TFLOPS BF16 dense, 1979 FP8 dense, 3.35 TB/s, 80 GB.
    "h100_sxm": GPU("H100 SXM", 989.0, 1979.0, 3.35, 80, "NVIDIA H100 Tensor Core GPU datasheet"),
    # H100 PCIe: 756 BF16 dense, 1513 FP8 dense, 2.0 TB/s, 80 GB.
    "h100_pcie": GPU("H100 PCIe", 756.0, 1513.0, 2.0, 80, "NVIDIA H100 Tensor Core GPU datasheet"),
    # H200 SXM: same compute as H100 SXM, 4.8 TB/s, 141 GB.
    "h200": GPU("H200 SXM", 989.0, 1979.0, 4.8, 141, "NVIDIA H200 Tensor Core GPU datasheet"),
    # B200 (HGX B200 per GPU): 2.25 PFLOPS BF16 dense, 4.5 FP8 dense, 8 TB/s, 180 GB.
    "b200": GPU("B200", 2250.0, 4500.0, 8.0, 180, "NVIDIA HGX B200 datasheet (per GPU, dense)"),
    # A100 80GB SXM: 312 BF16 dense, no FP8, 2.039 TB/s.
    "a100_80gb": GPU("A100 80GB SXM", 312.0, 0.0, 2.039, 80, "NVIDIA A100 datasheet"),
    # L40S: 362 BF16 dense, 733 FP8 dense, 0.864 TB/s, 48 GB.
    "l40s": GPU("L40S", 362.0, 733.0, 0.864, 48, "NVIDIA L40S datasheet"),
}
