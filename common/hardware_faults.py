"""Hardware-fault rules, shared by the node's health check and the collector's analysis.

The rules live in ``hardware_faults.toml`` beside this module (the XID catalog, counter thresholds,
severities, actions and the cited source of each). ``node_faults`` applies them to one node's latest
readings; the collector's SQL step ``70_hardware_fault.sql`` applies the same rows, which the analyzer
loads from ``rule_rows()`` / ``xid_rows()``, so a node and the collector agree on what is a fault.

Standard library only: ``gpuagent.common`` imports nothing else from gpuagent.
"""

from __future__ import annotations

import time
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping, Sequence

COMPONENTS = ("xid", "ecc", "row_remap", "retired_pages", "nvlink", "pcie_link", "clocks", "ib_port", "eth_link")
SEVERITIES = ("critical", "warning")
# An XID row or a variant may also be "ignore": the catalog's IGNORE bucket ("No Action required"), no fault.
XID_SEVERITIES = SEVERITIES + ("ignore",)
KINDS = ("any_increment", "rate", "state", "below_max", "share", "total")
OPS = ("eq", "ne", "lt", "ge", "gt")

SeriesKey = tuple[str, int, tuple[tuple[str, str], ...]]


class RulesError(ValueError):
    """The rules file is malformed; the message is one sentence naming the entry."""


@dataclass(frozen=True)
class XidRule:
    xid: int
    severity: str
    action: str
    application: bool
    description: str
    source: str
    immediate: str = ""          # the catalog's "Resolution Bucket (Immediate Action)"
    investigatory: str = ""      # the catalog's "Resolution Bucket (Investigatory Action)"
    listed: bool = True          # False: not in the catalog table, the default bucket applies
    mnemonic: str = ""
    applies_to: tuple[str, ...] = ()
    repeat_action: str = ""      # an application XID repeating on one GPU: what to do then
    ours: str = ""               # where our severity or action is our own choice rather than the bucket's, why


@dataclass(frozen=True)
class Variant:
    """A refinement of an XID (or a fault event) by one attribute the agent decoded from its message: XID 154's
    recovery action, an NVLink5 XID's decoded severity, an SXid's Fatal tag. It replaces severity and action."""
    kind: str                    # "xid" or an event kind ("sxid")
    xids: tuple[int, ...]        # for kind "xid": the XIDs it refines
    attr: str
    value: str
    severity: str
    action: str
    description: str
    source: str


@dataclass(frozen=True)
class CounterRule:
    name: str
    component: str
    metric: str
    kind: str
    severity: str
    action: str
    source: str
    sentence: str
    labels: tuple[tuple[str, str], ...] = ()
    op: str = ""
    value: float = 0.0
    threshold_per_hour: float = 0.0
    threshold_share: float = 0.0
    max_metric: str = ""
    load_metric: str = ""
    load_min: float = 0.0
    also_metric: str = ""        # state/total rules: a second reading of the same GPU and labels that must hold too
    also_op: str = ""
    also_value: float = 0.0


@dataclass(frozen=True)
class EventRule:
    kind: str
    component: str
    severity: str
    description: str
    action: str
    source: str


@dataclass(frozen=True)
class Rules:
    xids: Mapping[int, XidRule]
    xid_default: XidRule
    rules: tuple[CounterRule, ...]
    events: Mapping[str, EventRule]
    dedup_window_s: float
    application_repeat_count: int      # an application XID this many times (bursts) on one GPU ...
    application_repeat_window_s: float  # ... within this many seconds is escalated (NVSentinel: 2 in 24 h)
    application_burst_s: float          # reports closer than this are one burst (NVSentinel: 180 s)
    reboot_event_kind: str
    reboot_grace_s: float
    reboot_state_settle_s: float
    reboot_rules: frozenset[str]
    sources: Mapping[str, str]
    min_cover_s: float = 300.0
    variants: tuple[Variant, ...] = ()


@dataclass(frozen=True)
class Fault:
    component: str
    severity: str                # "critical" | "warning"
    subject: str                 # "GPU 3", "mlx5_0 port 1", "eth0"
    gpu: int                     # -1 when not a GPU
    sentence: str                # one line: what is wrong and the action
    action: str
    source: str                  # the cited source (URL or document name)
    evidence: dict = field(default_factory=dict)
    rule: str = ""               # the rule's name ("xid_79", "row_remap_pending", ...)


def _cite(sources: Mapping[str, str], key: str) -> str:
    return sources.get(key, key)


def _need(entry: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in entry:
        raise RulesError(f"{where} has no '{key}'.")
    return entry[key]


def _check(value: Any, allowed: Sequence[str], what: str, where: str) -> str:
    if value not in allowed:
        raise RulesError(f"{where} has {what} {value!r}; expected one of {', '.join(allowed)}.")
    return value


def load_rules(text: str | None = None, where: str = "common/hardware_faults.toml") -> Rules:
    """Parse and check the rules; a malformed file raises RulesError with one sentence."""
    if text is None:
        text = resources.files("gpuagent.common").joinpath("hardware_faults.toml").read_text()
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RulesError(f"{where} is not valid TOML: {exc}.") from None
    sources = {str(k): str(v) for k, v in doc.get("sources", {}).items()}
    xd = doc.get("xid_defaults", {})
    catalog = _cite(sources, "xid_catalog")
    default = XidRule(xid=-1, severity=_check(xd.get("severity", "warning"), SEVERITIES, "severity", f"{where} [xid_defaults]"),
                      action=str(xd.get("action", "contact support if it recurs")), application=bool(xd.get("application", False)),
                      description="not in the XID catalog table", source=catalog,
                      immediate=str(xd.get("immediate", "CONTACT_SUPPORT")), listed=False)
    xids: dict[int, XidRule] = {}
    for i, e in enumerate(doc.get("xid", [])):
        w = f"{where} [[xid]] #{i + 1}"
        n = int(_need(e, "xid", w))
        if n in xids:
            raise RulesError(f"{w} repeats XID {n}.")
        xids[n] = XidRule(xid=n, severity=_check(_need(e, "severity", w), XID_SEVERITIES, "severity", w),
                          action=str(_need(e, "action", w)), application=bool(e.get("application", False)),
                          description=str(_need(e, "description", w)),
                          source=_cite(sources, str(e.get("source", "xid_catalog"))),
                          immediate=str(e.get("immediate", "")), investigatory=str(e.get("investigatory", "")),
                          mnemonic=str(e.get("mnemonic", "")), applies_to=tuple(str(a) for a in e.get("applies_to", [])),
                          repeat_action=str(e.get("repeat_action", "")), ours=str(e.get("ours", "")))
    variants: list[Variant] = []
    for i, e in enumerate(doc.get("variant", [])):
        w = f"{where} [[variant]] #{i + 1}"
        kind = str(_need(e, "kind", w))
        v = Variant(kind=kind, xids=tuple(int(x) for x in e.get("xids", [])), attr=str(_need(e, "attr", w)),
                    value=str(_need(e, "value", w)),
                    severity=_check(_need(e, "severity", w), XID_SEVERITIES, "severity", w),
                    action=str(_need(e, "action", w)), description=str(_need(e, "description", w)),
                    source=_cite(sources, str(e.get("source", "xid_catalog"))))
        if kind == "xid" and (not v.xids or set(v.xids) - set(xids)):
            raise RulesError(f"{w} refines XIDs the table does not list: {sorted(set(v.xids) - set(xids)) or 'none given'}.")
        variants.append(v)
    rules: list[CounterRule] = []
    for i, e in enumerate(doc.get("rule", [])):
        w = f"{where} [[rule]] {e.get('name', '#' + str(i + 1))}"
        kind = _check(_need(e, "kind", w), KINDS, "kind", w)
        r = CounterRule(name=str(_need(e, "name", w)), component=_check(_need(e, "component", w), COMPONENTS, "component", w),
                        metric=str(_need(e, "metric", w)), kind=kind,
                        severity=_check(_need(e, "severity", w), SEVERITIES, "severity", w),
                        action=str(_need(e, "action", w)), source=_cite(sources, str(_need(e, "source", w))),
                        sentence=str(e.get("sentence", e["name"])),
                        labels=tuple(sorted((str(k), str(v)) for k, v in e.get("labels", {}).items())),
                        op=_check(e.get("op", "eq"), OPS, "op", w) if kind in ("state", "total") else "",
                        value=float(e.get("value", 0)), threshold_per_hour=float(e.get("threshold_per_hour", 0)),
                        threshold_share=float(e.get("threshold_share", 0)), max_metric=str(e.get("max_metric", "")),
                        load_metric=str(e.get("load_metric", "")), load_min=float(e.get("load_min", 0)),
                        also_metric=str(e.get("also_metric", "")),
                        also_op=_check(e.get("also_op", "gt"), OPS, "also_op", w) if e.get("also_metric") else "",
                        also_value=float(e.get("also_value", 0)))
        if len(r.labels) > 1:
            raise RulesError(f"{w} narrows by {len(r.labels)} labels; a rule takes at most one.")
        if kind == "rate" and r.threshold_per_hour <= 0:
            raise RulesError(f"{w} is a rate rule without a positive threshold_per_hour.")
        if kind == "share" and not 0 < r.threshold_share <= 1:
            raise RulesError(f"{w} is a share rule without a threshold_share in (0, 1].")
        if kind == "below_max" and not r.max_metric:
            raise RulesError(f"{w} is a below_max rule without a max_metric.")
        if r.also_metric and kind not in ("state", "total"):
            raise RulesError(f"{w} has an also_metric, which only state and total rules take.")
        if kind == "total" and r.labels:
            raise RulesError(f"{w} is a total rule (the sum over every label) that narrows by a label.")
        rules.append(r)
    if len({r.name for r in rules}) != len(rules):
        raise RulesError(f"{where} repeats a [[rule]] name.")
    events: dict[str, EventRule] = {}
    for i, e in enumerate(doc.get("event", [])):
        w = f"{where} [[event]] #{i + 1}"
        events[str(_need(e, "kind", w))] = EventRule(
            kind=str(e["kind"]), component=_check(_need(e, "component", w), COMPONENTS, "component", w),
            severity=_check(_need(e, "severity", w), SEVERITIES, "severity", w),
            description=str(_need(e, "description", w)), action=str(_need(e, "action", w)),
            source=_cite(sources, str(_need(e, "source", w))))
    rb = doc.get("reboot", {})
    unknown = set(rb.get("rules", [])) - {r.name for r in rules}
    if unknown:
        raise RulesError(f"{where} [reboot] names rules that do not exist: {', '.join(sorted(unknown))}.")
    for v in variants:
        if v.kind != "xid" and v.kind not in events:
            raise RulesError(f"{where} [[variant]] {v.attr} = {v.value!r} refines event kind {v.kind!r}, which has no [[event]].")
    return Rules(xids=xids, xid_default=default, rules=tuple(rules), events=events,
                 dedup_window_s=float(xd.get("dedup_window_s", 10)),
                 application_repeat_count=int(xd.get("application_repeat_count", 2)),
                 application_repeat_window_s=float(xd.get("application_repeat_window_s", 86400)),
                 application_burst_s=float(xd.get("application_burst_s", 180)),
                 reboot_event_kind=str(rb.get("event_kind", "agent_start")), reboot_grace_s=float(rb.get("grace_s", 600)),
                 reboot_state_settle_s=float(rb.get("state_settle_s", 120)),
                 reboot_rules=frozenset(rb.get("rules", [])), sources=sources,
                 min_cover_s=float(doc.get("min_cover_s", 300)), variants=tuple(variants))


@lru_cache(maxsize=1)
def rules() -> Rules:
    """The shipped rules, parsed once."""
    return load_rules()


def xid_rule(xid: int) -> XidRule:
    """The catalog entry for an XID; an unlisted XID gets the catalog's default bucket (warning, contact support)."""
    r = rules()
    hit = r.xids.get(int(xid))
    if hit is not None:
        return hit
    d = r.xid_default
    return XidRule(xid=int(xid), severity=d.severity, action=d.action, application=d.application,
                   description=d.description, source=d.source, immediate=d.immediate, listed=False)


def xid_description(xid: int) -> str:
    """The catalog's description of an XID it lists, "" for one it does not: the words the GPU sampler's
    ``xid`` events and the exporter's err_msg carry, so node, collector and /metrics name an XID alike."""
    hit = rules().xids.get(int(xid))
    return hit.description if hit is not None else ""


def rule_rows() -> list[dict[str, Any]]:
    """The counter/state rules as flat rows (for the collector's temp table)."""
    reboot = rules().reboot_rules
    return [{"name": r.name, "component": r.component, "metric": r.metric, "kind": r.kind, "severity": r.severity,
             "action": r.action, "source": r.source, "sentence": r.sentence,
             "label_key": r.labels[0][0] if r.labels else "", "label_value": r.labels[0][1] if r.labels else "",
             "op": r.op, "value": r.value,
             "threshold_per_hour": r.threshold_per_hour, "threshold_share": r.threshold_share,
             "max_metric": r.max_metric, "load_metric": r.load_metric, "load_min": r.load_min,
             "reboot_explains": r.name in reboot, "also_metric": r.also_metric, "also_op": r.also_op,
             "also_value": r.also_value} for r in rules().rules]


def xid_rows() -> list[dict[str, Any]]:
    """The XID catalog, the fault events and their variants as flat rows (for the collector's temp table):
    a variant row has the attribute (attr_key = attr_value) that selects it, a plain row attr_key ''."""
    r = rules()
    out = [{"kind": "xid", "xid": x.xid, "component": "xid", "severity": x.severity, "application": x.application,
            "description": x.description, "action": x.action, "source": x.source, "attr_key": "", "attr_value": "",
            "immediate": x.immediate, "investigatory": x.investigatory,
            "repeat_action": x.repeat_action or x.action} for x in r.xids.values()]
    out += [{"kind": e.kind, "xid": -1, "component": e.component, "severity": e.severity, "application": False,
             "description": e.description, "action": e.action, "source": e.source, "attr_key": "", "attr_value": "",
             "immediate": "", "investigatory": "", "repeat_action": e.action} for e in r.events.values()]
    for v in r.variants:
        for n in (v.xids if v.kind == "xid" else (-1,)):
            base = r.xids[n] if v.kind == "xid" else None
            comp = "xid" if v.kind == "xid" else r.events[v.kind].component
            out.append({"kind": v.kind, "xid": n, "component": comp, "severity": v.severity, "application": False,
                        "description": (base.description + ", " if base else "") + v.description,
                        "action": v.action, "source": v.source, "attr_key": v.attr, "attr_value": v.value,
                        "immediate": base.immediate if base else "", "investigatory": base.investigatory if base else "",
                        "repeat_action": v.action})
    return out


def variant_of(kind: str, xid: int | None, attrs: Mapping[str, Any] | None) -> Variant | None:
    """The variant an event's decoded attributes select (first listed wins), None for the plain row."""
    attrs = attrs or {}
    for v in rules().variants:
        if v.kind == kind and (kind != "xid" or xid in v.xids) and str(attrs.get(v.attr, "")) == v.value:
            return v
    return None


# ------------------------------------------------------------------------------------------ evaluation

def subject_of(metric: str, gpu: int, labels: Mapping[str, str]) -> str:
    """How a fault names what it is about: "GPU 3", "mlx5_0 port 1", "eth0"."""
    if metric.startswith("ib_"):
        return f"{labels.get('device', '?')} port {labels.get('port', '?')}"
    if metric.startswith("net_"):
        return labels.get("device", "?")
    return f"GPU {gpu}" if gpu >= 0 else "host"


def _matches(labels: tuple[tuple[str, str], ...], want: tuple[tuple[str, str], ...]) -> bool:
    have = dict(labels)
    return all(have.get(k) == v for k, v in want)


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def _evaluate(r: CounterRule, key: SeriesKey, value: float, latest: Mapping[SeriesKey, float],
              previous: Mapping[SeriesKey, float] | None, window_s: float) -> tuple[bool, dict, str] | None:
    """(fires, evidence, what) for one series, or None when the rule cannot judge it."""
    metric, gpu, labels = key
    if r.kind in ("state", "total"):
        if r.kind == "total":
            value = sum(v for (m, g, _l), v in latest.items() if m == metric and g == gpu)
        fires = _holds(r.op, value, r.value)
        ev: dict[str, Any] = {"value": value}
        if r.also_metric:
            also = latest.get((r.also_metric, gpu, labels))
            if also is None:
                return None
            ev["also"] = also
            fires = fires and _holds(r.also_op, also, r.also_value)
        return fires, ev, f"{r.sentence} (value {_fmt(value)}" + (f", {_fmt(ev['also'])}" if r.also_metric else "") + ")"
    if r.kind == "below_max":
        mx = latest.get((r.max_metric, gpu, labels))
        if mx is None or mx <= 0 or value <= 0:
            return None
        ev = {"value": value, "max": mx}
        if r.load_metric:
            load = latest.get((r.load_metric, gpu, ()))
            if load is None:
                return None
            ev["load"] = load
            if load < r.load_min:
                return False, ev, ""
        return value < mx, ev, f"{r.sentence} ({_fmt(value)} of {_fmt(mx)})"
    if previous is None or window_s <= 0:
        return None
    before = previous.get(key)
    if before is None:
        return None
    delta = value - before
    ev = {"before": before, "after": value, "increase": delta, "window_s": window_s}
    cover_s = max(window_s, rules().min_cover_s)   # as the collector: no rate from two samples seconds apart
    if delta < 0:                      # a reset (driver reload, reboot): never fires
        ev["reset"] = True
        return False, ev, ""
    if r.kind == "any_increment":
        return delta >= 1, ev, f"{r.sentence} (+{_fmt(delta)} in {_fmt(window_s)} s)"
    if r.kind == "rate":
        per_hour = delta / cover_s * 3600.0
        ev["per_hour"] = per_hour
        ev["threshold_per_hour"] = r.threshold_per_hour
        return delta > 0 and per_hour >= r.threshold_per_hour, ev, \
            f"{r.sentence} ({_fmt(per_hour)}/h, threshold {_fmt(r.threshold_per_hour)}/h)"
    share = delta / cover_s
    ev["share"] = share
    ev["threshold_share"] = r.threshold_share
    return share >= r.threshold_share, ev, f"{r.sentence} ({share:.0%} of {_fmt(window_s)} s)"


def _holds(op: str, a: float, b: float) -> bool:
    return {"eq": a == b, "ne": a != b, "lt": a < b, "ge": a >= b, "gt": a > b}[op]


def _xid_number(e: Mapping[str, Any]) -> int | None:
    attrs = e.get("attrs") or {}
    for v in (e.get("value"), attrs.get("xid")):
        try:
            if v is not None and v != "":
                return int(float(v))
        except (TypeError, ValueError):
            continue
    return None


def _clusters(ts: list[int], window_ns: int) -> int:
    """How many reports remain after merging each one within window_ns of the report before it (as the
    collector's 70_hardware_fault.sql does)."""
    n, last = 0, None
    for t in sorted(ts):
        if last is None or t - last > window_ns:
            n += 1
        last = t
    return n


def _event_faults(rs: Rules, events: Sequence[Mapping[str, Any]], now_ns: int,
                  since_ns: int | None = None) -> list[Fault]:
    groups: dict[tuple[str, int, int, str], list[Mapping[str, Any]]] = {}
    for e in events:
        kind = str(e.get("kind", ""))
        gpu = int(e.get("gpu", -1) if e.get("gpu") is not None else -1)
        n = _xid_number(e) if kind == "xid" else -1
        if (kind == "xid" and n is None) or (kind != "xid" and kind not in rs.events):
            continue
        v = variant_of(kind, n, e.get("attrs"))
        groups.setdefault((kind, gpu, n, f"{v.attr}={v.value}" if v else ""), []).append(e)
    out = []
    window_ns = int(rs.dedup_window_s * 1e9)
    for (kind, gpu, n, vkey), evs in sorted(groups.items()):
        if since_ns is not None and max(int(e.get("ts_ns", 0)) for e in evs) < since_ns:
            continue                   # history only (an application XID's earlier burst): nothing new
        attrs0 = evs[0].get("attrs") or {}
        v = variant_of(kind, n, attrs0) if vkey else None
        subject = f"GPU {gpu}" if gpu >= 0 else str(attrs0.get("pci_bus_id") or attrs0.get("device") or "host")
        count = _clusters([int(e.get("ts_ns", 0)) for e in evs], window_ns)
        sources = sorted({str((e.get("attrs") or {}).get("source", "")) for e in evs} - {""})
        ev: dict[str, Any] = {"count": count, "reports": len(evs), "sources": sources,
                              "first_ts_ns": min(int(e.get("ts_ns", 0)) for e in evs),
                              "last_ts_ns": max(int(e.get("ts_ns", 0)) for e in evs)}
        if v is not None:
            ev["variant"] = {v.attr: v.value}
        if kind == "xid":
            x = xid_rule(n)
            severity, action, source = (v.severity, v.action, v.source) if v else (x.severity, x.action, x.source)
            description = x.description + (f", {v.description}" if v else "")
            ev.update(xid=n, description=description, listed=x.listed,
                      resolution_bucket_immediate_action=x.immediate,
                      resolution_bucket_investigatory_action=x.investigatory)
            if severity == "ignore":
                continue               # the catalog's IGNORE bucket: the event is stored, nothing to act on
            if x.application and v is None:
                jobs = sorted({str((e.get("attrs") or {}).get("job_id") or (e.get("attrs") or {}).get("pid") or "")
                               for e in evs} - {""})
                recent = [int(e.get("ts_ns", 0)) for e in evs
                          if now_ns - int(e.get("ts_ns", 0)) <= rs.application_repeat_window_s * 1e9]
                bursts = _clusters(recent, int(rs.application_burst_s * 1e9))
                ev.update(jobs=jobs, bursts=bursts)
                if bursts < rs.application_repeat_count:
                    continue           # once: the job's error, not the hardware's
                action = x.repeat_action or action
                what = (f"XID {n} ({description}) {bursts} times on this GPU within "
                        f"{rs.application_repeat_window_s / 3600:.0f} h, so it may be the GPU's, not the job's")
            else:
                what = f"XID {n} ({description})" + (f" x{count}" if count > 1 else "")
                if not x.listed:
                    what += " (not in our copy of NVIDIA's XID catalog)"
            out.append(Fault("xid", severity, subject, gpu, f"{subject}: {what}: {action}.", action, source,
                             ev, f"xid_{n}"))
        else:
            er = rs.events[kind]
            severity, action, source = (v.severity, v.action, v.source) if v else (er.severity, er.action, er.source)
            if severity == "ignore":
                continue
            what = er.description + (f" ({v.description})" if v else "") + (f" x{count}" if count > 1 else "")
            out.append(Fault(er.component, severity, subject, gpu, f"{subject}: {what}: {action}.", action,
                             source, ev, kind))
    return out


def _is_reboot(e: Mapping[str, Any], grace_ns: int) -> bool:
    """An agent_start is a reboot when the node booted within grace_s before it (attr boot_ns); without the
    attr (older agents) every start counts. The collector's 70_hardware_fault.sql decides alike."""
    boot = (e.get("attrs") or {}).get("boot_ns")
    try:
        return boot in (None, "") or int(e.get("ts_ns", 0)) - int(boot) <= grace_ns
    except (TypeError, ValueError):
        return True


def node_faults(latest: Mapping[SeriesKey, float], previous: Mapping[SeriesKey, float] | None,
                events: Sequence[Mapping[str, Any]], window_s: float, now_ns: int | None = None,
                events_since_ns: int | None = None) -> list[Fault]:
    """The hardware faults of one node, critical first.

    latest/previous: {(metric, gpu, sorted label tuple): value} (agent/samplers/sampling.py ListSink.metrics());
    previous is the reading window_s seconds earlier, or None (then counter rules cannot judge and stay
    quiet; state and below-max rules still apply). events: recent events as dicts {kind, gpu, value,
    attrs, ts_ns}; now_ns: when ``latest`` was read (default: now); events_since_ns: a group of reports with
    none at or after it raises nothing (older events only count an application XID's repeats). A counter lower than before (a reset)
    never fires; an agent_start (the node restarted) silences the link-flap rules that a planned reboot
    explains, as the collector does: a state rule while the reading is within state_settle_s of it, a counter rule
    when it falls inside the window (or within grace_s before it).
    """
    rs = rules()
    now = time.time_ns() if now_ns is None else int(now_ns)
    grace_ns, window_ns = int(rs.reboot_grace_s * 1e9), int(max(window_s, 0) * 1e9)
    boots = [int(e.get("ts_ns", 0)) for e in events if str(e.get("kind")) == rs.reboot_event_kind
             and _is_reboot(e, grace_ns)]
    state_boot = any(abs(now - t) <= int(rs.reboot_state_settle_s * 1e9) for t in boots)
    counter_boot = any(now - window_ns - grace_ns <= t <= now + grace_ns for t in boots)
    faults: list[Fault] = []
    for r in rs.rules:
        if r.name in rs.reboot_rules and (state_boot if r.kind == "state" else counter_boot):
            continue
        totalled: set[int] = set()
        for key, value in latest.items():
            metric, gpu, labels = key
            if metric != r.metric or not _matches(labels, r.labels):
                continue
            if r.kind == "total":
                if gpu in totalled:
                    continue           # one judgement per GPU: the sum over every label
                totalled.add(gpu)
            got = _evaluate(r, key, float(value), latest, previous, window_s)
            if got is None or not got[0]:
                continue
            _, ev, what = got
            lab = {} if r.kind == "total" else dict(labels)
            subject = subject_of(metric, gpu, lab)
            if metric == "gpu_nvlink_errors_total" or metric == "gpu_nvlink_link_up":
                subject = f"GPU {gpu} NVLink {lab.get('link', '?')}"
            ev = {"metric": metric, "labels": lab, **ev}
            faults.append(Fault(r.component, r.severity, subject, gpu if metric.startswith("gpu_") else -1,
                                f"{subject}: {what}: {r.action}.", r.action, r.source, ev, r.name))
    faults += _event_faults(rs, events, now, events_since_ns)
    order = {c: i for i, c in enumerate(COMPONENTS)}
    faults.sort(key=lambda f: (SEVERITIES.index(f.severity), order[f.component], f.gpu, f.subject, f.rule))
    return faults
