"""The step tracker a training script imports: measures each step and tells the local agent.

Cost model (see benchmarks/job_hook.py): ``step()`` reads ``perf_counter_ns`` once, packs one
48-byte record into a preallocated buffer, and only every ``flush_interval_s`` (or every
``wire.MAX_RECORDS`` steps) sends the buffer as one non-blocking Unix datagram. With no agent it
drops the records and tries to connect again at most once per ``retry_s``. It never raises into the
training loop and never logs on the hot path.

On CUDA (torch already imported and CUDA initialised, or ``cuda=True``) it also records two CUDA
events per step on the current stream, one when the batch is ready and one at the step's end, and
reads them back later with ``Event.query()``: the data wait is then the time the GPU sat idle
between the previous step's end and this step's data-ready point. No call here synchronises the
device.

MFU: a script that declares the model FLOPs of one step on this rank (``flops_per_step``), or of one
token (``flops_per_token``, multiplied by the tokens each step reports), lets the agent report model
FLOPs utilization against the GPU's dense BF16 peak (gpuagent.common.gpu_peaks). The declaration
travels once, in the hello; the hot path is unchanged.
"""

from __future__ import annotations

import atexit
import math
import os
import random
import socket
import sys
import time
from collections import deque
from typing import Any, Iterable, Iterator

from gpuagent.common.job_identity import read_own_identity
from gpuagent.jobs import wire

_perf = time.perf_counter_ns
_MSG_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_PREFIX = wire.STEPS_PREFIX
_RSIZE = wire.RECORD.size
_MAX = wire.MAX_RECORDS
_MAX_PENDING_EVENTS = 1024


class Tracker:
    """Per-process step tracker. Create with :func:`track`; call :meth:`step` once per iteration,
    from the training loop's thread (it is not meant to be shared between threads)."""

    def __init__(self, name: str | None = None, samples_per_step: int = 0, tokens_per_step: int = 0,
                 *, socket_path: str | None = None, flush_interval_s: float = 0.1,
                 retry_s: float = 5.0, cuda: bool | None = None, rank: int | None = None,
                 flops_per_step: float = 0.0, flops_per_token: float = 0.0) -> None:
        self.flops_per_step = _flops("flops_per_step", flops_per_step)
        self.flops_per_token = _flops("flops_per_token", flops_per_token)
        ident = read_own_identity()
        self.job_id = ident.job_id
        self.source = ident.source
        self.job_name = name or ident.job_name or os.path.basename(sys.argv[0] or "python")
        self.rank = ident.rank if rank is None else int(rank)
        self.local_rank = ident.local_rank
        self.world_size = ident.world_size
        self.pid = os.getpid()
        self.socket_path = socket_path or wire.socket_path()
        self.samples_per_step = int(samples_per_step)
        self.tokens_per_step = int(tokens_per_step)
        self.steps = 0             # steps measured
        self.sent = 0              # step records handed to the kernel
        self.dropped = 0           # step records not delivered (no agent, or its queue was full)
        self.connect_attempts = 0
        self.using_cuda_events = False
        self._tracker_id = random.getrandbits(32)
        self._cuda_mode = cuda
        self._flush_ns = int(flush_interval_s * 1e9)
        self._retry_ns = int(retry_s * 1e9)
        self._buf = bytearray(wire.MAX_STEPS_BYTES)
        self._view = memoryview(self._buf)
        self._pack = wire.RECORD.pack_into
        wire.STEPS_BODY.pack_into(self._buf, wire.HEADER.size, self.pid, self.rank, self._tracker_id)
        self._n = 0
        self._sock: socket.socket | None = None
        self._hello_pending = False
        self._next_connect = 0
        self._closed = False
        now = _perf()
        self._wall_offset = time.time_ns() - now
        self._last = now
        self._last_flush = now
        self._ready = -1
        # Until the first call, step/data_ready decide between the plain and the CUDA path.
        self.step = self._step_first           # type: ignore[method-assign]
        self.data_ready = self._data_ready_first  # type: ignore[method-assign]
        self._events: list[Any] = []
        self._pending: deque = deque()
        self._ev_ready = None
        self._ev_prev_end = None
        atexit.register(self.close)

    # ------------------------------------------------------------------ public API

    def step(self, samples: int | None = None, tokens: int | None = None) -> None:  # noqa: D401
        """Mark the end of one step (and the start of the next). Replaced per instance at first use."""

    def data_ready(self) -> None:
        """Mark that this step's batch has arrived: time since the last step() was data wait."""

    def step_context(self) -> "_StepContext":
        """``with tracker.step_context(): train(batch)`` — entering marks data ready, leaving ends the step."""
        return _StepContext(self)

    def wrap_loader(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield from ``iterable``, calling :meth:`data_ready` as each batch arrives."""
        for item in iterable:
            self.data_ready()
            yield item

    def flush(self) -> None:
        """Send what is buffered now (also done on close and at interpreter exit)."""
        if self._pending:
            self._drain_events(force=False)
        if self._n:
            self._flush(_perf())

    def close(self) -> None:
        """Flush and close the socket. Safe to call twice; the tracker then drops further steps."""
        if self._closed:
            return
        try:
            if self._pending:
                self._pending[-1][7].synchronize()   # at exit only, never on the hot path
            self.flush()
        except Exception:  # noqa: BLE001 - never raise into the training script
            pass
        self._closed = True
        self._next_connect = 1 << 62
        if self._sock is not None:
            try:
                self._sock.send(wire.encode_bye(self.pid, self.rank, self._tracker_id), _MSG_DONTWAIT)
            except OSError:
                pass
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ hot path (plain)

    def _step_plain(self, samples: int | None = None, tokens: int | None = None) -> None:
        now = _perf()
        last = self._last
        ready = self._ready
        if ready >= 0:
            wait = ready - last
            self._ready = -1
        else:
            wait = -1
        n = self._n
        self.steps += 1
        self._pack(self._buf, _PREFIX + n * _RSIZE, self.steps, self._wall_offset + now, now - last, wait,
                   self.samples_per_step if samples is None else samples,
                   self.tokens_per_step if tokens is None else tokens)
        self._last = now
        self._n = n + 1
        if n + 1 == _MAX or now - self._last_flush >= self._flush_ns:
            self._flush(now)

    def _data_ready_plain(self) -> None:
        self._ready = _perf()

    # ------------------------------------------------------------------ first call: choose a path

    def _choose_path(self) -> None:
        use = False
        if self._cuda_mode is not False:
            torch = sys.modules.get("torch")
            try:
                if torch is None and self._cuda_mode:
                    import torch  # noqa: PLC0415
                if torch is not None and torch.cuda.is_available():
                    use = bool(self._cuda_mode) or torch.cuda.is_initialized()
            except Exception:  # noqa: BLE001 - a broken CUDA setup just means host timing
                use = False
        if use:
            self._torch = torch
            self.using_cuda_events = True
            self.step = self._step_cuda          # type: ignore[method-assign]
            self.data_ready = self._data_ready_cuda  # type: ignore[method-assign]
        else:
            self.step = self._step_plain         # type: ignore[method-assign]
            self.data_ready = self._data_ready_plain  # type: ignore[method-assign]

    def _step_first(self, samples: int | None = None, tokens: int | None = None) -> None:
        self._choose_path()
        self.step(samples, tokens)

    def _data_ready_first(self) -> None:
        self._choose_path()
        self.data_ready()

    # ------------------------------------------------------------------ CUDA path

    def _event(self):
        if self._events:
            return self._events.pop()
        return self._torch.cuda.Event(enable_timing=True)

    def _data_ready_cuda(self) -> None:
        self._ready = _perf()
        if self._ev_ready is None:
            ev = self._event()
            ev.record()
            self._ev_ready = ev

    def _step_cuda(self, samples: int | None = None, tokens: int | None = None) -> None:
        now = _perf()
        end = self._event()
        end.record()
        self.steps += 1
        self._pending.append((self.steps, self._wall_offset + now, now - self._last,
                              self.samples_per_step if samples is None else samples,
                              self.tokens_per_step if tokens is None else tokens,
                              self._ev_prev_end, self._ev_ready, end))
        self._last = now
        self._ready = -1
        self._ev_ready = None
        self._ev_prev_end = end
        self._drain_events(force=len(self._pending) > _MAX_PENDING_EVENTS)
        if self._n and (self._n == _MAX or now - self._last_flush >= self._flush_ns):
            self._flush(now)

    def _drain_events(self, force: bool) -> None:
        """Turn steps whose end event has completed into records; ``force`` drops the oldest one's split."""
        pending = self._pending
        while pending:
            idx, wall, step_ns, samples, tokens, prev_end, ready, end = pending[0]
            if end.query():
                wait = -1
                # elapsed_time raises (cudaErrorNotReady) unless both events completed; they precede
                # `end` on one stream, but a script may switch streams between calls: ask each event.
                if prev_end is not None and ready is not None and prev_end.query() and ready.query():
                    try:
                        wait = int(prev_end.elapsed_time(ready) * 1e6)
                    except Exception:  # noqa: BLE001 - e.g. events on two devices: no split, no raise
                        wait = -1
            elif force:
                wait = -1
                force = False
            else:
                return
            pending.popleft()
            if prev_end is not None:
                self._events.append(prev_end)
            if ready is not None:
                self._events.append(ready)
            n = self._n
            self._pack(self._buf, _PREFIX + n * _RSIZE, idx, wall, step_ns, max(wait, -1), samples, tokens)
            self._n = n + 1
            if n + 1 == _MAX:
                self._flush(_perf())

    # ------------------------------------------------------------------ delivery

    def _flush(self, now: int) -> None:
        n = self._n
        self._n = 0
        self._last_flush = now
        sock = self._sock
        if sock is None:
            sock = self._connect(now)
            if sock is None:
                self.dropped += n
                return
        if self._hello_pending:
            try:
                sock.send(self._hello(), _MSG_DONTWAIT)
                self._hello_pending = False
            except BlockingIOError:
                self.dropped += n        # the agent's queue is full: try the hello again next time
                return
            except OSError:
                self._drop_socket(now)
                self.dropped += n
                return
        wire.HEADER.pack_into(self._buf, 0, wire.MAGIC, wire.KIND_STEPS, n, 0)
        data = self._view[:_PREFIX + n * _RSIZE]
        try:
            sock.send(data, _MSG_DONTWAIT)
            self.sent += n
            return
        except BlockingIOError:
            self.dropped += n        # the agent's queue is full: lose these, never wait
            return
        except OSError:
            self._drop_socket(now)
        # The agent may have restarted on a new socket: one immediate reconnect, then back off.
        sock = self._connect(now)
        if sock is None:
            self.dropped += n
            return
        try:
            sock.send(self._hello(), _MSG_DONTWAIT)
            self._hello_pending = False
            sock.send(data, _MSG_DONTWAIT)
            self.sent += n
        except BlockingIOError:
            self.dropped += n
        except OSError:
            self._drop_socket(now)
            self.dropped += n

    def _drop_socket(self, now: int) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._next_connect = now + self._retry_ns

    def _connect(self, now: int) -> socket.socket | None:
        if now < self._next_connect or self._closed:
            return None
        self.connect_attempts += 1
        sock = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.connect(self.socket_path)
        except OSError:
            if sock is not None:
                sock.close()
            self._next_connect = now + self._retry_ns
            return None
        self._sock = sock
        self._hello_pending = True      # sent before the next steps (a full queue only delays it)
        return sock

    def _hello(self) -> bytes:
        return wire.encode_hello(self.pid, self.rank, self.local_rank, self.world_size, self._tracker_id,
                                 self.job_id, self.job_name, self.source, self.flops_per_step,
                                 self.flops_per_token)


def _flops(name: str, value: Any) -> float:
    """A declared FLOP count (0: none); anything but a finite number >= 0 is refused at setup."""
    try:
        v = float(value or 0)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of FLOPs, not {value!r}") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number of FLOPs >= 0, not {value!r}")
    return v


class _StepContext:
    __slots__ = ("_t",)

    def __init__(self, tracker: Tracker) -> None:
        self._t = tracker

    def __enter__(self) -> Tracker:
        self._t.data_ready()
        return self._t

    def __exit__(self, *exc: object) -> None:
        self._t.step()


def track(name: str | None = None, samples_per_step: int = 0, tokens_per_step: int = 0,
          **options: Any) -> Tracker:
    """Start tracking this process's training steps; see :class:`Tracker` for ``options``.

    ``samples_per_step``/``tokens_per_step`` are what one call of ``step()`` processed on this rank
    (override per call with ``step(samples=..., tokens=...)``). ``flops_per_step=`` (model FLOPs of one
    step on this rank, forward + backward) or ``flops_per_token=`` (e.g. 6 x parameters for a dense
    transformer; needs tokens per step) turn on MFU in ``job_steps`` and ``gpuagent status``.
    """
    return Tracker(name, samples_per_step, tokens_per_step, **options)


def wrap_optimizer(optimizer: Any, tracker: Tracker | None = None, **track_options: Any) -> Tracker:
    """Count one step each time ``optimizer.step()`` returns (one optimizer step = one tracked step).

    Uses torch's ``register_step_post_hook`` when the optimizer has it, else wraps the bound method.
    """
    t = tracker if tracker is not None else track(**track_options)
    register = getattr(optimizer, "register_step_post_hook", None)
    if callable(register):
        register(lambda _opt, _args, _kwargs: t.step())
    else:
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            t.step()
            return result

        optimizer.step = step
    return t
