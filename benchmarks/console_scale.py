#!/usr/bin/env python3
"""The web console at fleet size (issue 48): a SYNTHETIC fleet of ``--nodes`` (10,000) 8-GPU nodes, an hour of
samples written straight into DuckDB as benchmarks/analysis_scale.py writes them, one real analysis pass (its
rollups, flags and findings), then the real collector serving it with ``--ui-listen``:

* server side: each page (fleet, findings, a later findings page, a pool, a node, a job) fetched ``--repeat``
  (10) times over loopback HTTP with a query token; median and max seconds;
* in the browser: headless Chromium loads the fleet and findings pages ``--repeat`` times; the page's own
  footer script reports Navigation Timing's loadEventEnd (request to load, in the browser), median and max;
* ingest: the same collector takes synthetic batches from benchmarks/ingest.py's workers for ``--duration``
  seconds, alone and while a reader fetches the fleet and findings pages every 5 s, in ``--rounds`` (4) rounds
  whose order swaps each round; the median of the rounds' ratios (goal: within 5 %).
Timings are real; the fleet and its telemetry are synthetic.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import analysis_scale  # noqa: E402
import ingest  # noqa: E402

TOKEN = "console-bench-token"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _get(url: str) -> tuple[float, int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        body = resp.read().decode()
        return time.perf_counter() - t0, resp.status, body


def _stats(xs: list[float]) -> dict:
    return {"median_s": round(statistics.median(xs), 3), "max_s": round(max(xs), 3), "n": len(xs)}


def _browser_load_s(base: str, path: str, profile: Path) -> float:
    res = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                          "--dump-dom", base + path], capture_output=True, text=True, timeout=180)
    m = re.search(r'data-load-ms="(\d+)"', res.stdout)
    if not m:
        raise SystemExit(f"the page {path} did not report its load time: {res.stdout[:300]} {res.stderr[-500:]}")
    return int(m.group(1)) / 1000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of ingest measured per run")
    ap.add_argument("--streams", type=int, default=40)
    ap.add_argument("--batch-samples", type=int, default=5_000)
    ap.add_argument("--keep", default=None, help="keep the built database here (reused when it exists)")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="gpuagent-console-bench-"))
    db = Path(args.keep) if args.keep else work / "fleet.duckdb"
    out: dict = {"benchmark": "console_scale", "synthetic": True, "nodes": args.nodes,
                 "data": "SYNTHETIC fleet rows written into a real collector database; real analysis pass, real "
                         "collector and console, real Chromium"}
    try:
        if not db.exists():
            t0 = time.perf_counter()
            out["build"] = analysis_scale.build(db, args.nodes, 60, 60)
            import duckdb  # noqa: PLC0415
            from gpuagent.collector.analysis.analyzer import analyze_db  # noqa: PLC0415
            con = duckdb.connect(str(db))
            newest = con.execute("SELECT max(ts) FROM samples").fetchone()[0]
            # the jobs table is the ingest path's (the servicer keeps it): from the job rows written directly
            con.execute("""INSERT INTO jobs (node_id, job_id, job_name, source, first_seen, last_seen, duration_s,
                               avg_gpu_util_percent, world_size)
                           SELECT node_id, job_id, 'synthetic-' || job_id, 'synthetic', min(ts), max(ts),
                                  epoch(max(ts) - min(ts)), avg(gpu_util_percent), count(DISTINCT rank)
                           FROM job_samples GROUP BY node_id, job_id""")
            con.close()
            analyze_db(str(db), now=newest + dt.timedelta(seconds=1))   # as of the fleet's newest sample
            out["build"]["analysis_pass_s"] = round(time.perf_counter() - t0 - out["build"]["generate_s"], 1)
        # fleet_cache_s = 0: every request computes its page (the cost the figures below are of)
        proc, log, base, target = _serve(work, db, "nocache", fleet_cache_s=0)
        try:
            from gpuagent.collector.views import client  # noqa: PLC0415
            q = lambda sql: client.query(target, sql, token=TOKEN).rows  # noqa: E731
            node = q("SELECT node_id FROM flags WHERE state = 'open' ORDER BY node_id LIMIT 1")[0][0]
            job = q("SELECT job_id FROM jobs ORDER BY job_id LIMIT 1")[0][0]
            pool = q("SELECT coalesce(pool, '(no pool)') FROM nodes LIMIT 1")[0][0]
            out["open_findings"] = q("SELECT count(*) FROM findings WHERE state = 'open'")[0][0]
            out["open_flags"] = q("SELECT count(*) FROM flags WHERE state = 'open'")[0][0]
            pages = {"fleet": "/", "findings": "/findings", "findings_page_20": "/findings?page=20",
                     "pool": f"/pool/{quote(pool, safe='')}", "node": f"/node/{quote(node, safe='')}",
                     "job": f"/job/{quote(job, safe='')}"}
            server = {}
            for name, path in pages.items():
                times, size = [], 0
                for _ in range(args.repeat):
                    dt_s, code, body = _get(base + path)
                    assert code == 200, (path, code)
                    times.append(dt_s)
                    size = len(body)
                server[name] = {**_stats(times), "bytes": size}
            out["server_side"] = server
            if CHROMIUM:
                profile = work / "profile"
                out["browser"] = {name: _stats([_browser_load_s(base, pages[name], profile) for _ in range(args.repeat)])
                                  for name in ("fleet", "findings")}
            out["pages_under_1_s"] = all(v["median_s"] < 1.0 for v in server.values()) and all(
                v["median_s"] < 1.0 for v in out.get("browser", {}).values())
            # ingest with the console read every 5 s: first the worst case (every read computes its page)...
            out["ingest_console_uncached"] = _ingest(args, work, target, base)
        finally:
            proc.terminate()
            proc.wait(120)
            log.close()
        # ... then as shipped: the fleet page's figures reused for 30 s ([console] fleet_cache_s default)
        proc, log, base, target = _serve(work, db, "default")
        try:
            if CHROMIUM:
                profile = work / "profile-default"
                out["browser_shipped_cache"] = {name: _stats([_browser_load_s(base, path, profile)
                                                              for _ in range(args.repeat)])
                                                for name, path in (("fleet", "/"), ("findings", "/findings"))}
            out["ingest"] = _ingest(args, work, target, base)
        finally:
            proc.terminate()
            proc.wait(120)
            log.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=2) if args.json else
          f"console at {args.nodes} SYNTHETIC nodes: fleet {out['server_side']['fleet']['median_s']} s, findings "
          f"{out['server_side']['findings']['median_s']} s (server, median); ingest ratio with the console read "
          f"every 5 s {out['ingest']['ratio_with_console_to_without']} "
          f"(uncached: {out['ingest_console_uncached']['ratio_with_console_to_without']})")
    return 0


def _serve(work: Path, db: Path, name: str, fleet_cache_s: float | None = None):
    """The real collector on ``db`` with its console: (process, log, console URL, gRPC target).

    The synthetic hour is dated 2026-01-01 (analysis_scale.build): retention would delete it on the first
    maintenance pass, so it keeps everything here, and compaction stays off (only reads and ingest count)."""
    port_file, ui_file, config = work / f"{name}.port", work / f"{name}.ui.port", work / f"{name}.toml"
    config.write_text(("" if fleet_cache_s is None else f"[console]\nfleet_cache_s = {fleet_cache_s}\n")
                      + "[storage]\ncompaction = false\n" + "".join(
                          f'{k}_retention = "3650d"\n' for k in ("raw", "rollup", "probe", "job", "event", "flag",
                                                                   "link")))
    log = open(work / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "gpuagent.collector", "serve", "--listen", "127.0.0.1:0",
                             "--db", str(db), "--port-file", str(port_file), "--no-analyze", "--config", str(config),
                             "--ui-listen", "127.0.0.1:0", "--ui-port-file", str(ui_file)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not ui_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the collector did not start: " + (work / f"{name}.log").read_text()[-2000:])
        time.sleep(0.1)
    return proc, log, f"http://127.0.0.1:{int(ui_file.read_text())}", f"127.0.0.1:{int(port_file.read_text())}"


# Every ingest worker registers nodes of its own (bench-<id>-<k>), with seqs from 1: an id used before, in this
# run or by an earlier one on a kept database, would send batches the collector already holds, which it
# acknowledges as duplicates and does not write (an earlier version of this file measured those as rates).
_WORKER_IDS = itertools.count(int(time.time()) * 1000)


def _ingest(args, work: Path, target: str, base: str) -> dict:
    """Ingest rates alone and with the console read every 5 s, in rounds of one run each, the order swapped
    every round (alone-with, with-alone, ...): the rate falls as the database grows, so each round's ratio
    compares neighbours, and the median of the rounds' ratios is the figure."""
    ns = argparse.Namespace(streams=args.streams, clients=2, batch_samples=args.batch_samples, series=500, window=4)
    alone, with_console, reads = [], [], []
    for rnd in range(args.rounds):
        for console_on in ((False, True) if rnd % 2 == 0 else (True, False)):
            stop = threading.Event()

            def reader():
                while not stop.is_set():
                    for path in ("/", "/findings"):
                        reads.append(_get(base + path)[0])
                    stop.wait(5.0)
            t = threading.Thread(target=reader, daemon=True) if console_on else None
            clients = []
            per = [ns.streams // ns.clients + (1 if i < ns.streams % ns.clients else 0) for i in range(ns.clients)]
            run_s = args.duration + 5
            for i, n in enumerate(per):
                clients.append(subprocess.Popen(
                    [sys.executable, ingest.__file__, "--_worker", "--target", target, "--worker-id",
                     str(next(_WORKER_IDS)), "--streams-here", str(n), "--run-s", str(run_s),
                     "--batch-samples", str(ns.batch_samples), "--series", str(ns.series), "--window", str(ns.window),
                     "--ts-offset-s", "3600"], stdout=subprocess.PIPE, text=True))
            time.sleep(5)
            if t:
                t.start()
            s0, t0 = ingest._committed(target), time.monotonic()
            time.sleep(args.duration)
            s1, t1 = ingest._committed(target), time.monotonic()
            stop.set()
            for c in clients:
                c.communicate(timeout=run_s + 120)
            if t:
                t.join(timeout=60)
            (with_console if console_on else alone).append((s1 - s0) / (t1 - t0))
    a, w = statistics.median(alone), statistics.median(with_console)
    if min(alone + with_console) <= 0:
        raise SystemExit(f"an ingest run committed nothing (alone {alone}, with the console {with_console}): see the "
                         "collector's log")
    ratios = [x / y for x, y in zip(with_console, alone)]
    ratio = statistics.median(ratios)
    return {"samples_per_s_alone": [round(x) for x in alone], "samples_per_s_with_console": [round(x) for x in with_console],
            "median_alone": round(a), "median_with_console": round(w), "ratio_per_round": [round(x, 3) for x in ratios],
            "ratio_with_console_to_without": round(ratio, 3),
            "within_5_percent": ratio >= 0.95, "console_reads": len(reads),
            "console_read_median_s_during_ingest": round(statistics.median(reads), 3) if reads else None,
            "rounds": args.rounds, "streams": args.streams, "batch_samples": args.batch_samples}


if __name__ == "__main__":
    sys.exit(main())
