"""Clock steps on a real agent: its wall clock is set back an hour, then forward an hour (two hours past
the back step), through the agent's clock seam (GPUAGENT_CLOCK_OFFSET_FILE, common/timeutil.py). No batch
is refused for it, the accounting stays exact, and samples.ts shows both jumps."""

from __future__ import annotations

import time

import pytest

from conftest import wait_for
from fault_helpers import TICK_METRIC, Agent, Collector, account, can_unshare, started_procs  # noqa: F401 - the procs fixture

HOUR = 3600 * 10**9

pytestmark = pytest.mark.skipif(bool(can_unshare()), reason=can_unshare() or "ok")



def test_agent_clock_stepped_back_and_forward_an_hour(tmp_path, procs):
    offset = tmp_path / "clock-offset"
    offset.write_text("0\n")
    c = Collector(tmp_path).start()
    procs.append(c)
    a = Agent(tmp_path, "fault-t0", interval=0.1, batch_interval=0.2,
              extra_env={"GPUAGENT_CLOCK_OFFSET_FILE": str(offset)})
    procs.append(a.start(c.address))
    a.wait_running()
    node = wait_for(lambda: a.status().get("node", {}).get("node_id"), what="node id")

    def ticks_between(lo: int, hi: int) -> int:
        return c.sql(f"SELECT count(*) FROM samples WHERE node_id = '{node}' AND metric = '{TICK_METRIC}' "
                     f"AND epoch_ns(ts) BETWEEN {lo} AND {hi}")[0][0]

    t0 = time.time_ns()
    wait_for(lambda: ticks_between(t0 - 10**10, t0 + 10**11) >= 5, timeout=60, what="ticks at the true time")
    offset.write_text(f"{-HOUR}\n")                       # clock stepped back by an hour
    back = time.time_ns() - HOUR
    wait_for(lambda: ticks_between(back - 10**10, back + 10**11) >= 5, timeout=60, what="ticks an hour back")
    offset.write_text(f"{HOUR}\n")                        # and forward: an hour ahead of the true time
    ahead = time.time_ns() + HOUR
    wait_for(lambda: ticks_between(ahead - 10**10, ahead + 10**11) >= 5, timeout=60, what="ticks an hour ahead")
    offset.write_text("0\n")
    now = time.time_ns()
    wait_for(lambda: ticks_between(now - 10**10, now + 10**11) >= 5, timeout=60, what="ticks back at true time")
    final = a.stop()
    assert final["spool"]["rejected_batches"] == 0, "a batch was refused for its timestamps"
    (fig,) = account("clock_steps", [a], c, produced={a.name: final["counters"]["samples"]})
    assert fig["batches_rejected"] == 0
    # Every tick stamp sits at the true time, an hour back or an hour ahead (the test takes well under ten
    # minutes), and each of the three regimes holds ticks: samples.ts says what the clock did.
    end = time.time_ns()
    span = end - t0 + 10**10
    ts = [r[0] for r in c.sql(f"SELECT epoch_ns(ts) FROM samples WHERE node_id = '{node}' AND metric = '{TICK_METRIC}'")]
    regimes = {"true": 0, "back": 0, "ahead": 0}
    for x in ts:
        for name, shift in (("true", 0), ("back", -HOUR), ("ahead", HOUR)):
            if t0 - 10**10 + shift <= x <= t0 + span + shift:
                regimes[name] += 1
                break
        else:
            raise AssertionError(f"tick stamp {x} fits no clock regime")
    print("FAULT-CLOCK-REGIMES", regimes)
    assert all(n >= 5 for n in regimes.values()), regimes
    assert sum(regimes.values()) == len(ts) == final["counters"]["ticks"] - fig_spooled_ticks(a)


def fig_spooled_ticks(a: Agent) -> int:
    """Tick samples still in the agent's spool (the batch cut at its clean shutdown)."""
    from gpuagent.agent.pipeline.spool import decode_record
    from gpuagent.proto import pb
    n = 0
    for f in (a.state / "spool").glob("*.batch"):
        batch = pb.Batch.FromString(decode_record(f.read_bytes())[3])
        ids = {s.id for s in batch.samples.series if s.metric == TICK_METRIC and not s.labels}
        n += sum(1 for sid in batch.samples.series_id if sid in ids)
    return n
