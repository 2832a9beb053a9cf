"""rdma_pair: RDMA write bandwidth and latency between two nodes with perftest's ib_write_bw and ib_write_lat.

It runs only where RDMA can be measured: /sys/class/infiniband lists a device and perftest's
``ib_write_bw`` and ``ib_write_lat`` are on PATH; anywhere else the result is ``skipped`` with the reason
(which of the two is missing), before anything is started. Nothing is emulated: without a device there
is no figure.

Like net_pair, one end listens and the other connects, both with the same settings. Each tool runs
twice, server first: the listening end starts ``ib_write_bw`` as the server (perftest exchanges the
queue-pair details over TCP port ``tcp_port``), the connecting end starts it as the client and retries
until the server answers or ``accept_timeout_s`` passes; then the same with ``ib_write_lat`` on
``tcp_port + 1``. Bandwidth runs ``duration_s`` seconds of ``size``-byte RDMA writes (perftest's -D);
latency ``lat_iters`` writes of ``lat_size`` bytes. Both ends parse the table their tool printed:

  write_gbits_per_s   BW average[Gb/sec] (Gbit/s = 10^9 bit/s, --report_gbits)
  write_peak_gbits_per_s   BW peak[Gb/sec]
  lat_typical_us      t_typical[usec] (perftest's median), lat_avg_us, lat_p99_us (99% percentile[usec])

Manual use (prints JSON)::

    python -m gpuagent.probes.rdma_pair listen
    python -m gpuagent.probes.rdma_pair connect 10.0.0.2
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from gpuagent.probes.registry import ProbeSpec
from gpuagent.probes.result import ProbeResult

NAME = "rdma_pair"
SYSFS = "/sys/class/infiniband"
TOOLS = ("ib_write_bw", "ib_write_lat")

SPEC = ProbeSpec(
    name=NAME,
    description="RDMA write bandwidth and latency to a peer node (perftest ib_write_bw / ib_write_lat)",
    platform="any",
    defaults={"role": "connect", "peer": "", "device": "", "ib_port": 1, "gid_index": -1, "tcp_port": 18515,
              "size": 65536, "duration_s": 3.0, "lat_size": 8, "lat_iters": 1000, "accept_timeout_s": 30.0},
    resources=frozenset({"cpu"}),
    timeout_s=120.0,
    interval_s=3600.0,
    param_help={"role": "connect | listen", "peer": "the listening end's address (connect)",
                "device": "RDMA device (default: the first in /sys/class/infiniband)",
                "gid_index": "perftest -x (RoCE); -1: perftest's own choice",
                "tcp_port": "perftest's TCP port for the exchange; latency uses tcp_port + 1"},
    limits={"ib_port": (1, 255), "gid_index": (-1, 255), "tcp_port": (1, 65534), "size": (2, 1 << 30),
            "duration_s": (1, 600), "lat_size": (2, 1 << 20), "lat_iters": (5, 10**7),
            "accept_timeout_s": (1, 3600)},
)


def devices(sysfs: str = SYSFS) -> list[str]:
    try:
        return sorted(os.listdir(sysfs))
    except OSError:
        return []


def unavailable_reason(sysfs: str = SYSFS, which=shutil.which) -> str:
    """Why RDMA cannot be measured here (one sentence), or "" when it can."""
    devs = devices(sysfs)
    missing = [t for t in TOOLS if which(t) is None]
    if not devs:
        why = f"no RDMA device: {sysfs} is {'empty' if os.path.isdir(sysfs) else 'missing'}"
        if missing:
            why += f", and perftest's {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed"
        return why
    if missing:
        return (f"perftest's {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on PATH "
                f"(RDMA devices: {', '.join(devs)}; the Debian/Ubuntu package is perftest)")
    return ""


def _columns(header: str) -> list[str]:
    """perftest's header line as column names: '#bytes', 'BW average[Gb/sec]', '99% percentile[usec]'...
    (a word without a unit in brackets belongs to the next word)."""
    names, pending = [], ""
    for tok in header.split():
        if tok.startswith("#") or "[" in tok:
            names.append(f"{pending} {tok}".strip())
            pending = ""
        else:
            pending = f"{pending} {tok}".strip()
    return names


def parse_table(text: str, marker: str) -> dict[str, float]:
    """The first result row under the header that contains ``marker``, by column name; {} if none."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if marker not in line:
            continue
        cols = _columns(line)
        for row in lines[i + 1:]:
            parts = row.split()
            if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
                out = {}
                for name, value in zip(cols, parts):
                    try:
                        out[name] = float(value)
                    except ValueError:
                        pass
                return out
    return {}


BW_MARKER, LAT_MARKER = "BW average[Gb/sec]", "t_avg[usec]"


def bw_metrics(text: str) -> dict[str, float]:
    row = parse_table(text, BW_MARKER)
    out = {}
    if "BW average[Gb/sec]" in row:
        out["write_gbits_per_s"] = row["BW average[Gb/sec]"]
    if "BW peak[Gb/sec]" in row:
        out["write_peak_gbits_per_s"] = row["BW peak[Gb/sec]"]
    return out


def lat_metrics(text: str) -> dict[str, float]:
    row = parse_table(text, LAT_MARKER)
    names = {"t_typical[usec]": "lat_typical_us", "t_avg[usec]": "lat_avg_us", "99% percentile[usec]": "lat_p99_us",
             "t_min[usec]": "lat_min_us"}
    return {m: row[c] for c, m in names.items() if c in row}


def _argv(tool: str, p: dict[str, Any], device: str, port: int) -> list[str]:
    argv = [tool, "-d", device, "-i", str(p["ib_port"]), "-p", str(port)]
    if p["gid_index"] >= 0:
        argv += ["-x", str(p["gid_index"])]
    if tool == "ib_write_bw":
        argv += ["-s", str(p["size"]), "-D", f"{p['duration_s']:g}", "--report_gbits"]
    else:
        argv += ["-s", str(p["lat_size"]), "-n", str(p["lat_iters"])]
    if p["role"] == "connect":
        argv.append(p["peer"])
    return argv


def _run_tool(tool: str, p: dict[str, Any], device: str, port: int) -> tuple[str, str]:
    """(stdout, "") or ("", why it failed). The client retries while the server is not up yet."""
    deadline = time.monotonic() + p["accept_timeout_s"]
    budget = p["accept_timeout_s"] + (p["duration_s"] if tool == "ib_write_bw" else 0) + 60
    while True:
        try:
            proc = subprocess.run(_argv(tool, p, device, port), capture_output=True, text=True, timeout=budget)
        except subprocess.TimeoutExpired:
            return "", f"{tool} did not finish within {budget:.0f} s"
        except OSError as exc:
            return "", f"{tool} could not start: {exc.strerror}"
        if proc.returncode == 0:
            return proc.stdout, ""
        if p["role"] == "connect" and time.monotonic() < deadline:
            time.sleep(0.5)          # the server end may not be listening yet
            continue
        last = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        return "", f"{tool} exited with {proc.returncode}: {last[-1] if last else 'no output'}"


def run(params: dict[str, Any]) -> ProbeResult:
    p = dict(params)
    if p.get("role") not in ("connect", "listen"):
        return ProbeResult(NAME, "failed", f"role must be connect or listen, got {p.get('role')!r}", p)
    why = unavailable_reason()
    if why:
        return ProbeResult.skipped(NAME, why, p, {"role": p["role"]})
    if p["role"] == "connect" and not p.get("peer"):
        return ProbeResult(NAME, "failed", "role=connect needs the listening end's address in peer", p)
    devs = devices()
    device = p.get("device") or devs[0]
    if device not in devs:
        return ProbeResult(NAME, "failed", f"RDMA device {device!r} is not in {SYSFS} ({', '.join(devs)})", p)
    started = time.time_ns()
    env = {"role": p["role"], "device": device, "tool": "perftest"}
    metrics: dict[str, float] = {}
    for tool, port, parse in (("ib_write_bw", p["tcp_port"], bw_metrics),
                              ("ib_write_lat", p["tcp_port"] + 1, lat_metrics)):
        out, err = _run_tool(tool, p, device, port)
        if err:
            return ProbeResult(NAME, "failed", err, p, metrics, started, time.time_ns(), env)
        got = parse(out)
        if not got:
            return ProbeResult(NAME, "failed", f"{tool} printed no result table", p, metrics, started,
                               time.time_ns(), env)
        metrics.update(got)
    return ProbeResult(NAME, "ok", "", p, metrics, started, time.time_ns(), env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuagent.probes.rdma_pair",
                                 description="One end of an RDMA pair test (perftest); prints JSON.")
    ap.add_argument("role", choices=("listen", "connect"))
    ap.add_argument("peer", nargs="?", default="", help="the listening end's address (connect)")
    for k, v in SPEC.defaults.items():
        if k not in ("role", "peer"):
            ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    args = vars(ap.parse_args(argv))
    print(run(args).to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
