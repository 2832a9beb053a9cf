"""CUDA path of the tracker: data wait from CUDA events, without device syncs. Needs a GPU."""

from __future__ import annotations

import time

import pytest

from gpuagent.agent.samplers.job_steps import JobStepReceiver
from gpuagent.agent.samplers.sampling import ListSink
from gpuagent.jobs import track
from tests.conftest import wait_for

pytestmark = pytest.mark.gpu


def test_step_does_not_synchronize_the_device(tmp_path):
    """step() returns while GPU work queued before it is still running: it never waits for the device."""
    torch = pytest.importorskip("torch")
    big = torch.randn(8192, 8192, device="cuda")     # one fp32 product: ~1.1 TFLOP, >= ~15 ms on any GPU
    torch.cuda.synchronize()
    t = track(name="nosync", socket_path=str(tmp_path / "nobody.sock"), cuda=True)
    stream = torch.cuda.current_stream()
    busy_after_step = []
    call_s = []
    for _ in range(6):
        t.data_ready()
        big @ big
        start = time.perf_counter()
        t.step()
        call_s.append(time.perf_counter() - start)
        busy_after_step.append(not stream.query())  # still running: step() did not wait for it
        torch.cuda.synchronize()                     # outside step(): start the next one idle
    assert t.using_cuda_events
    assert sum(busy_after_step) >= 5, busy_after_step
    assert sorted(call_s)[len(call_s) // 2] < 0.002, call_s
    t.close()
    assert t.steps == 6


def test_cuda_events_split_data_wait(tmp_path):
    torch = pytest.importorskip("torch")
    path = str(tmp_path / "jobs.sock")
    receiver = JobStepReceiver(path, window_s=60).start()
    try:
        # 4 fp32 2048^3 products per step: ~70 GFLOP, a few ms on a datacenter GPU (< 10 ms even on a T4),
        # far less than the 30 ms the slow input pipeline leaves the GPU idle on odd steps.
        a = torch.randn(2048, 2048, device="cuda")
        a @ a
        torch.cuda.synchronize()
        t = track(name="cuda", socket_path=path)
        for i in range(20):
            time.sleep(0.03 if i % 2 else 0.0)      # a slow input pipeline on odd steps
            t.data_ready()
            for _ in range(4):
                a = (a @ a).clamp_(-1, 1)            # GPU work queued asynchronously
            t.step()
        assert t.using_cuda_events
        t.close()
        wait_for(lambda: receiver.records == 20, timeout=30, what="20 CUDA step records")
        sink = ListSink()
        receiver.flush_window(time.time_ns(), sink)
        (row,) = sink.job_steps
        # Per pair of steps the host spends ~30 ms, the GPU works < 20 ms of it and waits for data the
        # rest: GPU-idle data wait is well over a third of the step time (about 0.9 on an H100/H200).
        assert 0.35 < row["data_wait_fraction"] <= 1.0, row
        assert row["steps"] == 20
    finally:
        receiver.close()
