"""Helpers for tests on the namespace testbed (scripts/netns_fleet.py): the ``netns_fleet`` fixture and a
``net_pair`` run between two of its nodes (listener and connector as real subprocesses in their
namespaces, via Fleet.net_pair). Use: ``from fabric_helpers import netns_fleet, run_net_pair  # noqa: F401``."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_netns_fleet():
    """scripts/netns_fleet.py as a module (scripts/ is not a package)."""
    if "netns_fleet" not in sys.modules:
        spec = importlib.util.spec_from_file_location("netns_fleet", ROOT / "scripts" / "netns_fleet.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["netns_fleet"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["netns_fleet"]


def netns_testbed_or_skip():
    """scripts/netns_fleet.py, or a skip with the reason where the testbed cannot be built (not root, no
    ip netns); for module-scoped fixtures, which cannot use ``netns_fleet``."""
    nf = load_netns_fleet()
    why = nf.unavailable_reason()
    if why:
        pytest.skip(why)
    return nf


@pytest.fixture
def netns_fleet():
    """``netns_fleet(n)`` builds an n-node fleet owned by this test process; all are torn down after
    the test. Skips, with the reason, where the testbed cannot be built (not root, no ip netns)."""
    nf = netns_testbed_or_skip()
    built = []

    def make(n: int):
        fleet = nf.Fleet.up(n)
        built.append(fleet)
        return fleet

    try:
        yield make
    finally:
        for fleet in built:
            fleet.down()


def run_net_pair(fleet, connector: str, listener: str, **settings: Any) -> dict[str, Any]:
    """One net_pair run between two nodes (Fleet.net_pair); ``settings`` as the connect CLI's options."""
    return fleet.net_pair(connector, listener, **settings)


class Results:
    """The agent's batcher stand-in: keeps what a FabricClient or a PathProber hands over (probe_result is
    its sink API)."""

    def __init__(self):
        self.rows = []
        self._mu = threading.Lock()

    def probe_result(self, rec):
        with self._mu:
            self.rows.append(rec)

    def summaries(self):
        """The path-probe summaries among the rows (params role = summary)."""
        with self._mu:
            return [r for r in self.rows if r["params"].get("role") == "summary"]

