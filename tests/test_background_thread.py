"""common/background.py: the one start/stop helper the agent's and the collector's workers share, on real threads."""

from __future__ import annotations

import threading
import time

from gpuagent.common.background import BackgroundThread


def test_stop_wakes_a_waiting_loop_and_joins_it():
    ticks: list[float] = []

    def loop() -> None:
        while not worker.stopping.wait(30.0):     # a long interval: only the stop can end the wait
            ticks.append(time.monotonic())

    worker = BackgroundThread("test-worker", loop)
    worker.start()
    assert worker.alive
    assert [t.name for t in threading.enumerate()].count("test-worker") == 1
    t0 = time.monotonic()
    assert worker.stop(5.0) is True
    assert time.monotonic() - t0 < 2.0, "stop waited out the loop's interval instead of waking it"
    assert not worker.alive and ticks == []


def test_start_twice_runs_the_loop_once():
    runs = []
    release = threading.Event()

    def loop() -> None:
        runs.append(1)
        release.wait(5.0)

    worker = BackgroundThread("test-once", loop)
    worker.start()
    worker.start()
    release.set()
    assert worker.stop(5.0)
    assert runs == [1]


def test_stop_before_start_is_true_and_a_later_start_runs_nothing():
    runs = []
    worker = BackgroundThread("test-never", lambda: runs.append(1))
    assert worker.stop(0.1) is True
    worker.start()
    assert not worker.started and runs == []


def test_a_loop_that_outlives_the_timeout_is_reported_not_hidden():
    release = threading.Event()
    worker = BackgroundThread("test-stuck", lambda: release.wait(10.0))   # ignores the stop event
    worker.start()
    t0 = time.monotonic()
    assert worker.stop(0.2) is False
    assert 0.15 < time.monotonic() - t0 < 2.0
    assert worker.alive
    release.set()
    assert worker.stop(5.0) is True


def test_stop_from_inside_the_loop_does_not_wait_for_itself():
    done = threading.Event()
    answers = []

    def loop() -> None:
        t0 = time.monotonic()
        answers.append(worker.stop(5.0))         # the thread cannot join itself: it returns at once
        answers.append(time.monotonic() - t0)
        done.set()

    worker = BackgroundThread("test-self", loop)
    worker.start()
    assert done.wait(5.0)
    assert answers[0] is False and answers[1] < 1.0
    assert worker.stopping.is_set()
    assert worker.stop(5.0) is True
