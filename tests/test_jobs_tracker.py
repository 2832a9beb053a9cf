"""The opt-in tracker (gpuagent.jobs) and its agent-side receiver over real Unix datagram sockets."""

from __future__ import annotations

import os
import socket
import stat
import struct
import time

import pytest

from gpuagent.common.job_identity import cgroup_ids, job_identity, parent_pid
from gpuagent.agent.samplers.job_steps import JobSocketError, JobStepReceiver, aggregate
from gpuagent.agent.samplers.sampling import ListSink
from gpuagent.jobs import track, wire, wrap_optimizer
from tests.conftest import wait_for


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "agent" / "jobs.sock")


@pytest.fixture
def receiver(sock_path):
    r = JobStepReceiver(sock_path, window_s=60.0).start()
    yield r
    r.close()


# ---------------------------------------------------------------- identity (shared with discovery)

def test_identity_precedence():
    base = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}
    assert job_identity(dict(base, SLURM_JOB_ID="77", TORCHELASTIC_RUN_ID="abc"), 5).job_id == "slurm:77"
    ident = job_identity(dict(base, TORCHELASTIC_RUN_ID="abc"), 5)
    assert (ident.job_id, ident.source, ident.rank, ident.local_rank, ident.world_size) == \
        ("torchelastic:abc", "torchelastic", 3, 1, 8)
    # torchrun's default run id "none" is not unique: the elastic agent (parent) is.
    assert job_identity(dict(base, TORCHELASTIC_RUN_ID="none"), 5, ppid=42).job_id == "torchelastic:none-42"
    assert job_identity({"GPUAGENT_JOB_ID": "mine", "SLURM_JOB_ID": "1"}, 5).job_id == "mine"
    assert job_identity({"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "8", "SLURM_ARRAY_TASK_ID": "2",
                         "SLURM_PROCID": "4"}, 5).job_id == "slurm:8_2"
    assert job_identity({"SLURM_JOB_ID": "9", "SLURM_PROCID": "4"}, 5).rank == 4
    plain = job_identity({"RANK": "x"}, 5)
    assert (plain.job_id, plain.rank, plain.world_size) == ("pid:5", -1, 0)


def test_identity_from_cgroup():
    k8s = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_aaaa_bbbb_cccc_123456789abc.slice/cri-containerd-" + "f" * 64 + ".scope\n"
    assert cgroup_ids(k8s) == ("1b2c3d4e-aaaa-bbbb-cccc-123456789abc", "f" * 12)
    assert job_identity({}, 5, cgroup_text=k8s).job_id == "k8s:1b2c3d4e-aaaa-bbbb-cccc-123456789abc"
    docker = "0::/system.slice/docker-" + "0123456789ab" * 5 + "0123.scope\n"
    assert job_identity({}, 5, cgroup_text=docker).job_id == "container:0123456789ab"
    # The agent's own container is not a job boundary.
    assert job_identity({}, 5, cgroup_text=docker, ignore_container="0123456789ab").job_id == "pid:5"
    assert cgroup_ids("0::/\n4:memory:/process_api/feb6db5bb4e81a8229c1266041573559\n") == ("", "")


def test_parent_pid_parses_names_with_spaces_and_parens():
    assert parent_pid("123 (my (odd) name) S 77 123 123 0") == 77
    assert parent_pid("garbage") == 0


# ---------------------------------------------------------------- tracker without an agent

def test_no_agent_no_exception_bounded_cost(tmp_path):
    t = track(name="lonely", samples_per_step=4, socket_path=str(tmp_path / "nobody" / "jobs.sock"),
              flush_interval_s=0.0, retry_s=3600)
    n = 20000
    # CPU time of this thread: the work a step does, not time spent waiting for a core while other tests
    # load the machine; a step that blocked (a connect retry, a wait) is caught by connect_attempts below.
    start = time.thread_time()
    for _ in range(n):
        t.step()
    elapsed = time.thread_time() - start
    with t.step_context():
        pass
    t.close()
    t.step()   # after close: still silent
    assert t.sent == 0
    assert t.dropped == n + 2
    # Every call flushed, yet only one connect was attempted within the retry interval.
    assert t.connect_attempts == 1
    # Bounded: a generous CPU bound (benchmarks/job_hook.py reports the real figure, about 1-2 us).
    assert elapsed / n < 200e-6, f"{elapsed / n * 1e6:.1f} us per step without an agent"


def test_non_socket_path_is_harmless(tmp_path):
    regular = tmp_path / "not_a_socket"
    regular.write_text("x")
    t = track(socket_path=str(regular), flush_interval_s=0.0, retry_s=3600)
    for _ in range(10):
        t.step()
    assert (t.sent, t.dropped, t.connect_attempts) == (0, 10, 1)


# ---------------------------------------------------------------- tracker -> receiver

def test_steps_arrive_with_identity_and_kernel_pid(receiver, sock_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-xyz")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    t = track(name="unit", samples_per_step=16, tokens_per_step=2048, socket_path=sock_path,
              flush_interval_s=10.0)
    for _ in range(10):
        t.data_ready()
        t.step()
    t.close()
    assert t.sent == 10 and t.dropped == 0
    wait_for(lambda: receiver.records >= 10, timeout=10, what="10 step records received")
    sink = ListSink()
    assert receiver.flush_window(time.time_ns(), sink) == 1
    (row,) = sink.job_steps
    assert row["job_id"] == "torchelastic:run-xyz"
    assert row["job_name"] == "unit"
    assert (row["rank"], row["pid"], row["steps"]) == (1, os.getpid(), 10)
    assert row["samples_per_s"] == pytest.approx(16 * row["steps_per_s"])
    assert row["tokens_per_s"] == pytest.approx(2048 * row["steps_per_s"])
    assert 0.0 <= row["data_wait_fraction"] <= 1.0
    assert row["step_time_p50_s"] <= row["step_time_p95_s"] <= row["step_time_max_s"]
    (live,) = receiver.live()
    assert live["job_id"] == "torchelastic:run-xyz" and live["ranks"] == [1]


def test_ranks_whose_windows_close_in_different_ticks_add_up_in_live(receiver, sock_path, monkeypatch):
    """Each tracker's bye closes its own window; two ranks of one job saying bye in different ticks must show
    as one job of both ranks, not the later rank replacing the earlier (seen on a loaded machine)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-two")
    monkeypatch.setenv("WORLD_SIZE", "2")
    trackers = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        trackers.append(track(name="two", samples_per_step=8, socket_path=sock_path, flush_interval_s=10.0))
    sink = ListSink()
    for n, t in enumerate(trackers, start=1):
        for _ in range(5):
            t.step()
        t.close()
        wait_for(lambda: receiver.records >= 5 * n, timeout=10, what=f"rank {n - 1}'s steps received")
        # Ticks until this rank's bye is in: it is a datagram of its own, after the steps (a clean-clone run,
        # 2026-12-03, ticked once between them; that tick rightly reported nothing). A tick reports only the
        # ranks that said bye, so the two ranks still report in different ticks.
        wait_for(lambda: (receiver.flush_window(time.time_ns(), sink, closed_only=True), len(sink.job_steps))[1] >= n,
                 timeout=10, interval=0.05, what=f"rank {n - 1}'s window, closed by its bye")
    assert [r["rank"] for r in sink.job_steps] == [0, 1]
    (live,) = receiver.live()
    assert live["job_id"] == "torchelastic:run-two" and live["ranks"] == [0, 1]
    rows = {r["rank"]: r for r in sink.job_steps}
    assert live["samples_per_s"] == pytest.approx(rows[0]["samples_per_s"] + rows[1]["samples_per_s"])
    assert live["steps_per_s"] == pytest.approx(max(rows[0]["steps_per_s"], rows[1]["steps_per_s"]))


def test_socket_is_world_writable_and_sender_pid_comes_from_kernel(receiver, sock_path):
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o666
    # A datagram that claims pid 1 is attributed to its real sender (this process).
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.connect(sock_path)
    body = wire.HEADER.pack(wire.MAGIC, wire.KIND_STEPS, 1, 0) + wire.STEPS_BODY.pack(1, 0, 7)
    s.send(body + wire.RECORD.pack(1, time.time_ns(), 5_000_000, -1, 8, 0))
    s.send(b"not a gpuagent datagram")
    s.close()
    wait_for(lambda: receiver.bad_datagrams == 1 and receiver.records == 1, timeout=10,
             what="one good and one bad datagram")
    assert list(receiver.tracked_pids()) == [os.getpid()]
    sink = ListSink()
    receiver.flush_window(time.time_ns(), sink)
    (row,) = sink.job_steps
    assert row["pid"] == os.getpid()
    assert row["data_wait_fraction"] == -1.0   # not measured -> NULL in the collector


def test_tracker_reconnects_after_agent_restart(sock_path):
    r1 = JobStepReceiver(sock_path, window_s=60.0).start()
    t = track(name="restart", socket_path=sock_path, flush_interval_s=0.0, retry_s=0.05)
    t.step()
    wait_for(lambda: r1.records == 1, timeout=10, what="first record")
    r1.close()
    for _ in range(5):
        t.step()          # agent gone: dropped, no exception
    assert t.dropped >= 1
    r2 = JobStepReceiver(sock_path, window_s=60.0).start()
    try:
        def delivered():
            t.step()
            return r2.records
        wait_for(delivered, timeout=10, what="records after the agent restarted")
        sink = ListSink()
        r2.flush_window(time.time_ns(), sink)
        (row,) = sink.job_steps
        assert row["job_name"] == "restart"   # hello was resent on reconnect
    finally:
        t.close()
        r2.close()


def test_receiver_refuses_live_socket_and_non_socket(receiver, sock_path, tmp_path):
    with pytest.raises(JobSocketError, match="already listens"):
        JobStepReceiver(sock_path).start()
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(JobSocketError, match="not a socket"):
        JobStepReceiver(str(plain)).start()


def test_receiver_replaces_stale_socket(tmp_path):
    path = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.close()        # file stays, nobody listens
    r = JobStepReceiver(path).start()
    try:
        # The stale file was replaced by a live socket: a real tracker's steps now reach the receiver.
        t = track(name="after-stale", socket_path=path, flush_interval_s=0.0, retry_s=3600)
        for _ in range(3):
            t.step()
        t.close()
        assert (t.sent, t.dropped) == (3, 0)
        wait_for(lambda: r.records >= 3, timeout=10, what="3 step records on the replaced socket")
    finally:
        r.close()


# ---------------------------------------------------------------- aggregation

def test_aggregate_counts_lost_steps_and_rates():
    ms = 1_000_000
    # steps 1..10, each 10 ms, 4 ms of it data wait; datagram with steps 4-6 lost
    recs = [(i, 1_000 * ms + i * 10 * ms, 10 * ms, 4 * ms, 32, 100) for i in range(1, 11) if i not in (4, 5, 6)]
    agg = aggregate(recs, prev_index=0, prev_t_end_ns=0)
    assert agg["steps"] == 10
    assert agg["window_s"] == pytest.approx(0.1)
    assert agg["steps_per_s"] == pytest.approx(100.0)
    assert agg["samples_per_s"] == pytest.approx(3200.0)
    assert agg["data_wait_fraction"] == pytest.approx(0.4)
    assert agg["step_time_p50_s"] == pytest.approx(0.01)
    # The next window continues from the previous one's last step.
    nxt = [(12, 1_000 * ms + 120 * ms, 10 * ms, -1, 32, 100)]
    agg2 = aggregate(nxt, prev_index=10, prev_t_end_ns=1_000 * ms + 100 * ms)
    assert agg2["steps"] == 2 and agg2["steps_per_s"] == pytest.approx(100.0)
    assert agg2["data_wait_fraction"] == -1.0


def test_wire_rejects_truncated_and_unknown():
    hello = wire.encode_hello(1, 0, 0, 2, 9, "job", "name", "process")
    assert wire.decode(hello)[1]["job_id"] == "job"
    with pytest.raises(wire.WireError, match="truncated"):
        wire.decode(hello[:-2])
    with pytest.raises(wire.WireError, match="unknown datagram kind"):
        wire.decode(wire.HEADER.pack(wire.MAGIC, 9, 0, 0))
    with pytest.raises(wire.WireError, match="does not hold"):
        wire.decode(wire.HEADER.pack(wire.MAGIC, wire.KIND_STEPS, 2, 0) + struct.pack("<iiI", 1, 0, 0))


# ---------------------------------------------------------------- integrations

def test_wrap_optimizer_torch_and_plain(receiver, sock_path):
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    t = wrap_optimizer(opt, name="opt", socket_path=sock_path)
    for _ in range(3):
        p.grad = torch.ones(3)
        opt.step()
    assert t.steps == 3

    class PlainOptimizer:
        calls = 0

        def step(self):
            self.calls += 1
            return "ok"

    plain = PlainOptimizer()
    t2 = wrap_optimizer(plain, name="plain", socket_path=sock_path)
    assert plain.step() == "ok" and plain.calls == 1 and t2.steps == 1
    t.close()
    t2.close()
    wait_for(lambda: receiver.records == 4, timeout=10, what="4 records")


def test_wrap_loader_and_step_context_measure_data_wait(receiver, sock_path):
    t = track(name="ctx", socket_path=sock_path)

    def slow_loader():
        for i in range(6):
            time.sleep(0.02)      # the "input pipeline"
            yield i

    for _ in t.wrap_loader(slow_loader()):
        t.step()
    for _ in range(3):
        time.sleep(0.02)
        with t.step_context():
            pass
    t.close()
    wait_for(lambda: receiver.records == 9, timeout=10, what="9 records")
    sink = ListSink()
    receiver.flush_window(time.time_ns(), sink)
    (row,) = sink.job_steps
    # Nearly all of each step was spent in the sleeping loader.
    assert row["data_wait_fraction"] > 0.8, row


def test_closed_tracker_reported_before_window_ends(receiver, sock_path):
    t = track(name="short", socket_path=sock_path, flush_interval_s=0.0)
    for _ in range(5):
        t.step()
    sink = ListSink()
    wait_for(lambda: receiver.records == 5, timeout=10, what="5 records")
    receiver.sample(time.time_ns(), sink)
    assert sink.job_steps == []          # window (60 s) not over, tracker still open
    t.close()                            # sends bye
    wait_for(lambda: (receiver.sample(time.time_ns(), sink), sink.job_steps)[1], timeout=10,
             what="the closed tracker's last window")
    assert sink.job_steps[0]["steps"] == 5
    assert receiver.tracked_pids() == {}


def test_tracker_and_receiver_import_no_heavy_modules():
    import subprocess
    import sys
    code = ("import sys, gpuagent.jobs, gpuagent.agent.samplers.job_steps\n"
            "heavy = [m for m in ('torch', 'grpc', 'psutil', 'google.protobuf', 'pynvml', 'duckdb', 'numpy')"
            " if m in sys.modules]\n"
            "print(','.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"heavy modules imported: {out.stdout.strip()}"


def test_full_agent_queue_delays_hello_without_backoff(tmp_path):
    path = str(tmp_path / "raw.sock")
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)     # bound, never read until we say
    agent.bind(path)
    agent.setblocking(False)
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.connect(path)
    filler.setblocking(False)
    queued = 0
    try:
        while queued < 10_000:
            filler.send(b"x")
            queued += 1
    except BlockingIOError:
        pass                              # the agent's queue is full now
    t = track(name="patient", socket_path=path, flush_interval_s=0.0, retry_s=3600)
    t.step()
    assert (t.sent, t.dropped, t.connect_attempts) == (0, 1, 1)
    for _ in range(queued):
        agent.recv(64)                    # the agent catches up
    t.step()
    assert (t.sent, t.dropped, t.connect_attempts) == (1, 1, 1)   # no reconnect, no 1-hour backoff
    kinds = [wire.decode(agent.recv(65536))[0] for _ in range(2)]
    assert kinds == ["hello", "steps"]
    t.close()
    agent.close()
    filler.close()


def test_receiver_bounds_the_number_of_trackers(receiver, monkeypatch):
    from gpuagent.agent.samplers import job_steps
    monkeypatch.setattr(job_steps, "_MAX_STREAMS", 3)
    for tracker_id in range(5):       # five "trackers" from one process: the last two are refused
        receiver.receive(wire.encode_hello(os.getpid(), 0, 0, 1, tracker_id, "j", "n", "explicit"), os.getpid())
    assert len(receiver.tracked_pids()) == 1 and receiver.refused_streams == 2
    assert receiver.stream_count() == 3


def _pid_named_receiver(sock_path, scheduler):
    """A receiver whose /proc view names every sender by its pid, asking ``scheduler`` for a better name."""
    from gpuagent.common.job_identity import JobIdentity

    r = JobStepReceiver(sock_path, window_s=60.0,
                        identity=lambda pid: JobIdentity(f"pid:{pid}", "process", "", -1, -1, 0)).start()
    r.scheduler_job = scheduler
    return r


def _steps(t, r, n: int, total: int) -> None:
    """``n`` steps of tracker ``t``, sent, and received by ``r`` (``total`` records so far)."""
    for _ in range(n):
        t.step()
    t.flush()
    wait_for(lambda: r.records >= total, timeout=10, what=f"{total} step records received")


def test_a_tracker_named_only_by_its_pid_waits_for_and_takes_the_schedulers_name(sock_path, monkeypatch):
    """A tracker whose environment names no job (a Slurm job run under env -i): its windows wait while Slurm has
    not been asked about the pid yet, then carry Slurm's id, the id job discovery gives its job_samples; Slurm
    never answering holds them three windows at most; a tracker that named its job keeps its name."""
    from gpuagent.agent.samplers import job_steps
    from gpuagent.agent.schedulers.slurm import PENDING

    for k in ("GPUAGENT_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "RANK"):
        monkeypatch.delenv(k, raising=False)
    answer = {"now": PENDING}
    r = _pid_named_receiver(sock_path, lambda pid: answer["now"])
    t = track(name="", socket_path=sock_path, flush_interval_s=10.0)
    try:
        _steps(t, r, 6, 6)
        sink = ListSink()
        assert r.flush_window(time.time_ns(), sink) == 0, "a window went out under the bare pid"
        answer["now"] = ("slurm:41", "pretrain-7b")
        assert r.flush_window(time.time_ns(), sink) == 1
        (row,) = sink.job_steps
        assert (row["job_id"], row["job_name"], row["steps"]) == ("slurm:41", "pretrain-7b", 6)
        assert r.tracked_pids() == {os.getpid(): "slurm:41"}
    finally:
        t.close()
        r.close()
    # Slurm never answers for it (slurmctld down): the windows wait three times, then go out under the pid.
    r = _pid_named_receiver(sock_path, lambda pid: PENDING)
    t = track(name="", socket_path=sock_path, flush_interval_s=10.0)
    try:
        _steps(t, r, 1, 1)
        sink = ListSink()
        assert [r.flush_window(time.time_ns(), sink) for _ in range(job_steps._PENDING_WINDOWS + 1)] == \
            [0] * job_steps._PENDING_WINDOWS + [1]
        assert sink.job_steps[0]["job_id"] == f"pid:{os.getpid()}"
        _steps(t, r, 1, 2)
        assert r.flush_window(time.time_ns(), sink) == 1      # no more waiting
    finally:
        t.close()
        r.close()
    # A tracker that named its job itself keeps its name, whatever Slurm says of its process.
    monkeypatch.setenv("GPUAGENT_JOB_ID", "my-run")
    r = _pid_named_receiver(sock_path, lambda pid: ("slurm:41", "pretrain-7b"))
    t = track(name="mine", socket_path=sock_path, flush_interval_s=10.0)
    try:
        _steps(t, r, 1, 1)
        sink = ListSink()
        assert r.flush_window(time.time_ns(), sink) == 1
        assert sink.job_steps[0]["job_id"] == "my-run"
    finally:
        t.close()
        r.close()
    monkeypatch.delenv("GPUAGENT_JOB_ID")
    # No scheduler knows the pid: it stays the process's own job, and its windows are not held.
    r = _pid_named_receiver(sock_path, lambda pid: None)
    t = track(name="plain", socket_path=sock_path, flush_interval_s=10.0)
    try:
        _steps(t, r, 1, 1)
        sink = ListSink()
        assert r.flush_window(time.time_ns(), sink) == 1
        assert sink.job_steps[0]["job_id"] == f"pid:{os.getpid()}"
    finally:
        t.close()
        r.close()
