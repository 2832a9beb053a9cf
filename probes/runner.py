"""Run one probe in a subprocess with a timeout, and always come back with a ProbeResult.

The probe runs as ``python -m gpuagent.probes NAME --json`` in its own session (process group), so
torch/CUDA never load in the caller and a timeout can kill the probe together with any workers it
spawned (collective's ranks). Outcomes:
  * the probe printed its JSON object -> that result (ok/skipped/failed, as the probe said);
  * the deadline passed -> SIGTERM to the group, SIGKILL after a grace period, status ``timeout``;
  * no parseable object (crash, OOM kill) -> ``failed`` with the exit code and the end of stderr;
  * ``cancel`` set (agent shutting down) -> the group is killed, ``failed`` with reason "cancelled";
  * the caller interrupted (KeyboardInterrupt) -> SIGTERM to the group, SIGKILL after the grace, re-raised;
  * the subprocess cannot start at all -> ``failed`` with the OS error.
stdout/stderr go to temporary files, not pipes, so a chatty probe can never block on a full pipe.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Mapping

from gpuagent.probes import progress as progress_file
from gpuagent.probes import registry
from gpuagent.probes.result import ProbeResult

TERM_GRACE_S = 3.0


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _terminate(proc: subprocess.Popen, pgid: int) -> None:
    """SIGTERM the probe's group and give it TERM_GRACE_S to unwind through its own cleanup."""
    _kill_group(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        pass


def _tail(f, limit: int = 600) -> str:
    f.seek(0)
    data = f.read().decode("utf-8", "replace").strip()
    return data[-limit:]


def _parse_stdout(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def run_probe(name: str, params: Mapping[str, Any] | None = None, timeout_s: float | None = None, *,
              python: str | None = None,
              progress: Callable[[float, float, tuple[int, int, str] | None], None] | None = None,
              cancel: threading.Event | None = None, env: Mapping[str, str] | None = None,
              poll_s: float = 0.1) -> ProbeResult:
    """Run probe ``name`` with ``params`` (validated here) and return its result; never raises for probe trouble.

    ``progress(elapsed_s, timeout_s, step)`` is called about every ``poll_s`` while it runs (the CLI's bar);
    ``step`` is the probe's last ``(done, total, label)`` from gpuagent.probes.progress, or None yet.
    Raises ``registry.ParamError`` for an unknown probe or parameter (bad input, before anything runs).
    """
    spec = registry.get(name)
    full = registry.parse_params(name, params or {})
    timeout = float(timeout_s if timeout_s is not None else spec.timeout_s)
    cmd = [python or sys.executable, "-m", "gpuagent.probes", name, "--json",
           *registry.params_as_args(full)]
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    child_env.pop(progress_file.ENV, None)
    started = time.time_ns()
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            (tempfile.NamedTemporaryFile(prefix="gpuagent-progress-") if progress else contextlib.nullcontext()) as prog:
        if prog is not None:
            child_env[progress_file.ENV] = prog.name
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    env=child_env, start_new_session=True)
        except OSError as exc:
            return ProbeResult(name, "failed", f"cannot start the probe subprocess {cmd[0]}: {exc.strerror or exc}",
                               params=full, started_ns=started, ended_ns=time.time_ns())
        pgid = proc.pid  # session leader: its pid is the group id
        outcome = "exited"
        try:
            while True:
                try:
                    proc.wait(timeout=poll_s)
                    break
                except subprocess.TimeoutExpired:
                    pass
                elapsed = time.monotonic() - t0
                if progress is not None:
                    progress(elapsed, timeout, progress_file.read_last(prog.name))
                if cancel is not None and cancel.is_set():
                    outcome = "cancelled"
                elif elapsed >= timeout:
                    outcome = "timeout"
                else:
                    continue
                _terminate(proc, pgid)
                break
        except BaseException:
            # Interrupted (Ctrl-C in `gpuagent probe run`): SIGTERM first, so the probe unwinds through its
            # own cleanup (the storage probe removes its test file) before the SIGKILL below.
            if proc.poll() is None:
                _terminate(proc, pgid)
            raise
        finally:
            # Whatever happened, leave no process of the probe's group behind.
            _kill_group(pgid, signal.SIGKILL)
            if proc.poll() is None:
                proc.wait()
        ended = time.time_ns()
        stdout_text = (out.seek(0), out.read().decode("utf-8", "replace"))[1]
        stderr_tail = _tail(err)

    def synthetic(status: str, reason: str) -> ProbeResult:
        return ProbeResult(name, status, reason, params=full, started_ns=started, ended_ns=ended,
                           env={"runner_exit_code": proc.returncode})

    if outcome == "timeout":
        return synthetic("timeout", f"killed after its {timeout:g} s timeout")
    if outcome == "cancelled":
        return synthetic("failed", "cancelled: the agent is stopping")
    obj = _parse_stdout(stdout_text)
    if obj is None:
        why = f"exit code {proc.returncode}" if proc.returncode >= 0 else f"killed by signal {-proc.returncode}"
        detail = f": {stderr_tail.splitlines()[-1]}" if stderr_tail else ""
        return synthetic("failed", f"probe printed no JSON result ({why}){detail}")
    try:
        res = ProbeResult.from_dict(obj)
    except ValueError as exc:
        return synthetic("failed", f"probe printed an invalid result: {exc}")
    if res.probe != name:
        return synthetic("failed", f"probe printed a result for {res.probe!r}, expected {name!r}")
    res.env.setdefault("runner_wall_s", round((ended - started) / 1e9, 3))
    return res
