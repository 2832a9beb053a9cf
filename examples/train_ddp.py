"""A tiny DDP training job (gloo, CPU) with the gpuagent step tracker: the one-line integration.

Run it with torchrun (2 processes on this machine)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_ddp.py --steps 60

``--duration-s`` trains until that much time has passed instead of a fixed step count (the ranks agree
on when to stop). ``--read-file PATH`` gives the loader heavy I/O phases of its own: every
``--read-every`` batches it reads ``--read-mb`` MB of PATH from disk (page cache dropped first).
``--data-sleep-ms`` slows the (synthetic) data loader on purpose, so the agent should see the
data-wait fraction rise. ``--slow-phase A:B`` gives the job a slower phase of its own (an evaluation, a
slow epoch): from A to B seconds into training each step also sleeps ``--slow-sleep-ms``, so the ranks use
less CPU with nobody else to blame. ``--no-tracker`` runs the same job without the tracker (passive metrics only).
The data is random tensors: the job exists to produce real steps, not a useful model.

Each rank measures its own step times with ``time.perf_counter`` (independently of the tracker, read just
before each ``step()`` call, as the tracker reads its own clock at the start of it) and
prints one line ``GPUAGENT_TRAIN_RESULT {json}``; ``--results-dir`` also writes ``rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import gpuagent.jobs


class SyntheticLoader:
    """Random batches; sleeps ``sleep_s`` before each one to stand in for a slow input pipeline."""

    def __init__(self, steps: int, batch_size: int, features: int, sleep_s: float, seed: int,
                 read_file: str = "", read_mb: int = 0, read_every: int = 0) -> None:
        self.steps, self.batch_size, self.features, self.sleep_s = steps, batch_size, features, sleep_s
        self.gen = torch.Generator().manual_seed(seed)
        self.read_file, self.read_bytes, self.read_every = read_file, read_mb << 20, read_every

    def _read_phase(self) -> None:
        """Read read_mb MB of the file from disk: drop its cached pages first so the read is real I/O."""
        fd = os.open(self.read_file, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            left = self.read_bytes
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    os.lseek(fd, 0, os.SEEK_SET)
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    continue
                left -= len(chunk)
        finally:
            os.close(fd)

    def __iter__(self):
        i = 0
        while self.steps <= 0 or i < self.steps:
            if self.read_file and self.read_every > 0 and i % self.read_every == 0:
                self._read_phase()
            i += 1
            if self.sleep_s > 0:
                time.sleep(self.sleep_s)
            x = torch.randn(self.batch_size, self.features, generator=self.gen)
            y = torch.randint(0, 10, (self.batch_size,), generator=self.gen)
            yield x, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--duration-s", type=float, default=0.0, help="train this long instead of --steps")
    ap.add_argument("--read-file", default="", help="the loader reads this file in phases (real disk I/O)")
    ap.add_argument("--read-mb", type=int, default=64, help="MB read per I/O phase")
    ap.add_argument("--read-every", type=int, default=200, help="batches between I/O phases")
    ap.add_argument("--data-sleep-ms", type=float, default=0.0, help="sleep before each batch (slow input)")
    ap.add_argument("--slow-phase", default="", help="A:B: from A to B seconds into training, steps are slower")
    ap.add_argument("--slow-sleep-ms", type=float, default=20.0, help="sleep added to each step of the slow phase")
    ap.add_argument("--name", default="train_ddp_example", help="job name reported to the agent")
    ap.add_argument("--no-tracker", action="store_true", help="run without gpuagent.jobs")
    ap.add_argument("--results-dir", default="", help="write rank<R>.json with this rank's own step times")
    args = ap.parse_args()
    slow = (0.0, 0.0)
    if args.slow_phase:
        try:
            slow = tuple(float(x) for x in args.slow_phase.split(":"))
        except ValueError:
            slow = ()
        if len(slow) != 2 or not 0 <= slow[0] < slow[1]:
            ap.error(f"--slow-phase {args.slow_phase!r}: give A:B, seconds into training with A < B (e.g. 20:30)")

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(args.features, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    batches = SyntheticLoader(0 if args.duration_s > 0 else args.steps, args.batch_size, args.features,
                              args.data_sleep_ms / 1000.0, seed=rank, read_file=args.read_file,
                              read_mb=args.read_mb, read_every=args.read_every)

    dist.barrier()
    # The integration: one line to create the tracker, one call per step (wrap_loader is optional
    # and splits each step into data wait and compute). Created right before the loop: the first
    # step is timed from track(), so setup done in between would count as that step.
    tracker = None if args.no_tracker else gpuagent.jobs.track(name=args.name, samples_per_step=args.batch_size)
    if tracker is not None:
        batches = tracker.wrap_loader(batches)

    own_steps: list[float] = []   # the job's own step times, from the same starting point
    prev = t_start = time.perf_counter()
    for x, y in batches:
        if args.duration_s > 0 and len(own_steps) % 20 == 0:
            # Every rank must take the same number of steps: stop when any rank's time is up.
            done = torch.tensor([float(time.perf_counter() - t_start >= args.duration_s)])
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
            if done.item() > 0:
                break
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if slow[0] <= time.perf_counter() - t_start < slow[1]:
            time.sleep(args.slow_sleep_ms / 1000.0)
        # The job's own clock is read right before step(), where the tracker reads its own: a step()
        # call that is slow now and then (a flush preempted on a busy machine) then counts in neither
        # measurement's step, instead of in the job's only, which moved the median on a loaded machine.
        now = time.perf_counter()
        own_steps.append(now - prev)
        prev = now
        if tracker is not None:
            tracker.step()

    result = {"rank": rank, "world_size": world, "pid": os.getpid(), "steps": len(own_steps),
              "step_median_s": statistics.median(own_steps), "step_times_s": own_steps,
              "job_id": tracker.job_id if tracker else None,
              "tracker_sent": tracker.sent if tracker else 0,
              "tracker_dropped": tracker.dropped if tracker else 0,
              "final_loss": loss.item()}
    if tracker is not None:
        tracker.close()
        result["tracker_sent"], result["tracker_dropped"] = tracker.sent, tracker.dropped
    print("GPUAGENT_TRAIN_RESULT " + json.dumps({k: v for k, v in result.items() if k != "step_times_s"}),
          flush=True)
    if args.results_dir:
        with open(os.path.join(args.results_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)
    dist.barrier()
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip interpreter finalization: gloo's C++ worker threads can still be joinable then, and tearing
    # them down at exit occasionally aborts a finished job ("terminate called without an active
    # exception", SIGABRT; see pytorch/pytorch#179291). Everything is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
