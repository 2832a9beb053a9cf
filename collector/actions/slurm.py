"""The Slurm side of the actions: ``scontrol`` with a timeout, one call per question or change.

A call never raises: it answers a ``Result`` (ok, output, one-sentence error, seconds taken). A hanging
scontrol is killed with its process group at the timeout.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass

_STATE = re.compile(r"(?:^|\s)State=(\S+)")
# Reason=<text> [<user>@<time>]: the text may hold spaces; Slurm stamps who set it and when.
_REASON = re.compile(r"(?:^|\s)Reason=(.*?)\s\[([^\]@]*)@([^\]]*)\](?:\s|$)")
_REASON_BARE = re.compile(r"(?:^|\s)Reason=(.*?)(?:\s+\w+=|$)")


@dataclass(frozen=True)
class Result:
    ok: bool
    out: str
    error: str           # one sentence when not ok
    seconds: float
    command: str


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str           # e.g. IDLE, IDLE+DRAIN, MIXED+DRAIN, DOWN+DRAIN+NOT_RESPONDING
    reason: str          # "" when none
    reason_user: str
    reason_time: str

    @property
    def flags(self) -> set[str]:
        return set(self.state.upper().replace("*", "").split("+"))

    @property
    def drained(self) -> bool:
        """Drained or draining, by anyone."""
        return bool({"DRAIN", "DRAINED", "DRAINING"} & self.flags)


def parse_show_node(line: str) -> NodeState | None:
    """One line of ``scontrol show node -o NAME``; None when it is no node."""
    name = re.search(r"(?:^|\s)NodeName=(\S+)", line)
    state = _STATE.search(line)
    if not name or not state:
        return None
    m = _REASON.search(line)
    if m:
        reason, user, when = m.group(1).strip(), m.group(2), m.group(3)
    else:
        bare = _REASON_BARE.search(line)
        reason, user, when = (bare.group(1).strip() if bare else ""), "", ""
    if reason == "(null)":
        reason = ""
    return NodeState(name.group(1), state.group(1), reason, user, when)


class Scontrol:
    """``scontrol`` at ``path``, each call bounded by ``timeout_s``; ``env`` for SLURM_CONF and the like."""

    def __init__(self, path: str = "scontrol", timeout_s: float = 10.0, env: dict[str, str] | None = None):
        self.path = path
        self.timeout_s = timeout_s
        self.env = env

    def command(self, *args: str) -> str:
        return shlex.join([self.path, *args])

    def run(self, *args: str) -> Result:
        cmd = [self.path, *args]
        text = shlex.join(cmd)
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                    text=True, env=self.env, start_new_session=True)
        except OSError as exc:
            return Result(False, "", f"cannot run {self.path}: {exc.strerror or exc}", time.monotonic() - t0, text)
        try:
            out, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.communicate()
            return Result(False, "", f"{self.path} did not answer within {self.timeout_s:g} s and was killed",
                          time.monotonic() - t0, text)
        seconds = time.monotonic() - t0
        if proc.returncode != 0:
            why = (err or out).strip().splitlines()
            return Result(False, out, f"{self.path} exited {proc.returncode}: {why[0] if why else 'no message'}",
                          seconds, text)
        return Result(True, out, "", seconds, text)

    def show_node(self, name: str) -> tuple[Result, NodeState | None]:
        res = self.run("show", "node", "-o", name)
        node = None
        if res.ok:
            for line in res.out.splitlines():
                node = parse_show_node(line)
                if node is not None:
                    break
        return res, node

    @staticmethod
    def drain_args(name: str, reason: str) -> tuple[str, ...]:
        return ("update", f"NodeName={name}", "State=DRAIN", f"Reason={reason}")

    @staticmethod
    def resume_args(name: str) -> tuple[str, ...]:
        return ("update", f"NodeName={name}", "State=RESUME")
