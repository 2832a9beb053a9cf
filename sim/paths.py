"""SYNTHETIC path-probe results: what a fleet of agents' cheap fabric layer would report, epoch by epoch.

Used by benchmarks/fabric_scale.py to put 1,000 to 10,000 simulated nodes through the real collector and
its tomography (collector/analysis/sql/62_path_tomography.sql). The pinglists come from the planner the
collector uses (common/path_planner.py) and every judgement from the agent's own rule (common/path_probe.py):
a path's first reading, and its confirmations when the first looked odd against the node's reference.
Readings are drawn, not measured (SYNTHETIC, and every result says so in its env):

- a healthy path: rtt ~ ``rtt_us`` x lognormal(0, 0.2), train rate ~ ``train_gbits`` x lognormal(0, 0.15),
  each datagram lost with ``base_loss``; a ``hiccup`` share of a node's time its CPU is in a busy burst
  (mean ``burst_s`` long, exponential) and a reading taken in one is slow (rtt x 3-20, train / 3-20), which
  is what a single odd reading on a real node mostly is. Bursts last: the confirmations of a first reading
  that fell in one are slowed alike while it lasts (its rest is exponential, mean ``burst_s``), and after it
  each falls in a new one with probability ``hiccup``. The confirmations are ``settings.gap_s(epoch)``
  apart, as the agent spaces them (the first readings of different paths stay independent draws);
- a bad node (a NIC that came up at a lower rate) after its onset: every path through it at
  ``train x bad_node_factor``;
- a bad link after its onset: ``slow``: train x ``bad_link_factor``; ``lossy``: each datagram lost with
  ``bad_link_loss``.

To keep 10,000 nodes' 500,000 paths per epoch cheap, the first reading of every path is drawn with numpy
and judged by the same rule vectorised; only the odd ones (a few per thousand) take the agent's code path
(``reading_is_odd``/``verdict`` with fresh confirmation readings). The node's reference is the median of
its paths in the previous epoch (the agent's is its last 64 paths; at 50 paths an epoch they are alike).
Each suspect path is probed from its other end in the next epoch (path_planner.with_rechecks), as the
collector plans it, or in the one after when its report would reach the collector after the next epoch's
pinglists went out (its first probe drawn uniformly over the epoch less its tail, its confirmations a gap
apart, then up to one batch interval).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from gpuagent.common import path_planner, path_probe
from gpuagent.common.parse import settings_key
from gpuagent.proto import pb

NS = 1_000_000_000


@dataclass
class PathFleetSim:
    nodes: Mapping[str, Mapping[str, str]]         # node id -> labels (the scope label among them)
    scope_key: str | None = "pool"
    plan: path_planner.PathPlanSettings = field(default_factory=path_planner.PathPlanSettings)
    settings: path_probe.PathSettings = field(default_factory=path_probe.PathSettings)
    rtt_us: float = 40.0
    train_gbits: float = 2.5
    base_loss: float = 1e-5
    hiccup: float = 0.01
    burst_s: float = 2.0
    batch_interval_s: float = 5.0    # the agent's [batch] interval: a suspect reaches the collector within it
    bad_node_factor: float = 0.08
    bad_link_factor: float = 0.1
    bad_link_loss: float = 0.03
    seed: int = 0
    bad_nodes: dict[str, int] = field(default_factory=dict)          # node -> onset (epoch start ns)
    bad_links: dict[frozenset, tuple[int, str]] = field(default_factory=dict)   # pair -> (onset ns, slow|lossy)

    def __post_init__(self):
        self.ids = sorted(self.nodes)
        self.index = {n: i for i, n in enumerate(self.ids)}
        self.rng = np.random.default_rng(self.seed)
        self.prng = random.Random(self.seed)
        self.ref_rtt = np.full(len(self.ids), np.nan)
        self.ref_train = np.full(len(self.ids), np.nan)
        self.link_params = settings_key(self.settings.as_params())
        self.stats = {"paths": 0, "probes": 0, "datagrams_sent": 0, "bytes_sent": 0, "suspects": 0,
                      "slow_path_calls": 0, "rechecks": 0}
        self.rechecks: list[tuple[str, str]] = []     # suspect paths (reporter, peer) for the next epoch
        self.rechecks_later: list[tuple[str, str]] = []     # ... for the one after (they came too late)

    # -- one reading, the slow way (the agent's code path)
    def _slowdowns(self, first: float, lags_s: list[float]) -> list[float]:
        """The slowdown of each reading ``lags_s`` after one slowed by ``first`` (1.0: not in a burst). A burst
        that slowed the first lasts on for an exponential time of mean burst_s (memoryless, so that is its
        rest too): the readings within it are slowed alike, the ones after it fall in a new burst with
        probability ``hiccup`` each."""
        r = self.prng
        rest = r.expovariate(1.0 / self.burst_s) if first > 1.0 else -1.0
        return [first if lag < rest else (r.uniform(3, 20) if r.random() < self.hiccup else 1.0) for lag in lags_s]

    def _reading(self, a: str, b: str, t_ns: int, slowdown: float) -> path_probe.ProbeReading:
        s, r = self.settings, self.prng
        rtt, train, loss = self.rtt_us, self.train_gbits, self.base_loss
        for n in (a, b):
            if n in self.bad_nodes and t_ns >= self.bad_nodes[n]:
                train *= self.bad_node_factor
        bad = self.bad_links.get(frozenset((a, b)))
        if bad and t_ns >= bad[0]:
            if bad[1] == "slow":
                train *= self.bad_link_factor
            else:
                loss = self.bad_link_loss
        rtt, train = rtt * slowdown, train / slowdown
        rtts = [rtt * r.lognormvariate(0, 0.2) for _ in range(s.pings) if r.random() >= loss]
        echoes = sum(1 for _ in range(s.train_packets) if r.random() >= loss)
        lost = (s.pings - len(rtts)) + (s.train_packets - echoes)
        return path_probe.ProbeReading(rtts, s.datagrams(), lost,
                                       train * r.lognormvariate(0, 0.15) if echoes >= 2 else None)

    def epoch(self, epoch: int, start_ns: int) -> dict[str, list[pb.ProbeResult]]:
        """{node id: [its suspect results..., its summary]} for one epoch starting at ``start_ns``."""
        s, p = self.settings, self.plan
        end_ns = start_ns + int(p.epoch_s * NS)
        lists = path_planner.pinglists(self.nodes, self.scope_key, epoch, p)
        self.stats["rechecks"] += path_planner.with_rechecks(lists, self.rechecks, p.rechecks_per_node)
        self.rechecks, self.rechecks_later = self.rechecks_later, []
        gap_s = s.gap_s(p.epoch_s)
        span_s = p.epoch_s - s.tail_s(p.epoch_s)
        src = np.array([self.index[a] for a, peers in lists.items() for _ in peers], dtype=np.int64)
        dst = np.array([self.index[b] for peers in lists.values() for b in peers], dtype=np.int64)
        m = len(src)
        # the first reading of every path, vectorised
        train = np.full(m, self.train_gbits)
        loss = np.full(m, self.base_loss)
        for n, onset in self.bad_nodes.items():
            if start_ns >= onset:
                i = self.index[n]
                train[(src == i) | (dst == i)] *= self.bad_node_factor
        for pair, (onset, how) in self.bad_links.items():
            if start_ns >= onset:
                i, j = (self.index[x] for x in pair)
                hit = ((src == i) & (dst == j)) | ((src == j) & (dst == i))
                if how == "slow":
                    train[hit] *= self.bad_link_factor
                else:
                    loss[hit] = self.bad_link_loss
        rng = self.rng
        hic = np.where(rng.random(m) < self.hiccup, rng.uniform(3, 20, m), 1.0)
        rtt_med = self.rtt_us * hic * np.exp(rng.normal(0, 0.2, m))   # the median of the pings, near enough
        train = train / hic * np.exp(rng.normal(0, 0.15, m))
        lost = rng.binomial(s.datagrams(), loss)
        rr, rt = self.ref_rtt[src], self.ref_train[src]
        odd = (lost > 0) | (rtt_med > s.late_factor * rr + s.late_floor_us) | (train < s.slow_fraction * rt)
        verdicts: dict[int, list] = {}
        for k in np.nonzero(odd)[0]:
            a, b = self.ids[src[k]], self.ids[dst[k]]
            ref = (None if np.isnan(rr[k]) else float(rr[k]), None if np.isnan(rt[k]) else float(rt[k]))
            first = path_probe.ProbeReading([float(rtt_med[k])] * s.pings, s.datagrams(), int(lost[k]),
                                            float(train[k]))
            slow = self._slowdowns(float(hic[k]), [i * gap_s for i in range(1, s.confirm + 1)])
            readings = [first] + [self._reading(a, b, start_ns, f) for f in slow]
            v = path_probe.verdict(b, readings, ref[0], ref[1], s)
            verdicts[k] = v
            self.stats["slow_path_calls"] += 1
        # per node: summary from the vectorised paths, odd ones replaced by their verdicts
        probes = np.ones(m)
        best = train.copy()
        med = rtt_med.copy()
        lost_f = lost.astype(float)
        suspect = np.zeros(m, dtype=bool)
        for k, v in verdicts.items():
            probes[k] = v.probes
            best[k] = v.train_gbits if v.train_gbits is not None else np.nan
            med[k] = v.rtt_p50_us if v.rtt_p50_us is not None else np.nan
            lost_f[k] = round(v.loss_ratio * v.probes * s.datagrams())
            suspect[k] = bool(v.suspect)
        order = np.argsort(src, kind="stable")
        bounds = np.searchsorted(src[order], np.arange(len(self.ids) + 1))
        out: dict[str, list[pb.ProbeResult]] = {}
        env = {"synthetic": "true", "generator": "gpuagent.sim.paths"}
        for i, node in enumerate(self.ids):
            sel = order[bounds[i]:bounds[i + 1]]
            if len(sel) == 0:
                continue
            results = []
            for k in sel[suspect[sel]]:
                v = verdicts[int(k)]
                results.append(pb.ProbeResult(
                    probe=path_probe.PROBE, status="ok", gpu=-1, started_ns=start_ns, ended_ns=end_ns,
                    params={**path_probe.result_params(node, epoch, v.peer), "link_params": self.link_params},
                    metrics=path_probe.suspect_metrics(v), env={**env, "suspect": v.suspect}))
                self.stats["suspects"] += 1
                # the agent sends a suspect once confirmed, a gap after each reading from its first (somewhere
                # in the epoch's span), with its next batch: before the next pinglists, or after them
                arrives_s = (self.prng.uniform(0, span_s) + s.confirm * gap_s
                             + self.prng.uniform(0, self.batch_interval_s))
                (self.rechecks if arrives_s < p.epoch_s else self.rechecks_later).append((node, v.peer))
            n_probes = float(probes[sel].sum())
            sent = n_probes * s.datagrams()
            metrics = {"paths": float(len(sel)), "paths_suspect": float(suspect[sel].sum()), "probes": n_probes,
                       "datagrams_sent": sent, "datagrams_lost": float(lost_f[sel].sum()),
                       "loss_ratio": float(lost_f[sel].sum()) / sent, "bytes_sent": n_probes * s.bytes_sent()}
            good_rtt, good_train = med[sel][~np.isnan(med[sel])], best[sel][~np.isnan(best[sel])]
            if len(good_rtt):
                metrics["rtt_p50_us"] = float(np.median(good_rtt))
                metrics["rtt_p99_us"] = float(good_rtt.max() * 1.5)
                self.ref_rtt[i] = metrics["rtt_p50_us"] if len(good_rtt) >= s.min_reference else np.nan
            if len(good_train):
                metrics["train_gbits_per_s"] = float(np.median(good_train))
                self.ref_train[i] = metrics["train_gbits_per_s"] if len(good_train) >= s.min_reference else np.nan
            results.append(pb.ProbeResult(
                probe=path_probe.PROBE, status="ok", gpu=-1, started_ns=start_ns, ended_ns=end_ns,
                params={**path_probe.result_params(node, epoch), "link_params": self.link_params},
                metrics=metrics, env=env))
            out[node] = results
            self.stats["paths"] += len(sel)
            self.stats["probes"] += int(n_probes)
            self.stats["datagrams_sent"] += int(sent)
            self.stats["bytes_sent"] += int(n_probes * s.bytes_sent())
        return out
