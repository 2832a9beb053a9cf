"""The values behind the exporter's dcgm-exporter defaults that the tick's other reads do not cover
(docs/EXPORTER.md): memory temperature, the video engines, row remapping, the vGPU license, NVLink bytes with
protocol headers, and under MIG each GPU instance's id, profile name and framebuffer (gpu_mig.py).
"""

from __future__ import annotations

from typing import Any

from gpuagent.common.nvml import Nvml


class GpuDcgmMixin:
    """GpuSampler's reads for dcgm-exporter's defaults (agent/samplers/gpu.py)."""

    nvml: Nvml

    def _dcgm_values(self, i: int, h: Any, ts: int, put, cur: dict[str, Any], got: dict[int, Any] | None) -> None:
        """The values behind dcgm-exporter's default metrics that the tick's other reads do not cover
        (docs/EXPORTER.md): memory temperature, video engines, row remapping, the vGPU license, NVLink
        bytes with protocol headers, and the MIG GPU instances."""
        n = self.nvml
        q = n.query
        if i in n.lost:
            return
        enc = q("nvmlDeviceGetEncoderUtilization", h, gpu=i)       # [percent, sampling period in us]
        put("gpu_encoder_util_percent", enc[0] if enc else None)
        dec = q("nvmlDeviceGetDecoderUtilization", h, gpu=i)
        put("gpu_decoder_util_percent", dec[0] if dec else None)
        rows = q("nvmlDeviceGetRemappedRows", h, gpu=i)     # (correctable, uncorrectable, pending, failure)
        if rows is not None:
            put("gpu_remapped_rows_correctable_total", rows[0])
            put("gpu_remapped_rows_uncorrectable_total", rows[1])
            put("gpu_remapped_rows_pending", rows[2])
            put("gpu_row_remap_failure", rows[3])
        put("gpu_vgpu_license_status", self._vgpu_license(i, h))
        got = got or {}
        if self._fi_mem_temp in got:
            temp = int(got[self._fi_mem_temp].uiVal)
            put("gpu_memory_temperature_celsius", temp if temp <= 200 else None)   # DCGM drops > 200 too
        if self._fi_nvl_raw_tx in got and self._fi_nvl_raw_rx in got:
            self._rate(("nvlink_raw", i), ts / 1e9, int(got[self._fi_nvl_raw_tx].ullVal),
                       int(got[self._fi_nvl_raw_rx].ullVal), 1024.0, "gpu_nvlink_raw_tx_bytes_per_s",
                       "gpu_nvlink_raw_rx_bytes_per_s", put)
        if self._static_values(i, h)["mig"]:
            cur["mig_instances"] = self._mig_instances(i, h, put, cur.get("by_instance", {}))

    def _vgpu_license(self, i: int, h: Any) -> int | None:
        """DCGM's DCGM_FI_DEV_VGPU_LICENSE_STATUS: 1 when the vGPU feature's state is non-zero, 0 when the
        GPU has no GRID licensing (DcgmCacheManager.cpp, DCGM_FI_DEV_VGPU_LICENSE_STATUS)."""
        lic = self.nvml.query("nvmlDeviceGetGridLicensableFeatures_v4", h, gpu=i)
        if lic is None:
            return None
        if not int(lic.isGridLicenseSupported):
            return 0
        vgpu = self.nvml.const("NVML_GRID_LICENSE_FEATURE_CODE_VGPU", 1)
        for k in range(min(int(lic.licensableFeaturesCount), len(lic.gridLicensableFeatures))):
            feat = lic.gridLicensableFeatures[k]
            if int(feat.featureCode) == vgpu:
                return 1 if int(feat.featureState) > 0 else 0
        return None
