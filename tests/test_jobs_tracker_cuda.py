"""CUDA path of the tracker: data wait from CUDA events, without device syncs. Needs a GPU."""

from __future__ import annotations

import time

import pytest

from gpuagent.agent.job_steps import JobStepReceiver
from gpuagent.agent.sampling import ListSink
from gpuagent.jobs import track
from tests.conftest import wait_for

pytestmark = pytest.mark.gpu


def test_cuda_events_split_data_wait_without_sync(tmp_path):
    torch = pytest.importorskip("torch")
    path = str(tmp_path / "jobs.sock")
    receiver = JobStepReceiver(path, window_s=60).start()
    try:
        a = torch.randn(4096, 4096, device="cuda")
        torch.cuda.synchronize()
        t = track(name="cuda", socket_path=path)
        step_call_s = []
        for i in range(20):
            time.sleep(0.03 if i % 2 else 0.0)      # a slow input pipeline on odd steps
            t.data_ready()
            for _ in range(4):
                a = (a @ a).clamp_(-1, 1)            # GPU work queued asynchronously
            start = time.perf_counter()
            t.step()
            step_call_s.append(time.perf_counter() - start)
        assert t.using_cuda_events
        # step() returned long before the queued matmuls could finish: no device sync in it.
        assert sorted(step_call_s)[len(step_call_s) // 2] < 0.002
        t.close()
        wait_for(lambda: receiver.records == 20, timeout=30, what="20 CUDA step records")
        sink = ListSink()
        receiver.flush_window(time.time_ns(), sink)
        (row,) = sink.job_steps
        # Half the steps keep the GPU idle ~30 ms waiting for data, the others take ~1 ms: most of the time.
        assert 0.3 < row["data_wait_fraction"] <= 1.0, row
        assert row["steps"] == 20
    finally:
        receiver.close()
