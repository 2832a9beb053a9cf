"""The cheap, continuous fabric layer ("path probes"): what one probe of one path is, when a path is a
suspect, and the results an agent reports. Pure functions, standard library only.

It lives in common because three parts must agree on it: the agent that probes (agent/probing/paths.py),
the simulator that stands in for a fleet of agents (sim/paths.py, SYNTHETIC), and the collector that plans
the pinglists and reads the results (collector/fabric, collector/analysis/sql/62_path_tomography.sql).

One probe of a path a -> b (a sends, b's UDP echo responder returns every datagram as it came):
  * ``pings`` small datagrams, one at a time: their round trips give rtt p50/p99 (microseconds);
  * one train of ``train_packets`` datagrams of ``train_bytes``, sent back to back: b echoes each at full
    size, and the spread of the echoes' kernel arrival times at a (SO_TIMESTAMPNS) gives a rate estimate,
    ``train_gbits_per_s`` = (n - 1) x bytes x 8 / spread. The echoes cross both directions, so the slower
    direction bounds it. It reads a shaped or down-trained link (a 25 GbE NIC that came up at 1 Gbit/s, a
    rate-limited port), not the line rate of a fast one: on a path faster than the sender can pace
    datagrams from Python (a few Gbit/s) it reads the sender's pace. The analysis compares paths with
    each other, never with a line rate, so that is enough;
  * a datagram with no echo within ``timeout_s`` is lost.

A path is a *suspect* when its first probe looks wrong against the node's own recent paths (lost
datagrams; a train under ``slow_fraction`` of their median; an rtt p50 over ``late_factor`` x theirs plus
``late_floor_us``) and ``confirm`` more probes, ``confirm_gap_s`` apart, say the same (the best train of all of them
is still slow, the best probe's rtt p50 still late, or a confirmation lost datagrams too, three at
least in all): one late or slow reading is a busy CPU, not a link, and spreading the confirmations over
seconds keeps one burst of CPU load from making them all slow. Each node reports once per epoch a *summary* of every path it probed
and one *suspect* result per suspect path; the collector's tomography finds the node or link that explains
them (docs/FABRIC.md, "The cheap layer").
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, fields
from typing import Iterable, Sequence

PROBE = "path_probe"
MAGIC = b"GPAP"                 # the first bytes of every datagram; anything else is dropped (the responder counts it)
HEADER = "!4sBIHHQ"             # magic, kind (1 ping, 2 train), probe id, seq, count, send time (ns)
KIND_PING, KIND_TRAIN = 1, 2


@dataclass(frozen=True)
class PathSettings:
    """One probe's shape and the suspect rule; the collector hands them out with each pinglist."""
    pings: int = 3
    ping_bytes: int = 64
    train_packets: int = 32
    train_bytes: int = 1400
    timeout_s: float = 0.5
    confirm: int = 3
    confirm_gap_s: float = 3.5      # between a path's confirmations (all of them within a quarter of an epoch)
    slow_fraction: float = 0.5
    late_factor: float = 3.0
    late_floor_us: float = 100.0
    reference_paths: int = 64       # the node's recent paths the rule compares with
    min_reference: int = 4          # below this many, no relative judgement (only loss)

    def problem(self) -> str:
        """One sentence saying what is wrong, or ""."""
        if not (1 <= self.pings <= 100 and 2 <= self.train_packets <= 256):
            return f"path probe pings must be 1-100 and train_packets 2-256, got {self.pings} and {self.train_packets}"
        if not (32 <= self.ping_bytes <= 1472 and 64 <= self.train_bytes <= 8972):
            return (f"path probe ping_bytes must be 32-1472 and train_bytes 64-8972, got {self.ping_bytes} "
                    f"and {self.train_bytes}")
        if not (0 < self.timeout_s <= 10 and 0 <= self.confirm <= 10):
            return f"path probe timeout_s must be in (0, 10] and confirm 0-10, got {self.timeout_s} and {self.confirm}"
        if not 0 <= self.confirm_gap_s <= 60:
            return f"path probe confirm_gap_s must be 0-60, got {self.confirm_gap_s}"
        if not (0 < self.slow_fraction < 1 and self.late_factor > 1 and self.late_floor_us >= 0):
            return "path probe slow_fraction must be in (0, 1), late_factor above 1 and late_floor_us not negative"
        if not (1 <= self.min_reference <= self.reference_paths):
            return "path probe min_reference must be at least 1 and at most reference_paths"
        return ""

    def as_params(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_params(cls, params) -> "PathSettings | str":
        """From text params (an assignment's); the sentence saying what is wrong when they do not parse."""
        kw = {}
        for f in fields(cls):
            if f.name in params:
                try:
                    kw[f.name] = type(getattr(cls, f.name))(float(params[f.name])) \
                        if isinstance(getattr(cls, f.name), int) else float(params[f.name])
                except (ValueError, OverflowError):     # OverflowError: "inf" for a whole number
                    return f"path probe setting {f.name} = {params[f.name]!r} is not a number"
        s = cls(**kw)
        return s.problem() or s

    def gap_s(self, epoch_s: float) -> float:
        """Seconds between one path's readings in an epoch of ``epoch_s``: ``confirm_gap_s``, but all the
        confirmations of a path within a quarter of the epoch (a 3 s test epoch cannot wait 6 s)."""
        return min(self.confirm_gap_s, max(0.0, epoch_s) / (4 * (self.confirm + 1)))

    def tail_s(self, epoch_s: float) -> float:
        """The end of an epoch kept free of first probes, so that the last path's confirmations fit: each a
        gap, and every probe (the first included) as long as one whose datagrams all wait out timeout_s; at
        most half the epoch."""
        probe_s = (self.pings + 1) * self.timeout_s
        return min(max(0.0, epoch_s) / 2, self.confirm * self.gap_s(epoch_s) + (self.confirm + 1) * probe_s)

    def datagrams(self) -> int:
        """Datagrams one probe sends (each comes back once more as its echo)."""
        return self.pings + self.train_packets

    def bytes_sent(self) -> int:
        """Payload bytes one probe sends (the echoes carry as many back)."""
        return self.pings * self.ping_bytes + self.train_packets * self.train_bytes


@dataclass
class ProbeReading:
    """One probe of one path."""
    rtts_us: list[float]
    sent: int
    lost: int
    train_gbits: float | None     # None: fewer than two train echoes came back


@dataclass
class PathVerdict:
    """A path after its probe (and confirmations, when the first looked wrong)."""
    peer: str
    rtt_p50_us: float | None
    rtt_p99_us: float | None
    loss_ratio: float
    train_gbits: float | None
    probes: int
    suspect: str                   # "" or what is wrong: "loss", "slow", "late", comma separated

    def as_dict(self) -> dict:
        return asdict(self)


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def reading_is_odd(r: ProbeReading, ref_rtt_us: float | None, ref_train: float | None,
                   s: PathSettings) -> bool:
    """Does one probe look wrong against the node's recent paths (then it is confirmed)?"""
    if r.lost:
        return True
    med = statistics.median(r.rtts_us) if r.rtts_us else None
    if ref_rtt_us is not None and med is not None and med > s.late_factor * ref_rtt_us + s.late_floor_us:
        return True
    return ref_train is not None and r.train_gbits is not None and r.train_gbits < s.slow_fraction * ref_train


def verdict(peer: str, readings: Sequence[ProbeReading], ref_rtt_us: float | None, ref_train: float | None,
            s: PathSettings) -> PathVerdict:
    """The path from its first reading and, when that looked wrong, its confirmations."""
    rtts = [x for r in readings for x in r.rtts_us]
    sent = sum(r.sent for r in readings)
    lost = sum(r.lost for r in readings)
    trains = [r.train_gbits for r in readings if r.train_gbits is not None]
    best = max(trains) if trains else None
    med = statistics.median(rtts) if rtts else None
    why = []
    if len(readings) > 1:         # only a confirmed path can be a suspect
        # lost datagrams in the first probe and a confirmation, three at least in all: a healthy fabric's
        # rare drop (1e-5 of datagrams) does not make two in a row across 100,000 paths a minute
        if readings[0].lost and any(r.lost for r in readings[1:]) and lost >= 3:
            why.append("loss")
        if ref_train is not None and (best is None or best < s.slow_fraction * ref_train):
            why.append("slow")
        # the best reading decides, as for the train: two busy-CPU readings of four must not make a path late
        meds = [statistics.median(r.rtts_us) for r in readings if r.rtts_us]
        if ref_rtt_us is not None and (not meds or min(meds) > s.late_factor * ref_rtt_us + s.late_floor_us):
            why.append("late")
    return PathVerdict(peer, med, _pct(rtts, 0.99), lost / sent if sent else 1.0, best, len(readings),
                       ",".join(why))


def reference(recent: Iterable[PathVerdict], s: PathSettings) -> tuple[float | None, float | None]:
    """(rtt p50, train Gbit/s): the medians of the node's recent paths, None where too few."""
    recent = list(recent)
    rtts = [v.rtt_p50_us for v in recent if v.rtt_p50_us is not None]
    trains = [v.train_gbits for v in recent if v.train_gbits is not None]
    return (statistics.median(rtts) if len(rtts) >= s.min_reference else None,
            statistics.median(trains) if len(trains) >= s.min_reference else None)


def summary_metrics(verdicts: Sequence[PathVerdict], s: PathSettings) -> dict[str, float]:
    """The epoch's summary of every path a node probed (metric names carry units)."""
    probes = sum(v.probes for v in verdicts)
    sent = probes * s.datagrams()
    lost = sum(round(v.loss_ratio * v.probes * s.datagrams()) for v in verdicts)
    rtts = [v.rtt_p50_us for v in verdicts if v.rtt_p50_us is not None]
    trains = [v.train_gbits for v in verdicts if v.train_gbits is not None]
    out = {"paths": float(len(verdicts)), "paths_suspect": float(sum(1 for v in verdicts if v.suspect)),
           "probes": float(probes), "datagrams_sent": float(sent), "datagrams_lost": float(lost),
           "loss_ratio": lost / sent if sent else 0.0, "bytes_sent": float(probes * s.bytes_sent())}
    if rtts:
        out["rtt_p50_us"] = statistics.median(rtts)
        out["rtt_p99_us"] = max(v.rtt_p99_us or 0.0 for v in verdicts)
    if trains:
        out["train_gbits_per_s"] = statistics.median(trains)
    return out


def suspect_metrics(v: PathVerdict) -> dict[str, float]:
    out = {"loss_ratio": v.loss_ratio, "probes": float(v.probes)}
    if v.rtt_p50_us is not None:
        out["rtt_p50_us"] = v.rtt_p50_us
    if v.rtt_p99_us is not None:
        out["rtt_p99_us"] = v.rtt_p99_us
    if v.train_gbits is not None:
        out["train_gbits_per_s"] = v.train_gbits
    return out


def result_params(me: str, epoch: int, peer: str = "") -> dict[str, str]:
    """A summary's params (no peer), or a suspect's: node_a (the prober), node_b (the peer) and a pair id,
    which put it in link_results as probe ``path_probe``."""
    if not peer:
        return {"epoch": str(epoch), "role": "summary"}
    return {"epoch": str(epoch), "role": "suspect", "node_a": me, "node_b": peer,
            "pair_id": f"path-{epoch}-{me}-{peer}"}
