"""Process deaths under load: the collector SIGKILLed repeatedly while three real agents stream to it, and
one agent SIGKILLed repeatedly; exact accounting after every round and at the end. make test runs 5 rounds of
each; benchmarks/fault_rounds.py runs the same scenarios for 20."""

from __future__ import annotations

import random
import time

import pytest

from conftest import wait_for
from fault_helpers import Agent, Collector, account, can_unshare, started_procs  # noqa: F401 - the procs fixture

ROUNDS = 5        # in make test; benchmarks/fault_rounds.py: 20

pytestmark = pytest.mark.skipif(bool(can_unshare()), reason=can_unshare() or "ok")



def collector_kill_rounds(tmp_path, procs: list, rounds: int) -> list[dict]:
    """The collector SIGKILLed ``rounds`` times while three agents stream; exact accounting after every round
    and at the end (returned: the final figures per agent)."""
    c = Collector(tmp_path).start()
    procs.append(c)
    agents = [Agent(tmp_path, f"fault-c{i}", interval=0.1, batch_interval=0.2) for i in range(3)]
    for a in agents:
        procs.append(a.start(c.address))
    for a in agents:
        a.wait_running()
    rng = random.Random(11)
    for r in range(rounds):
        # Load: every agent gets a fresh ack from this collector life before the kill.
        base = {a.name: a.acked() for a in agents}
        wait_for(lambda: all(a.acked() > base[a.name] for a in agents), timeout=60,
                 what=f"an ack for every agent in round {r}")
        time.sleep(rng.uniform(0.0, 0.3))        # kill at a random point of the stream, not right after an ack
        c.kill()
        c.start()
        account(f"collector_sigkill_round_{r + 1}", agents, c)
    assert c.starts == rounds + 1
    # Let the backlog drain, stop the agents cleanly: their own counters give the samples produced.
    base = {a.name: a.acked() for a in agents}
    wait_for(lambda: all(a.acked() > base[a.name] for a in agents), timeout=60, what="acks after the last restart")
    produced = {}
    for a in agents:
        final = a.stop()
        assert final["state"] == "stopped"
        produced[a.name] = final["counters"]["samples"]
    figs = account("collector_sigkill_final", agents, c, produced=produced)
    assert all(f["samples_stored"] > 0 for f in figs)
    return figs


def agent_kill_rounds(tmp_path, procs: list, rounds: int) -> dict:
    """One agent SIGKILLed ``rounds`` times (half right after an ack, half at a random point); exact accounting
    after every round and at the end (returned)."""
    c = Collector(tmp_path).start()
    procs.append(c)
    a = Agent(tmp_path, "fault-k0", interval=0.1, batch_interval=0.2)
    procs.append(a)
    rng = random.Random(12)
    for r in range(rounds):
        a.start(c.address)
        a.wait_running()
        base = a.acked()
        if r % 2 == 0:
            # half the rounds die right after an ack, half at a random point of cutting and sending
            wait_for(lambda: a.acked() > base, timeout=60, what=f"an ack in round {r}")
        time.sleep(rng.uniform(0.05, 0.6))
        a.kill(c)
        account(f"agent_sigkill_round_{r + 1}", [a], c)
    a.start(c.address)
    a.wait_running()
    high = a.seq_high()
    wait_for(lambda: a.acked() > high, timeout=60, what="a batch of the last life acked")
    node = a.status()["node"]["node_id"]      # registered by now
    # The spool of the killed lives is delivered: every batch cut before this life (but those counted as
    # cut at a kill) is stored, counted by seq.
    want = high - len([s for s in a.cut_at_kill if s <= high])
    wait_for(lambda: c.sql(f"SELECT count(DISTINCT seq) FROM ingest_log WHERE node_id = '{node}' "
                           f"AND seq <= {high}")[0][0] == want, timeout=60, what="the spool of the killed agent delivered")
    final = a.stop()
    assert final["state"] == "stopped"
    # Batches this last life cut may still be spooled at its clean stop; the exact accounting counts them.
    (fig,) = account("agent_sigkill_final", [a], c)
    assert fig["lives"] == rounds + 1
    return fig


# make test runs each scenario ROUNDS times: every round is a kill at a random point with the exact accounting
# asserted after it, so 5 rounds prove the property as 20 do; `benchmarks/fault_rounds.py` runs the full 20
# (or more) rounds of the same two functions.
@pytest.mark.slow
def test_collector_sigkilled_repeatedly_under_three_agents(tmp_path, procs):
    collector_kill_rounds(tmp_path, procs, ROUNDS)


@pytest.mark.slow
def test_agent_sigkilled_repeatedly(tmp_path, procs):
    agent_kill_rounds(tmp_path, procs, ROUNDS)
