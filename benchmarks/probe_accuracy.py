#!/usr/bin/env python3
"""Probe accuracy and repeatability, against references measured in the same run.

1. storage vs fio (Debian fio) on the same file, size, block size, O_DIRECT and queue depth:
   * sequential read: fio rw=read bs=1M direct=1 ioengine=psync numjobs=1 time_based (looping over the
     file for the probe's seq_seconds) vs the probe's seq_read_mean_gbps (bytes over the window: fio's
     definition; the verdict) and its headline seq_read_gbps (median 32 MiB segment, printed beside);
   * random read: fio rw=randread bs=4k direct=1 ioengine=psync numjobs=QD (QD processes, each with one
     blocking read in flight: the probe's own concurrency model) time_based, vs rand_read_iops and
     p50/p99 latency; fio io_uring iodepth=QD is printed for information (another concurrency model);
   * sequential write (informational): fio rw=write bs=1M direct=1 end_fsync=1 overwriting the laid-out
     file vs seq_write_gbps (the probe writes, i.e. extends, its own fresh file: not the same operation).
   Runs are interleaved (fio, probe, fio, probe, ...) and medians compared; target ratio 0.9-1.1.
2. collective (gloo, 2 local processes) vs a plain torch.distributed all_reduce loop written here, same
   sizes and iterations, interleaved with alternating order; target ratio 0.9-1.1 for algbw at each size.
   A second plain run per round (and a second fio random-read run) gives the A/A noise floor: on a
   busy machine the probe cannot be shown closer to the reference than the reference is to itself.
3. repeatability: N back-to-back runs of storage and host with their defaults; coefficient of variation
   of the headline metrics (target < 5 %). Each storage run is followed by fio measuring the same
   things on the same disk (seq read for seq_seconds, randread numjobs=QD for rand_seconds), so the
   device's own run-to-run drift is printed next to the probe's.
Prints JSON with --json. Every part is bounded; flags shorten it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

from gpuagent.probes.runner import run_probe
from gpuagent.probes.storage import SPEC as STORAGE_SPEC


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def cv(xs):
    return 100.0 * statistics.pstdev(xs) / statistics.mean(xs) if len(xs) > 1 and statistics.mean(xs) else float("nan")


# ---------------------------------------------------------------- storage vs fio

def fio(args: list[str]) -> dict:
    out = subprocess.run(["fio", "--output-format=json", *args], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed: {out.stderr.strip()[-300:]}")
    text = out.stdout[out.stdout.index("{"):]
    return json.loads(text)["jobs"][0]


def _fio_psync(path: str, size_mib: int) -> list[str]:
    """The file, size, O_DIRECT and engine every psync fio job here shares with the probe."""
    return [f"--filename={path}", f"--size={size_mib}M", "--direct=1", "--ioengine=psync"]


def fio_layout(path: str, size_mib: int) -> None:
    fio(["--name=layout", "--rw=write", "--bs=1M", "--end_fsync=1", *_fio_psync(path, size_mib)])


def fio_seq_read_gbps(path: str, size_mib: int, seq_s: float) -> float:
    r = fio(["--name=seqread", "--rw=read", "--bs=1M", "--numjobs=1", "--time_based", f"--runtime={seq_s}",
             *_fio_psync(path, size_mib)])
    return r["read"]["bw_bytes"] / 1e9


def fio_rand_read(path: str, size_mib: int, qd: int, rand_s: float, name: str = "randread"
                  ) -> tuple[float, float, float]:
    """(IOPS, p50 us, p99 us) of QD psync processes, each with one 4 KiB read in flight: the probe's model."""
    rr = fio([f"--name={name}", "--rw=randread", "--bs=4k", f"--numjobs={qd}", "--group_reporting",
              "--time_based", f"--runtime={rand_s}", "--norandommap", "--randrepeat=0", *_fio_psync(path, size_mib)])
    pct = rr["read"]["clat_ns"]["percentile"]
    return rr["read"]["iops"], pct["50.000000"] / 1e3, pct["99.000000"] / 1e3


def probe_metrics(name: str, params: dict) -> dict[str, float]:
    """One run of the probe; anything but ok stops the benchmark with its reason."""
    r = run_probe(name, params)
    if r.status != "ok":
        raise RuntimeError(f"{name} probe: {r.status}: {r.reason}")
    return r.metrics


def storage_vs_fio(directory: str, size_mib: int, qd: int, rand_s: float, seq_s: float, rounds: int) -> dict:
    path = os.path.join(directory, f"gpuagent-accuracy-{os.getpid()}.dat")
    common = _fio_psync(path, size_mib)
    res: dict = {"fio_seq_read_gbps": [], "probe_seq_read_gbps": [], "probe_seq_read_median_gbps": [],
                 "fio_rand_read_iops": [],
                 "probe_rand_read_iops": [], "fio_rand_p50_us": [], "probe_rand_p50_us": [],
                 "fio_rand_p99_us": [], "probe_rand_p99_us": [], "fio_iouring_iops": [],
                 "fio_seq_write_gbps": [], "probe_seq_write_gbps": [],
                 "fio_rand_read_iops_again": []}
    try:
        for _ in range(rounds):
            if not os.path.exists(path):  # lay the file out once, flushed, so no writeback lands in a timed run
                fio_layout(path, size_mib)
                os.sync()
            w = fio(["--name=seqwrite", "--rw=write", "--bs=1M", "--end_fsync=1", *common])
            res["fio_seq_write_gbps"].append(w["write"]["bw_bytes"] / 1e9)
            res["fio_seq_read_gbps"].append(fio_seq_read_gbps(path, size_mib, seq_s))
            pm = probe_metrics("storage", {"file": path, "size_mib": size_mib, "queue_depth": qd,
                                           "rand_seconds": rand_s, "seq_seconds": seq_s})
            res["probe_seq_read_gbps"].append(pm["seq_read_mean_gbps"])
            res["probe_seq_read_median_gbps"].append(pm["seq_read_gbps"])
            res["probe_rand_read_iops"].append(pm["rand_read_iops"])
            res["probe_rand_p50_us"].append(pm["rand_read_p50_latency_us"])
            res["probe_rand_p99_us"].append(pm["rand_read_p99_latency_us"])
            iops, p50, p99 = fio_rand_read(path, size_mib, qd, rand_s)
            res["fio_rand_read_iops"].append(iops)
            res["fio_rand_p50_us"].append(p50)
            res["fio_rand_p99_us"].append(p99)
            ur = fio(["--name=uring", "--rw=randread", "--bs=4k", "--ioengine=io_uring", f"--iodepth={qd}",
                      "--time_based", f"--runtime={rand_s}", "--norandommap", "--randrepeat=0",
                      f"--filename={path}", f"--size={size_mib}M", "--direct=1"])
            res["fio_iouring_iops"].append(ur["read"]["iops"])
            res["fio_rand_read_iops_again"].append(fio_rand_read(path, size_mib, qd, rand_s, "randread2")[0])
            # the probe's own write path, on a fresh file in the same directory
            pw = run_probe("storage", {"path": directory, "size_mib": size_mib, "queue_depth": qd,
                                       "rand_seconds": 0.2, "seq_seconds": 0.2})
            if pw.status == "ok":
                res["probe_seq_write_gbps"].append(pw.metrics["seq_write_gbps"])
    finally:
        if os.path.exists(path):
            os.unlink(path)
    m = {k: med(v) for k, v in res.items()}

    def paired(a: str, b: str) -> float:  # median of per-round ratios: robust to drift between rounds
        return med([x / y for x, y in zip(res[a], res[b]) if y])
    return {
        "medians": m, "runs": res,
        "paired_ratio_seq_read": paired("probe_seq_read_gbps", "fio_seq_read_gbps"),
        "paired_ratio_rand_read_iops": paired("probe_rand_read_iops", "fio_rand_read_iops"),
        "noise_floor_paired_ratio_rand_iops_fio_vs_fio": paired("fio_rand_read_iops_again", "fio_rand_read_iops"),
        "ratio_seq_read": m["probe_seq_read_gbps"] / m["fio_seq_read_gbps"],
        "ratio_seq_read_headline_median": m["probe_seq_read_median_gbps"] / m["fio_seq_read_gbps"],
        "ratio_rand_read_iops": m["probe_rand_read_iops"] / m["fio_rand_read_iops"],
        "ratio_rand_p50_latency": m["probe_rand_p50_us"] / m["fio_rand_p50_us"],
        "ratio_rand_p99_latency": m["probe_rand_p99_us"] / m["fio_rand_p99_us"],
        "ratio_seq_write_informational": m["probe_seq_write_gbps"] / m["fio_seq_write_gbps"],
        "fio_jobs": f"psync, bs=1M numjobs=1 time_based {seq_s} s (seq), bs=4k numjobs={qd} (rand), direct=1, "
                    f"file {size_mib} MiB in {directory}",
    }


# ---------------------------------------------------------------- collective vs a plain loop

def _plain_worker(rank: int, world: int, port: int, sizes: list[int], iters: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    res = {}
    for n in sizes:
        t = torch.zeros(n // 4)
        for _ in range(warmup):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(el)      # mean over ranks, as the probe and nccl-tests (-a 1) report
        res[str(n)] = n / (el.item() / world / iters) / 1e9
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def plain_allreduce(sizes: list[int], iters: int, warmup: int, world: int = 2) -> dict[str, float]:
    import torch.multiprocessing as mp

    from gpuagent.probes.collective import free_port
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        mp.start_processes(_plain_worker, args=(world, free_port(), sizes, iters, warmup, out), nprocs=world,
                           join=True, start_method="spawn")
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def collective_vs_plain(rounds: int, iters: int) -> dict:
    sizes = [1 << 20, 4 << 20, 16 << 20]
    probe_runs: dict[str, list[float]] = {str(s): [] for s in sizes}
    plain_runs: dict[str, list[float]] = {str(s): [] for s in sizes}
    plain2_runs: dict[str, list[float]] = {str(s): [] for s in sizes}

    def probe_once() -> None:
        p = run_probe("collective", {"backend": "gloo", "nprocs": 2, "min_bytes": sizes[0], "max_bytes": sizes[-1],
                                     "iters": iters, "warmup": 5, "latency_iters": 20})
        if p.status != "ok":
            raise RuntimeError(f"collective probe: {p.status}: {p.reason}")
        for s in sizes:
            probe_runs[str(s)].append(p.metrics[f"algbw_gbps_{s}"])

    def plain_once(into: dict[str, list[float]]) -> None:
        for s, v in plain_allreduce(sizes, iters, 5).items():
            into[s].append(v)

    for i in range(rounds):
        # Alternate who goes first so drift cannot favour one side; a second plain run per round
        # gives the noise floor (plain vs plain, A/A) under the same conditions.
        if i % 2 == 0:
            probe_once()
            plain_once(plain_runs)
        else:
            plain_once(plain_runs)
            probe_once()
        plain_once(plain2_runs)

    def paired(a: dict[str, list[float]], b: dict[str, list[float]]) -> dict[str, float]:
        return {s: med([x / y for x, y in zip(a[s], b[s])]) for s in a}
    return {"sizes_bytes": sizes, "iters": iters, "rounds": rounds,
            "probe_algbw_gbps": {s: med(v) for s, v in probe_runs.items()},
            "plain_algbw_gbps": {s: med(v) for s, v in plain_runs.items()},
            "ratio_algbw": {s: med(probe_runs[s]) / med(plain_runs[s]) for s in probe_runs},
            "paired_ratio_algbw": paired(probe_runs, plain_runs),
            "noise_floor_paired_ratio_plain_vs_plain": paired(plain2_runs, plain_runs),
            "runs": {"probe": probe_runs, "plain": plain_runs, "plain_again": plain2_runs}}


# ---------------------------------------------------------------- repeatability

HEADLINE = {"storage": ("seq_read_gbps", "seq_read_mean_gbps", "seq_write_gbps", "rand_read_iops", "rand_read_p50_latency_us",
                        "rand_read_p99_latency_us"),
            "host": ("syscall_ns", "clock_gettime_ns", "page_fault_ns", "pipe_roundtrip_us", "memcpy_gbps")}


def _summary(vals: dict[str, list[float]]) -> dict:
    return {k: {"median": med(v), "cv_percent": cv(v), "runs": v} for k, v in vals.items()}


def storage_repeatability(n: int, directory: str, with_fio: bool) -> dict:
    """n back-to-back default storage runs; after each, fio on a laid-out file in the same directory."""
    d = STORAGE_SPEC.defaults
    probe_vals: dict[str, list[float]] = {k: [] for k in HEADLINE["storage"]}
    fio_vals: dict[str, list[float]] = {"seq_read_gbps": [], "rand_read_iops": [], "rand_read_p50_latency_us": []}
    path = os.path.join(directory, f"gpuagent-repeat-{os.getpid()}.dat")
    try:
        if with_fio:
            fio_layout(path, d["size_mib"])
        for _ in range(n):
            pm = probe_metrics("storage", {"path": directory})
            for k in probe_vals:
                probe_vals[k].append(pm[k])
            if with_fio:
                fio_vals["seq_read_gbps"].append(fio_seq_read_gbps(path, d["size_mib"], d["seq_seconds"]))
                iops, p50, _ = fio_rand_read(path, d["size_mib"], d["queue_depth"], d["rand_seconds"])
                fio_vals["rand_read_iops"].append(iops)
                fio_vals["rand_read_p50_latency_us"].append(p50)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    out = {"probe": _summary(probe_vals)}
    if with_fio:
        out["fio_same_disk_same_rounds"] = _summary(fio_vals)
    return out


def host_repeatability(n: int) -> dict:
    vals: dict[str, list[float]] = {k: [] for k in HEADLINE["host"]}
    for _ in range(n):
        pm = probe_metrics("host", {})
        for k in vals:
            vals[k].append(pm[k])
    return {"probe": _summary(vals)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dir", default="/var/tmp", help="directory on the disk to test (default /var/tmp)")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--qd", type=int, default=4)
    ap.add_argument("--rand-seconds", type=float, default=STORAGE_SPEC.defaults["rand_seconds"])
    ap.add_argument("--seq-seconds", type=float, default=STORAGE_SPEC.defaults["seq_seconds"])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds for the fio and gloo comparisons")
    ap.add_argument("--repeats", type=int, default=5, help="back-to-back runs for repeatability")
    ap.add_argument("--coll-iters", type=int, default=20)
    ap.add_argument("--skip", action="append", default=[], choices=["fio", "collective", "repeat"])
    a = ap.parse_args()
    report: dict = {"conditions": {"loadavg_before": os.getloadavg(), "cpus": os.cpu_count(),
                                   "note": "figures are only as quiet as the machine: compare loadavg before/after "
                                           "with the CPU count"}}
    t0 = time.monotonic()
    if "fio" not in a.skip:
        if shutil.which("fio") is None:
            report["storage_vs_fio"] = {"skipped": "fio is not installed (Debian package fio)"}
        else:
            report["storage_vs_fio"] = storage_vs_fio(a.dir, a.size_mib, a.qd, a.rand_seconds, a.seq_seconds,
                                                       a.rounds)
    if "collective" not in a.skip:
        report["collective_vs_plain"] = collective_vs_plain(a.rounds, a.coll_iters)
    if "repeat" not in a.skip:
        has_fio = shutil.which("fio") is not None
        # host first: right after storage the kernel is still discarding and writing back what the disk
        # runs left behind, which showed up as a +20-30 % first host run (page fault, pipe)
        report["repeatability"] = {"host": host_repeatability(a.repeats),
                                   "storage": storage_repeatability(a.repeats, a.dir, has_fio)}
    report["conditions"]["loadavg_after"] = os.getloadavg()
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    if a.json:
        print(json.dumps(report, indent=2, default=float))
        return 0
    s = report.get("storage_vs_fio", {})
    if "medians" in s:
        m = s["medians"]
        print(f"storage vs fio ({s['fio_jobs']}):")
        print(f"  seq read   probe {m['probe_seq_read_gbps']:.3f} GB/s  fio {m['fio_seq_read_gbps']:.3f}  ratio {s['ratio_seq_read']:.3f}"
              f" (paired {s['paired_ratio_seq_read']:.3f}; headline median-of-segments {m['probe_seq_read_median_gbps']:.3f},"
              f" ratio {s['ratio_seq_read_headline_median']:.3f})")
        print(f"  rand IOPS  probe {m['probe_rand_read_iops']:.0f}  fio {m['fio_rand_read_iops']:.0f}  ratio {s['ratio_rand_read_iops']:.3f}"
              f" (paired {s['paired_ratio_rand_read_iops']:.3f})"
              f"  (fio io_uring {m['fio_iouring_iops']:.0f}; fio-vs-fio paired {s['noise_floor_paired_ratio_rand_iops_fio_vs_fio']:.3f})")
        print(f"  p50/p99 us probe {m['probe_rand_p50_us']:.1f}/{m['probe_rand_p99_us']:.1f}  fio {m['fio_rand_p50_us']:.1f}/{m['fio_rand_p99_us']:.1f}")
        print(f"  seq write  probe {m['probe_seq_write_gbps']:.3f} GB/s  fio {m['fio_seq_write_gbps']:.3f}  ratio {s['ratio_seq_write_informational']:.3f}")
    c = report.get("collective_vs_plain")
    if c:
        print("gloo all-reduce algbw, probe vs plain loop: " + ", ".join(
            f"{int(k) >> 20} MiB {c['probe_algbw_gbps'][k]:.3f}/{c['plain_algbw_gbps'][k]:.3f} = {c['ratio_algbw'][k]:.3f}"
            f" (paired {c['paired_ratio_algbw'][k]:.3f}, plain-vs-plain {c['noise_floor_paired_ratio_plain_vs_plain'][k]:.3f})"
            for k in c["ratio_algbw"]))
    for name, part in report.get("repeatability", {}).items():
        if "skipped" in part:
            print(f"{name}: skipped: {part['skipped']}")
            continue
        for who, metrics in part.items():
            print(f"{name} {who} x{a.repeats}: " + ", ".join(
                f"{k} {v['median']:.4g} (cv {v['cv_percent']:.1f} %)" for k, v in metrics.items()))
    print(f"conditions: {report['conditions']}, {report['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
