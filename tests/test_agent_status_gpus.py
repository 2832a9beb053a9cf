"""`gpuagent status` over an in-process Agent whose GPU sampler reads the real pynvml over the NVML
emulator (SYNTHETIC 8-GPU H100 values from tests/data, the `nvml_emulator` fixture): the GPU table, throttle reasons, the
unavailable list, and the Register NodeInfo with 8 GPUs."""

from __future__ import annotations

import json

from gpuagent.agent.config import load_config
from gpuagent.agent.daemon import Agent, build_node_info
from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.agent.samplers.host import HostSampler
from gpuagent.common.nvml import Nvml
from gpuagent.agent.snapshot import STATUS_FILE, StatusError, read_status
from gpuagent.agent.surface.status import render
from nvml_emulator_fixture import H100_8GPU


def test_status_shows_emulated_gpus_with_throttle_reasons(tmp_path, nvml_emulator):
    cfg = load_config(None, env={}, state_dir=str(tmp_path / "state"), collector="127.0.0.1:9",
                      labels={"pool": "synthetic-h100"})
    emu = nvml_emulator(H100_8GPU)
    gpu = GpuSampler(nvml=Nvml())
    samplers = [HostSampler(), gpu]
    agent = Agent(cfg, samplers=samplers, node_info=build_node_info(cfg, samplers))
    try:
        for _ in range(3):
            emu.advance(1.0)
            agent.tick()
        data = read_status(cfg.state_dir)
        raw = json.loads((tmp_path / "state" / "status.json").read_text())
    finally:
        agent.shutdown()
    assert len(agent.node_info.gpus) == 8 and agent.node_info.labels["pool"] == "synthetic-h100"
    gpus = data.gpus
    assert [g.index for g in gpus] == list(range(8))
    fixture = json.loads(H100_8GPU.read_text())["gpus"]
    for g, f in zip(gpus, fixture):
        assert g.name == f["name"]
        # the fixture's values, in the status's units (not merely present)
        assert (g.temperature_celsius, g.memory_total_bytes) == (f["temperature_c"], f["memory_total_bytes"])
        assert g.power_watts == f["power_mw"] / 1000
        util_missing = any(u.startswith(f"GPU {g.index}: nvmlDeviceGetUtilizationRates") for u in data.unavailable)
        assert (g.util_percent is None) == util_missing     # a missing metric is listed, not invented
        assert ("util_percent" in raw["gpus"][g.index]) != util_missing   # left out of the file, not null
    # The fixture has throttle bits set on some GPU: they appear by name, not as a bitmask.
    throttled = [g for g in gpus if g.throttle_reasons]
    assert throttled, "the fixture's throttle bits did not reach the status"
    text = render(data)
    assert "GPUs (8)" in text and fixture[0]["name"][:20] in text
    assert any(r in text for r in throttled[0].throttle_reasons)
    # The file and the snapshot read back from it say the same, key for key (what `status --json` prints).
    assert data.to_json() == raw


def test_status_from_another_version_or_damaged_is_one_sentence(tmp_path):
    import os
    import time

    import pytest
    state = tmp_path / "state"
    cfg = load_config(None, env={}, state_dir=str(state), collector="127.0.0.1:9")
    agent = Agent(cfg, samplers=[HostSampler()], node_info=build_node_info(cfg, []))
    try:
        agent.tick()
        good = json.loads((state / STATUS_FILE).read_text())
    finally:
        agent.shutdown()
    assert good["pid"] == os.getpid() and good["state"] == "running"
    for change, words in (({"version": 2}, f"{state / STATUS_FILE} has status format 2 and this gpuagent reads format 1"),
                          ({"gpus": "none"}, f"{state / STATUS_FILE} is damaged: gpus is not a list"),
                          ({"spool": {"backlog_batches": "many"}}, "is damaged: spool.backlog_batches is 'many', expected int"),
                          ({"node": {}}, "is damaged: node.hostname is missing")):
        (state / STATUS_FILE).write_text(json.dumps({**good, **change, "updated_ns": time.time_ns()}))
        with pytest.raises(StatusError) as ei:
            read_status(state)
        assert words in str(ei.value) and "\n" not in str(ei.value) and str(ei.value).endswith(").")
