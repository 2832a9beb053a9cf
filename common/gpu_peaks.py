"""Dense BF16 tensor-core peak per GPU model: the denominator of model FLOPs utilization (MFU).

Dense means without 2:4 structured sparsity. NVIDIA's datasheets print the sparse figure with an
asterisk ("* With sparsity"; dense is half of it); the figures here are the dense ones. Sources:

- H100 SXM5 and H200 SXM: NVIDIA H100 / H200 Tensor Core GPU datasheets, BF16 Tensor Core
  1,979 TFLOPS with sparsity; the Hopper architecture whitepaper's table gives the dense figure as
  989.4 TFLOPS (H200 is the same GH100 compute with more HBM).
- H100 PCIe: H100 datasheet, BF16 1,513 TFLOPS with sparsity -> 756.5 dense.
- A100 (SXM4 and PCIe, 40 and 80 GB): A100 datasheet, BF16 Tensor Core 312 TFLOPS (624 sparse).
- L40S: L40S datasheet, BF16 Tensor Core 362.05 TFLOPS (733 sparse).
- B200 (HGX, 1,000 W): HGX B200 datasheet, FP16/BF16 Tensor Core 4.5 PFLOPS per GPU with sparsity
  -> 2,250 dense.

A model not in the table has no peak: MFU is then not computed (never guessed).
"""

from __future__ import annotations

# (substring of the NVML device name, lower case; must not match): model, dense BF16 TFLOPS.
# Order matters: the first rule whose substrings all match and whose exclusions do not wins.
_TABLE: tuple[tuple[tuple[str, ...], tuple[str, ...], str, float], ...] = (
    (("h200",), ("nvl",), "H200 SXM", 989.4),
    (("h100", "pcie"), (), "H100 PCIe", 756.5),
    (("h100",), ("nvl", "pcie"), "H100 SXM", 989.4),
    (("a100",), (), "A100", 312.0),
    (("l40s",), (), "L40S", 362.05),
    (("b200",), (), "B200", 2250.0),
)


def dense_bf16_peak(device_name: str) -> tuple[str, float] | None:
    """(model, dense BF16 TFLOPS) for an NVML device name such as "NVIDIA H100 80GB HBM3"; None
    when the model is not in the table (H100 NVL, H200 NVL and older GPUs are not)."""
    name = (device_name or "").lower()
    for need, avoid, model, tflops in _TABLE:
        if all(s in name for s in need) and not any(s in name for s in avoid):
            return model, tflops
    return None
