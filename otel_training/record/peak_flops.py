"""Peak dense FLOP/s of NVIDIA GPUs by model and dtype: the denominator of MFU.

From NVIDIA's datasheets. They quote tensor-core figures "with sparsity"
(2:4 structured sparsity doubles them); training runs dense, so the figures here
are half of those. FP32 is the CUDA-core figure (no sparsity).

- H100 SXM / PCIe / NVL: "NVIDIA H100 Tensor Core GPU" datasheet (FP32 67 / 51 / 60 TF;
  TF32 989 / 756 / 835 TF*; BF16 and FP16 1,979 / 1,513 / 1,671 TF*; FP8 3,958 / 3,026 / 3,341 TF*).
- H200 SXM / NVL: "NVIDIA H200 Tensor Core GPU" datasheet (the H100 SXM / NVL figures).
- GH200: "NVIDIA GH200 Grace Hopper Superchip" datasheet (the H100 SXM figures).
- A100 40/80 GB, SXM and PCIe: "NVIDIA A100 Tensor Core GPU" datasheet (FP32 19.5 TF;
  TF32 312 TF*; BF16 and FP16 624 TF*).
- A10: "NVIDIA A10 Tensor Core GPU" datasheet (FP32 31.2; TF32 125*; BF16/FP16 250*).
- L4: "NVIDIA L4 Tensor Core GPU" datasheet (FP32 30.3; TF32 120*; BF16/FP16 242*; FP8 485*).
- L40: "NVIDIA L40 GPU" datasheet (FP32 90.5; TF32 181*; BF16/FP16 362*; FP8 724*).
- L40S: "NVIDIA L40S GPU" datasheet (FP32 91.6; TF32 366*; BF16/FP16 733*; FP8 1,466*).
- B200: "NVIDIA HGX B200" datasheet, 8-GPU figures / 8 (FP32 75; TF32 2,250*; BF16/FP16 4,500*;
  FP8 9,000*).
- V100 SXM2 / PCIe / V100S: "NVIDIA V100 Tensor Core GPU" datasheet (tensor FP16 125 / 112 / 130;
  FP32 15.7 / 14 / 16.4; no sparsity, no BF16 or TF32 tensor cores).
- T4: "NVIDIA T4" datasheet (FP16 mixed 65; FP32 8.1).

(* with sparsity.) A model or dtype not in the table has no peak: set
``OTEL_TRAINING_PEAK_FLOPS`` for it.
"""

from __future__ import annotations

import re

T = 1e12
_HOPPER_SXM = {"fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T, "fp8": 1979 * T}
_HOPPER_NVL = {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T, "fp8": 1670.5 * T}
_A100 = {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T}

# (pattern on the device name as CUDA / NVML report it, peaks); the first match wins.
PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"GH200", _HOPPER_SXM),
    (r"H200 NVL", _HOPPER_NVL),
    (r"H200", _HOPPER_SXM),
    (r"H100 NVL", _HOPPER_NVL),
    (r"H100 PCIe", {"fp32": 51 * T, "tf32": 378 * T, "bf16": 756.5 * T, "fp16": 756.5 * T, "fp8": 1513 * T}),
    (r"H100", _HOPPER_SXM),  # "NVIDIA H100 80GB HBM3": the SXM module
    (r"B200", {"fp32": 75 * T, "tf32": 1125 * T, "bf16": 2250 * T, "fp16": 2250 * T, "fp8": 4500 * T}),
    (r"A100", _A100),
    (r"\bA10\b", {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T, "fp16": 125 * T}),
    (r"L40S", {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 366.5 * T, "fp16": 366.5 * T, "fp8": 733 * T}),
    (r"\bL40\b", {"fp32": 90.5 * T, "tf32": 90.5 * T, "bf16": 181 * T, "fp16": 181 * T, "fp8": 362 * T}),
    (r"\bL4\b", {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T, "fp8": 242.5 * T}),
    (r"V100S", {"fp32": 16.4 * T, "fp16": 130 * T}),
    (r"V100.*PCIE", {"fp32": 14 * T, "fp16": 112 * T}),
    (r"V100", {"fp32": 15.7 * T, "fp16": 125 * T}),
    (r"\bT4\b", {"fp32": 8.1 * T, "fp16": 65 * T}),
)
_COMPILED = tuple((re.compile(p, re.IGNORECASE), peaks) for p, peaks in PEAKS)


def peak_flops(device_name: str | None, dtype: str | None) -> float | None:
    """Dense peak FLOP/s of ``device_name`` for ``dtype`` (``bf16``, ``fp16``,
    ``tf32``, ``fp32``, ``fp8``), or None when the table does not know it."""
    if not device_name or not dtype:
        return None
    for pattern, peaks in _COMPILED:
        if pattern.search(device_name):
            return peaks.get(dtype)
    return None
