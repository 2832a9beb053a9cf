"""The on-disk spool and the batcher: exact drop counts, corrupt files set aside, seqs never reused."""

from __future__ import annotations

import os

from gpuagent.agent.pipeline.batcher import Batcher, SeqAllocator
from gpuagent.agent.samplers.sampling import ListSink
from gpuagent.agent.pipeline.spool import HEADER, Spool
from gpuagent.proto import pb


def _batch(seq: int, n: int) -> tuple[bytes, int]:
    b = pb.Batch(seq=seq)
    b.samples.series.add(id=0, metric="load1", gpu=-1)
    b.samples.ts_ns.extend(range(n))
    b.samples.series_id.extend([0] * n)
    b.samples.value.extend([1.5] * n)
    return b.SerializeToString(), n


def test_put_read_ack_and_restart(tmp_path):
    sp = Spool(tmp_path / "spool", max_bytes=1 << 20)
    for seq in (1, 2, 3):
        sp.put(seq, *_batch(seq, 10))
    assert sp.seqs() == [1, 2, 3]
    assert pb.Batch.FromString(sp.read(2)).seq == 2
    assert sp.ack(1) and not sp.ack(1)
    again = Spool(tmp_path / "spool", max_bytes=1 << 20)     # a restart sees what is left
    assert again.seqs() == [2, 3]
    assert again.stats()["backlog_samples"] == 20
    assert again.ack(2) and again.seqs() == [3]


def test_bound_drops_oldest_first_with_exact_counts(tmp_path):
    payload, n = _batch(1, 100)
    rec = HEADER.size + len(payload)
    events = []
    sp = Spool(tmp_path / "spool", max_bytes=rec * 3,
               on_event=lambda k, m, a: events.append((k, a)))
    for seq in range(1, 11):
        sp.put(seq, *_batch(seq, 100))
    assert sp.seqs() == [8, 9, 10]
    assert sp.total_bytes <= sp.max_bytes
    assert sp.counters["dropped_batches"] == 7
    assert sp.counters["dropped_samples"] == 700
    assert [k for k, _ in events].count("spool_dropped") == 7
    assert events[-1][1]["dropped_samples"] == "700"
    # The counters survive a restart (they are persisted, not only in memory).
    again = Spool(tmp_path / "spool", max_bytes=rec * 3)
    assert again.counters["dropped_batches"] == 7 and again.counters["dropped_samples"] == 700
    assert sorted(os.listdir(tmp_path / "spool")) == ["00000000000000000008.batch", "00000000000000000009.batch",
                                                      "00000000000000000010.batch", "counters.json"]


def test_batch_bigger_than_spool_is_counted_not_kept(tmp_path):
    sp = Spool(tmp_path / "spool", max_bytes=200)
    assert not sp.put(1, *_batch(1, 500))
    assert sp.counters["dropped_batches"] == 1 and sp.counters["dropped_samples"] == 500
    assert sp.seqs() == []


def test_corrupt_files_are_set_aside_and_counted(tmp_path):
    d = tmp_path / "spool"
    sp = Spool(d, max_bytes=1 << 20)
    for seq in (1, 2, 3, 4):
        sp.put(seq, *_batch(seq, 5))
    # Flip a payload byte in 2, truncate 3 below the header, and corrupt 4 after the scan.
    p2 = d / "00000000000000000002.batch"
    data = bytearray(p2.read_bytes())
    data[-1] ^= 0xFF
    p2.write_bytes(bytes(data))
    (d / "00000000000000000003.batch").write_bytes(b"GAB1\x00")
    events = []
    again = Spool(d, max_bytes=1 << 20, on_event=lambda k, m, a: events.append((k, m)))
    assert again.seqs() == [1, 4]
    assert again.counters["corrupt_files"] == 2
    assert sorted(p.name.split(".batch")[0] for p in (d / "corrupt").iterdir()) == \
        ["00000000000000000002", "00000000000000000003"]
    assert [k for k, _ in events] == ["spool_corrupt", "spool_corrupt"]
    assert "CRC-32 mismatch" in events[0][1]
    (d / "00000000000000000004.batch").write_bytes(b"garbage that is long enough to have a header.....")
    assert again.read(4) is None                     # read-time corruption: set aside, not raised
    assert again.seqs() == [1] and again.counters["corrupt_files"] == 3
    assert Spool(d, max_bytes=1 << 20).counters["corrupt_files"] == 3


def test_reject_moves_batch_aside(tmp_path):
    sp = Spool(tmp_path / "spool", max_bytes=1 << 20)
    sp.put(7, *_batch(7, 3))
    sp.reject(7, "bad series id")
    assert sp.seqs() == [] and sp.counters["rejected_batches"] == 1 and sp.counters["rejected_samples"] == 3
    assert (tmp_path / "spool" / "rejected" / "00000000000000000007.batch").exists()


def test_seq_allocator_never_reuses(tmp_path):
    a = SeqAllocator(tmp_path)
    assert [a.next() for _ in range(3)] == [1, 2, 3]
    b = SeqAllocator(tmp_path)          # as after SIGKILL: the file already says 3
    assert b.next() == 4
    b.raise_floor(100)
    assert SeqAllocator(tmp_path).next() == 101


def test_batcher_columnar_batches(tmp_path):
    now = [0.0]
    bt = Batcher(SeqAllocator(tmp_path), batch_interval_s=5.0, max_samples=1000, clock=lambda: now[0])
    bt.add("cpu_user_percent", 12.5, labels={"cpu": "0"}, ts_ns=10)
    bt.add("cpu_user_percent", 13.5, labels={"cpu": "1"}, ts_ns=10)
    bt.add("gpu_util_percent", 99, gpu=3, ts_ns=10)
    bt.add("cpu_user_percent", 14.5, labels={"cpu": "0"}, ts_ns=20)
    bt.event("xid", "Xid 79: GPU has fallen off the bus", gpu=3, value=79)
    bt.probe_result({"probe": "host", "status": "ok", "params": {"n": 3}, "metrics": {"syscall_ns": 80.0},
                     "started_at": 1700000000.5, "ended_at": 1700000001.0})
    bt.job_sample(ts_ns=10, job_id="slurm:1", pid=42, rank=0, gpu=3, gpu_util_percent=97.0, unknown_field=1)
    bt.job_step(job_id="slurm:1", rank=0, steps=10, steps_per_s=2.0)
    now[0] = 1.0
    assert not bt.due()
    now[0] = 6.0
    assert bt.due()
    b = bt.cut()
    assert b.seq == 1
    cols = b.samples
    assert len(cols.series) == 3 and list(cols.ts_ns) == [10, 10, 10, 20] and list(cols.series_id) == [0, 1, 2, 0]
    assert list(cols.value) == [12.5, 13.5, 99.0, 14.5]
    assert cols.series[2].gpu == 3 and dict(cols.series[0].labels) == {"cpu": "0"}
    assert b.events[0].kind == "xid" and b.events[0].gpu == 3
    pr = b.probe_results[0]
    assert pr.params["n"] == "3" and pr.metrics["syscall_ns"] == 80.0 and pr.started_ns == 1700000000500000000
    assert b.job_samples[0].job_id == "slurm:1" and b.job_steps[0].steps_per_s == 2.0
    assert bt.cut() is None            # nothing pending
    assert bt.last_probe["host"]["status"] == "ok"


def test_batcher_is_a_sample_sink_like_listsink(tmp_path):
    """The batcher accepts exactly what samplers push into a ListSink (the shared contract)."""
    ls = ListSink()
    bt = Batcher(SeqAllocator(tmp_path))
    for sink in (ls, bt):
        sink.add("load1", 0.5, ts_ns=1)
        sink.add("disk_read_bytes_per_s", 100.0, labels={"device": "vda"}, ts_ns=1)
        sink.event("agent_start", "hi", ts_ns=1)
    b = bt.cut()
    assert len(b.samples.ts_ns) == len(ls.samples) and len(b.events) == len(ls.events)
