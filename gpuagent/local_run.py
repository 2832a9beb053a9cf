"""`make run`: a local collector with a DuckDB file plus this node's agent, showing real data in a minute.

Starts ``gpuagent-collector serve`` (DuckDB file under ./run/, loopback only) and ``gpuagent run``
(state dir under ./run/) as subprocesses, waits until the collector has stored the first samples
from this machine, prints ``gpuagent status`` and a first SQL query through ``gpuagent-collector sql``,
then keeps both running until Ctrl-C (or SIGTERM/SIGHUP) and stops them cleanly (agent first, so its
last batch lands). The collector gets port 7443, the default of every command, when it is free.
``--once`` (or ``GPUAGENT_RUN_ONCE=1``) stops right after showing the numbers; the tests use it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import click


class LocalRunError(Exception):
    pass


DEFAULT_PORT = 7443   # what `gpuagent-collector sql/analyze/...` and the agent use when not told otherwise
DEFAULT_CONSOLE_PORT = 9480   # the web console of `make run` (loopback, no token: docs/CONSOLE.md)


class _Stop(Exception):
    """SIGTERM or SIGHUP (terminal closed): stop both children like Ctrl-C does, leaving no orphans."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_port(requested: int | None, default: int = DEFAULT_PORT) -> int:
    """``requested`` if given (0: any free port); else ``default`` (7443) when free, so the README's commands
    work as written, else a free port."""
    if requested is not None:
        return requested or free_port()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", default))
            return default
        except OSError:
            return free_port()


def _tail(path: Path, n: int = 15, start: int = 0) -> str:
    """The last ``n`` lines of a log, written after byte offset ``start`` (this run's lines only)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            lines = fh.read().decode(errors="replace").splitlines()
        return "\n".join(lines[-n:]) or "(nothing logged)"
    except OSError:
        return "(no log)"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def console_answers(port: int) -> str:
    """Whether the console's fleet page answers now, in a few words (what `make run` prints beside its address)."""
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as resp:
            return f"answers: HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"answers HTTP {exc.code}; see the collector's log"
    except OSError as exc:
        return f"does not answer ({exc}); see the collector's log"


def start_collector(db: Path, port: int, log: Path, extra_env: dict | None = None,
                    ui_port: int | None = None) -> subprocess.Popen:
    """``gpuagent-collector serve`` on 127.0.0.1:port, in its own session (Ctrl-C reaches only us); with
    ``ui_port`` its web console on 127.0.0.1:ui_port."""
    cmd = [sys.executable, "-m", "gpuagent.collector.cli", "serve", "--db", str(db), "--listen", f"127.0.0.1:{port}"]
    if ui_port is not None:
        cmd += ["--ui-listen", f"127.0.0.1:{ui_port}"]
    env = {**os.environ, **(extra_env or {})}
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def start_agent(collector: str, state_dir: Path, log: Path, interval: float = 1.0, batch_interval: float = 2.0,
                extra_env: dict | None = None, extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gpuagent.agent.cli", "run", "--collector", collector, "--state-dir", str(state_dir),
           "--interval", f"{interval:g}", "--batch-interval", f"{batch_interval:g}", *extra_args]
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", **(extra_env or {})}
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60.0, log_start: int = 0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LocalRunError(f"the collector exited with code {proc.returncode}:\n{_tail(log, start=log_start)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise LocalRunError(f"the collector did not listen on 127.0.0.1:{port} within {timeout:.0f} s:\n"
                        f"{_tail(log, start=log_start)}")


def query(address: str, sql: str, timeout: float = 10.0) -> tuple[list[str], list[list]]:
    """Read-only SQL through the live collector's Query RPC (what `gpuagent-collector sql` uses)."""
    import grpc

    from gpuagent.proto import pb, pb_grpc
    from gpuagent.proto.wire import bearer_metadata
    token = os.environ.get("GPUAGENT_TOKEN", "")
    md = bearer_metadata(token) or None
    with grpc.insecure_channel(address) as ch:
        resp = pb_grpc.CollectorStub(ch).Query(pb.QueryRequest(sql=sql), timeout=timeout, metadata=md)
    return list(resp.columns), json.loads(resp.rows_json or "[]")


def wait_samples(address: str, agent: subprocess.Popen, agent_log: Path, timeout: float = 60.0,
                 min_ticks: int = 2, log_start: int = 0) -> int:
    """Wait until the collector holds host samples from at least ``min_ticks`` distinct ticks."""
    import grpc
    deadline = time.monotonic() + timeout
    last = 0
    while time.monotonic() < deadline:
        if agent.poll() is not None:
            raise LocalRunError(f"the agent exited with code {agent.returncode}:\n{_tail(agent_log, start=log_start)}")
        try:
            _, rows = query(address, "SELECT count(DISTINCT ts) FROM samples WHERE gpu IS NULL")
            last = int(rows[0][0]) if rows else 0
            if last >= min_ticks:
                return last
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise LocalRunError(f"no samples stored within {timeout:.0f} s (ticks stored: {last}); agent log:\n"
                        f"{_tail(agent_log, start=log_start)}")


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    return proc.returncode


# Series no rule reads per sample reach `samples` only as summaries each minute (docs/RESOLUTION.md); the
# raw window asked just before holds their 1 s samples so far.
FIRST_SQL = """
SELECT metric, count(*) AS samples, round(min(value), 2) AS min, round(avg(value), 2) AS avg,
       round(max(value), 2) AS max
FROM (SELECT metric, labels, value FROM samples UNION ALL SELECT metric, labels, value FROM raw_windows)
WHERE labels = '' AND metric IN ('cpu_user_percent', 'cpu_system_percent', 'cpu_iowait_percent',
      'cpu_steal_percent', 'load1', 'mem_used_bytes', 'mem_available_bytes', 'context_switches_per_s',
      'psi_cpu_some_avg10_percent', 'gpu_util_percent', 'gpu_power_watts', 'gpu_temperature_celsius')
GROUP BY metric ORDER BY metric
""".strip()

NODE_SQL = ("SELECT hostname, virt_type, virtualized, in_container, container_runtime, cpu_model, gpu_count "
            "FROM nodes")


def _run_cli(args: list[str]) -> int:
    res = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120)
    sys.stdout.write(res.stdout)
    if res.returncode != 0:
        sys.stdout.write(res.stderr)
    sys.stdout.flush()
    return res.returncode


def _on_signal(signum, frame) -> None:
    raise _Stop(signal.Signals(signum).name)


@click.command()
@click.option("--run-dir", default="run", show_default=True, help="Where the DuckDB file, agent state and logs go.")
@click.option("--port", type=int, default=None,
              help="Collector port on 127.0.0.1 (default: 7443 when free, else a free one; 0: a free one).")
@click.option("--interval", type=float, default=1.0, show_default=True, help="Sampling interval, seconds.")
@click.option("--once", is_flag=True, envvar="GPUAGENT_RUN_ONCE",
              help="Stop after showing the first numbers (env GPUAGENT_RUN_ONCE=1).")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="How long to wait for the first samples.")
def main(run_dir: str, port: int | None, interval: float, once: bool, timeout: float) -> None:
    """Run a local collector and this node's agent; show real numbers from this machine."""
    rd = Path(run_dir).resolve()
    rd.mkdir(parents=True, exist_ok=True)
    port = pick_port(port)
    ui_port = pick_port(None, DEFAULT_CONSOLE_PORT)
    address = f"127.0.0.1:{port}"
    db, state = rd / "gpuagent.duckdb", rd / "agent-state"
    clog, alog = rd / "collector.log", rd / "agent.log"
    host = socket.gethostname()
    t0 = time.monotonic()
    click.echo(f"gpuagent local run: collector on {address} (DuckDB {db}), agent on this machine ({host}).")
    click.echo(f"Logs: {clog}, {alog}")
    # SIGTERM, or SIGHUP when the terminal goes away, must stop the children too: they run in their own
    # sessions (so that Ctrl-C reaches only this process) and would otherwise be left running.
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    cstart, astart = _size(clog), _size(alog)
    collector = agent = None
    started = False
    try:
        collector = start_collector(db, port, clog, ui_port=ui_port)
        wait_port(port, collector, clog, log_start=cstart)
        agent = start_agent(address, state, alog, interval=interval, batch_interval=2.0,
                            extra_env={"GPUAGENT_JOBS_SOCKET": str(rd / "jobs.sock")})
        ticks = wait_samples(address, agent, alog, timeout=timeout, log_start=astart)
        # A couple more ticks so rates (which need two readings) and averages have something in them.
        wait_samples(address, agent, alog, timeout=timeout, min_ticks=ticks + 2, log_start=astart)
        started = True
        click.echo(f"\nFirst samples stored after {time.monotonic() - t0:.1f} s. Everything below is REAL data "
                   f"measured on this machine ({host}) by the agent, sent over gRPC and stored in {db}.\n")
        click.echo("$ gpuagent status --state-dir " + str(state))
        _run_cli(["gpuagent.agent.cli", "status", "--state-dir", str(state)])
        click.echo(f"\n$ gpuagent-collector sql --target {address} \"{NODE_SQL}\"")
        _run_cli(["gpuagent.collector.cli", "sql", "--target", address, NODE_SQL])
        node_id = query(address, "SELECT node_id FROM nodes LIMIT 1")[1][0][0]
        click.echo(f"\n$ gpuagent-collector raw-window --target {address} --node {node_id} --last 1m")
        _run_cli(["gpuagent.collector.cli", "raw-window", "--target", address, "--node", node_id, "--last", "1m",
                  "--wait", "20s"])
        click.echo(f"\n$ gpuagent-collector sql --target {address} \"<host metrics so far>\"")
        click.echo(FIRST_SQL)
        _run_cli(["gpuagent.collector.cli", "sql", "--target", address, FIRST_SQL])
        click.echo(f"\nThe web console (fleet, findings, this node, its GPUs and jobs): http://127.0.0.1:{ui_port}/ "
                   f"({console_answers(ui_port)})")
        if once:
            click.echo("\n--once: stopping the agent and the collector.")
            return
        env = (f"export PATH=\"{Path(sys.executable).parent}:$PATH\" GPUAGENT_STATE_DIR={state} "
               f"GPUAGENT_JOBS_SOCKET={rd / 'jobs.sock'}")
        if port != DEFAULT_PORT:
            env += f" GPUAGENT_COLLECTOR={address}"
        click.echo("\nRunning. Ctrl-C stops both. In another shell, this makes the README's commands use this run:\n"
                   f"  {env}\n"
                   "  gpuagent status; gpuagent probe run host; gpuagent-collector analyze\n"
                   "  gpuagent-collector sql \"SELECT metric, count(*) FROM samples GROUP BY 1 ORDER BY 2 DESC LIMIT 10\"")
        while agent.poll() is None and collector.poll() is None:
            time.sleep(0.5)
        raise LocalRunError(f"{'the agent' if agent.poll() is not None else 'the collector'} exited unexpectedly; "
                            f"see {alog if agent.poll() is not None else clog}")
    except KeyboardInterrupt:
        click.echo("\nCtrl-C: stopping the agent, then the collector.")
    except _Stop as exc:
        click.echo(f"\n{exc}: stopping the agent, then the collector.")
    except LocalRunError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        # A second Ctrl-C (or SIGTERM) while the children stop must not leave them behind.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        if agent is not None:
            stop_process(agent)
        if collector is not None:
            stop_process(collector, timeout=30)
        if started:
            click.echo(f"Stopped. The data stays in {db}: `make run` again adds to it, and "
                       f"`{Path(sys.executable).parent / 'duckdb'} -readonly {db}` opens it (SQL as in the README).")


if __name__ == "__main__":
    main()
