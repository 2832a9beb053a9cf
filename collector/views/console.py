"""The collector's live web console: one read-only screen over the fleet, from fleet to pool to node to GPU
to job, served from the collector process (``serve --ui-listen HOST:PORT``, off by default).

Why plain HTML with small inline scripts: fleets are often offline, so nothing may come from a CDN or be
fetched at run time, and a page rendered on the server from the rollups is fast at 10,000 nodes without a
front-end build. The plots are the report's own SVG (views/svgplot.py); the fleet heatmap is one canvas drawn
from the page's data. The Content-Security-Policy forbids every fetch, so a page cannot load anything else.

Auth is the collector's: a token with the ``query`` (or ``admin``) role, sent as ``Authorization: Bearer`` or
exchanged once at ``/login?token=...`` for an HttpOnly session cookie (as Jupyter does), so a browser can open
it. No token: 401 and no data; a token without the query role (an agent's ingest token): 403. Beyond loopback
the console refuses to start without auth. Only GET and HEAD are served: there is nothing to write.
"""

from __future__ import annotations

import html
import json
import logging
import secrets
import ssl
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

from gpuagent.collector.ingest.auth import ANYONE, AuthPolicy, Principal, peer_cert_principal
from gpuagent.collector.views import console_data as cd
from gpuagent.collector.views import svgplot
from gpuagent.common.errors import first_line
from gpuagent.common.hostport import AddressError, is_loopback, split_host_port
from gpuagent.proto.wire import AUTHORIZATION_KEY, BEARER_PREFIX

log = logging.getLogger("gpuagent.collector.console")

COOKIE = "gpuagent_console"
FLEET_CACHE_S = 30.0          # the fleet page's figures are reused this long (see TtlCache)
FINDING_LEAD_S = 6 * 3600     # a finding's node link opens its window from this long before it was first seen
SESSION_S = 12 * 3600
CSP = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")


class ConsoleError(RuntimeError):
    """The console cannot start; one sentence."""


def esc(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def when(t: float | None) -> str:
    return "" if t is None else datetime.fromtimestamp(float(t), timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def num(v: Any, digits: int = 1) -> str:
    if v is None:
        return "–"
    try:
        f = float(v)
    except (TypeError, ValueError):
        return esc(v)
    return f"{f:,.{digits}f}"


def link(path: str, text: Any, **query: Any) -> str:
    q = {k: v for k, v in query.items() if v not in (None, "")}
    return f'<a href="{esc(path + ("?" + urlencode(q) if q else ""))}">{esc(text)}</a>'


def node_link(node_id: str, text: Any, start: float | None = None, end: float | None = None) -> str:
    return link(f"/node/{quote(node_id, safe='')}", text, start=None if start is None else int(start),
                end=None if end is None else int(end) + 60)


def job_link(job_id: str) -> str:
    return link(f"/job/{quote(job_id, safe='')}", job_id)


def table(headers: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def pager(path: str, page: cd.Page, **query: Any) -> str:
    if page.pages <= 1:
        return f'<p class="pager">{page.total} rows</p>'
    prev = link(path, "« previous", page=page.page - 1, **query) if page.page > 1 else ""
    nxt = link(path, "next »", page=page.page + 1, **query) if page.page < page.pages else ""
    return f'<p class="pager">{prev} page {page.page} of {page.pages} ({page.total} rows) {nxt}</p>'


STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222}header{background:#1d3557;color:#fff;
padding:8px 16px}header a{color:#fff;margin-right:16px}main{padding:8px 16px}table{border-collapse:collapse;
margin:6px 0 14px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f1f3f5}.synthetic{background:#ffe066;color:#000;padding:6px 16px;font-weight:600}
.critical{color:#b00020;font-weight:600}.warning{color:#a15c00}.info{color:#555}pre{max-height:18em;overflow:auto;
background:#f8f9fa;padding:6px;margin:0}.cards span{display:inline-block;border:1px solid #ccc;padding:6px 12px;
margin:0 8px 8px 0}.pager{color:#555}footer{color:#777;padding:8px 16px;font-size:12px}canvas{border:1px solid #ccc;cursor:pointer}svg{display:inline-block;
vertical-align:top}"""


FOOTER_JS = ("<script>addEventListener('load',function(){setTimeout(function(){var n=performance.getEntriesByType("
             "'navigation')[0],f=document.getElementById('timing');f.dataset.loadMs=Math.round(n&&n.loadEventEnd?"
             "n.loadEventEnd:performance.now());f.textContent='server '+f.dataset.serverMs+' ms; loaded in your browser "
             "in '+f.dataset.loadMs+' ms';},0);});</script>")


def page_html(title: str, body: str, synthetic: int) -> str:
    banner = (f'<div class="synthetic" id="synthetic">SYNTHETIC data: {synthetic} node(s) come from gpuagent-sim '
              "or a synthetic fixture; nothing on them is a measurement.</div>") if synthetic else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)} · gpuagent</title>'
            f'<meta http-equiv="refresh" content="60"><style>{STYLE}</style></head><body>'
            f'<header><b>gpuagent</b> &nbsp; {link("/", "Fleet")}{link("/findings", "Findings")}</header>{banner}'
            f'<main><h1>{esc(title)}</h1>{body}</main></body></html>')


# ------------------------------------------------------------------------------------------ views

class TtlCache:
    """The fleet page's figures, computed at most once every ``ttl_s`` per metric and window: they span up to a
    day of rollups, so any number of people with the page open (it reloads every minute) cost one read."""

    def __init__(self, ttl_s: float = FLEET_CACHE_S):
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._at: dict[str, tuple[float, Any]] = {}

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        with self._lock:
            hit = self._at.get(key)
            if hit and time.monotonic() - hit[0] < self.ttl_s:
                return hit[1]
        value = compute()
        with self._lock:
            self._at[key] = (time.monotonic(), value)
        return value


def view_fleet(r: cd.Reader, q: dict[str, str], cache: TtlCache | None = None) -> tuple[str, str]:
    metric = q.get("metric") or "gpu_util_percent"
    if metric not in cd.HEATMAP_METRICS:
        raise ValueError(f"metric {metric!r} is not one the heatmap offers ({', '.join(cd.HEATMAP_METRICS)})")
    window = q.get("window") or cd.FLEET_WINDOW_DEFAULT
    if window not in cd.FLEET_WINDOWS_S:
        raise ValueError(f"window {window!r} is not one the fleet page offers ({', '.join(cd.FLEET_WINDOWS_S)})")
    window_s = cd.FLEET_WINDOWS_S[window]
    compute = lambda: cd.fleet(r, metric, window_s)  # noqa: E731
    d = cache.get(f"{metric} {window}", compute) if cache is not None else compute()
    cards = "".join(f'<span class="{s}" id="open-{s}">{d["severities"].get(s, 0)} {s}</span>' for s in cd.SEVERITIES)
    pools = table(["pool", "nodes", "GPUs", f"GPU-hours ({window})", "effective GPU-hours", "lost GPU-hours",
                   "effective util %", "open flags", "virtualized nodes", "idle GPU-minutes %"],
                  [[link(f"/pool/{quote(p['pool'], safe='')}", p["pool"]), num(p.get("nodes"), 0), num(p.get("gpus"), 0),
                    num(p.get("gpu_hours")), num(p.get("effective_gpu_hours")),
                    f'<span class="lost" data-pool="{esc(p["pool"])}">{num(p["lost_gpu_hours"])}</span>',
                    num(p.get("effective_util_percent")), num(p["open_flags"], 0), num(p["virtualized_nodes"], 0),
                    num(p["idle_minutes_percent"])] for p in d["pools"]], "pools")
    kinds = table(["finding kind", "severity", "open"],
                  [[link("/findings", k["kind"], kind=k["kind"], severity=k["severity"]),
                    f'<span class="{esc(k["severity"])}">{esc(k["severity"])}</span>', num(k["n"], 0)]
                   for k in d["kinds"]])
    options = "".join(f'<option{" selected" if m == metric else ""}>{esc(m)}</option>' for m in cd.HEATMAP_METRICS)
    # compact for 10,000 nodes: [node_id, hostname or 0 when it is the node_id, pool index, value]
    pool_names = sorted({c["pool"] for c in d["cells"]})
    index = {name: i for i, name in enumerate(pool_names)}
    cells = [[c["node_id"], 0 if c["hostname"] in (None, c["node_id"]) else c["hostname"], index[c["pool"]],
              None if c["value"] is None else round(float(c["value"]), 1)] for c in d["cells"]]
    data = json.dumps(cells, separators=(",", ":")).replace("</", "<\\/")
    pools_js = json.dumps(pool_names).replace("</", "<\\/")
    vmax = 100.0 if metric.endswith("_percent") else max([c[3] for c in cells if c[3] is not None] or [1.0])
    heat = f"""<form method="get" action="/"><input type="hidden" name="window" value="{esc(window)}"><label>heatmap
of <select name="metric" onchange="this.form.submit()">{options}</select></label> (each node's average over the newest
{cd.HEATMAP_S // 60} minutes of the rollups; click a cell for the node)</form><canvas id="heatmap" width="960" height="40"></canvas>
<p id="heatmap-note">{len(cells)} nodes with {esc(metric)} in the newest {cd.HEATMAP_S // 60} minutes; red is 0,
green {num(vmax, 0)}, grey no data</p>
<script>(function(){{var d={data},pools={pools_js},vmax={vmax},c=document.getElementById('heatmap'),x=c.getContext('2d');
var cols=Math.max(8,Math.min(96,Math.ceil(Math.sqrt(d.length*2)))),w=Math.min(48,Math.floor(960/cols)),h=Math.max(6,w-2);
c.height=Math.max(40,Math.ceil(d.length/cols)*h);function col(v){{if(v===null)return'#ccc';var f=Math.max(0,
Math.min(1,v/vmax));return'rgb('+Math.round(200-160*f)+','+Math.round(50+100*f+50*Math.sin(f*3.14))+',45)';}}
d.forEach(function(e,i){{x.fillStyle=col(e[3]);x.fillRect((i%cols)*w,Math.floor(i/cols)*h,w-1,h-1);}});
c.onclick=function(ev){{var r=c.getBoundingClientRect(),i=Math.floor((ev.clientY-r.top)/h)*cols+Math.floor(
(ev.clientX-r.left)/w);if(d[i])location.href='/node/'+encodeURIComponent(d[i][0]);}};
c.onmousemove=function(ev){{var r=c.getBoundingClientRect(),i=Math.floor((ev.clientY-r.top)/h)*cols+Math.floor(
(ev.clientX-r.left)/w);c.title=d[i]?(d[i][1]||d[i][0])+' ('+pools[d[i][2]]+'): '+d[i][3]:'';}};}})();</script>"""
    windows = " · ".join(esc(w) if w == window else link("/", w, window=w, metric=metric) for w in cd.FLEET_WINDOWS_S)
    body = (f'<p>{num(d["nodes"], 0)} nodes; data up to {esc(when(d["end"]))}. Open findings by severity:</p>'
            f'<div class="cards">{cards}</div>'
            f'<h2>Pools</h2><p id="pool-window">GPU-hours and utilization over the {esc(window)} before the newest '
            f"rollup minute; lost GPU-hours are GPU-hours times (1 - utilization). Window: {windows}. A longer "
            f"window reads more rollup rows.</p>{pools}<h2>Open findings by kind</h2>{kinds}<h2>Nodes</h2>{heat}")
    return "Fleet", body


def view_findings(r: cd.Reader, q: dict[str, str]) -> tuple[str, str]:
    kind, severity, pool, state = q.get("kind", ""), q.get("severity", ""), q.get("pool", ""), q.get("state", "open")
    if state not in ("open", "closed"):
        raise ValueError(f"state {state!r} is not open or closed")
    page = cd.findings(r, kind, severity, pool, _page(q), state)
    sel = lambda name, cur, opts: (f'<select name="{name}"><option value="">any {name}</option>' + "".join(  # noqa: E731
        f'<option{" selected" if o == cur else ""}>{esc(o)}</option>' for o in opts) + "</select>")
    form = (f'<form method="get" action="/findings">{sel("kind", kind, cd.finding_kinds(r))} '
            f'{sel("severity", severity, cd.SEVERITIES)} {sel("pool", pool, cd.pools(r))} '
            f'{sel("state", state, ("open", "closed"))} <button>filter</button></form>')
    rows = [[f'<span class="{esc(f["severity"])}">{esc(f["severity"])}</span>', esc(f["kind"]),
             node_link(f["node_id"], f["hostname"] or f["node_id"], f["first_seen"] - FINDING_LEAD_S, f["last_seen"])
             if f["node_id"] else esc(f["scope"]), esc(f["pool"]), esc(when(f["first_seen"])), esc(when(f["last_seen"])),
             " ".join(job_link(j) for j in f["jobs"]), esc(f["sentence"])] for f in page.rows]
    body = (form + table(["severity", "kind", "node", "pool", "first seen", "last seen", "jobs", "finding"], rows,
                         "findings") + pager("/findings", page, kind=kind, severity=severity, pool=pool, state=state))
    return f"Findings ({state})", body


def view_pool(r: cd.Reader, name: str, q: dict[str, str]) -> tuple[str, str]:
    d = cd.pool(r, name, _page(q))
    rows = [[node_link(n["node_id"], n["hostname"] or n["node_id"]), num(n["gpu_count"], 0), esc(n["gpu_model"]),
             "yes" if n["virtualized"] else "no", num(n["gpu_util_percent"]), num(n["open_flags"], 0),
             esc(when(n["last_seen"]))] for n in d["nodes"].rows]
    body = (link("/findings", "open findings of this pool", pool=name) +
            table(["node", "GPUs", "GPU model", "virtualized", "GPU util % (newest hour)", "open flags", "last seen"],
                  rows, "nodes") + pager(f"/pool/{quote(name, safe='')}", d["nodes"]))
    return f"Pool {name}", body


def view_node(r: cd.Reader, node_id: str, q: dict[str, str]) -> tuple[str, str] | None:
    d = cd.node(r, node_id, _float(q.get("start")), _float(q.get("end")))
    if d is None:
        return None
    i = d["info"]
    facts = table(["pool", "provider", "GPUs", "GPU model", "driver", "virtualized", "kernel", "last seen"],
                  [[link(f"/pool/{quote(i['pool'] or '(no pool)', safe='')}", i["pool"] or "(no pool)"),
                    esc(i["provider"]), num(i["gpu_count"], 0), esc(i["gpu_model"]), esc(i["driver_version"]),
                    esc(i["virt_type"] or ("yes" if i["virtualized"] else "no")), esc(i["kernel"]),
                    esc(when(i["last_seen_s"]))]])
    gpus = table(["GPU", "name", "PCIe", "memory GiB", "util % (window)"],
                 [[num(g["gpu"], 0), esc(g["name"]), f'gen {esc(g["pcie_gen_current"])}/{esc(g["pcie_gen_max"])} '
                   f'x{esc(g["pcie_width_current"])}/{esc(g["pcie_width_max"])}',
                   num((g["memory_total_bytes"] or 0) / 2**30), num(g["gpu_util_percent"])] for g in d["gpus"]], "gpus")
    plots = "".join(svgplot.lines(f"plot-{m}", m, m, sorted(s.items())) for m, s in sorted(d["series"].items())) \
        or "<p>No per-minute rollups of GPU utilization, CPU or power for this node in the window.</p>"
    flags = table(["state", "severity", "kind", "component", "GPU", "first seen", "last seen", "what", "evidence"],
                  [[esc(f["state"]), f'<span class="{esc(f["severity"])}">{esc(f["severity"])}</span>', esc(f["kind"]),
                    esc(f["component"]), num(f["gpu"], 0) if f["gpu"] is not None else "host", esc(when(f["first_seen"])),
                    esc(when(f["last_seen"])), esc(f["sentence"]),
                    f'<details><summary>evidence</summary><pre>{esc(f["evidence"])}</pre></details>'] for f in d["flags"]],
                  "flags")
    actions = table(["when", "action", "mode", "kind", "severity", "outcome", "reason"],
                    [[esc(when(a["ts"])), esc(a["action"]), esc(a["mode"]), esc(a["kind"]), esc(a["severity"]),
                      esc(a["outcome"]), esc(a["reason"])] for a in d["actions"]])
    links = table(["peer", "probe", "send Gbit/s", "receive Gbit/s", "RTT p50 µs", "status", "measured"],
                  [[node_link(x["peer"], x["peer"]), esc(x["probe"]), num(x["send_gbits_per_s"]),
                    num(x["recv_gbits_per_s"]), num(x["rtt_p50_us"]), esc(x["status"]), esc(when(x["ended_at"]))]
                   for x in d["links"]], "links")
    probes = table(["probe", "metric", "median", "runs", "last run"],
                   [[esc(p["probe"]), esc(p["metric"]), num(p["value"], 2), num(p["runs"], 0), esc(when(p["last"]))]
                    for p in d["probes"]])
    jobs = table(["job", "name", "from", "to", "GPU util %"],
                 [[job_link(j["job_id"]), esc(j["job_name"]), esc(when(j["first_seen"])), esc(when(j["last_seen"])),
                   num(j["avg_gpu_util_percent"])] for j in d["jobs"]], "jobs")
    body = (f'<p>window {esc(when(d["start"]))} to {esc(when(d["end"]))}</p>{facts}<h2>GPUs</h2>{gpus}'
            f"<h2>Over time</h2>{plots}<h2>Findings' flags</h2>{flags}<h2>Jobs</h2>{jobs}<h2>Actions taken</h2>{actions}"
            f"<h2>Fabric links</h2>{links}<h2>Probes (median over the window and a day before)</h2>{probes}")
    return f"Node {i['hostname'] or node_id}", body


def view_job(r: cd.Reader, job_id: str, q: dict[str, str]) -> tuple[str, str] | None:
    d = cd.job(r, job_id)
    if d is None:
        return None
    first = d["nodes"][0]
    who = ", ".join(f"{k} {esc(first[v])}" for k, v in (("user", "user_name"), ("partition", "partition_name"),
                                                         ("account", "account"), ("namespace", "pod_namespace"),
                                                         ("pod", "pod_name")) if first.get(v))
    nodes = table(["node", "pool", "from", "to", "GPU util %", "world size"],
                  [[node_link(n["node_id"], n["hostname"] or n["node_id"], n["first_seen"], n["last_seen"]),
                    esc(n["pool"]), esc(when(n["first_seen"])), esc(when(n["last_seen"])),
                    num(n["avg_gpu_util_percent"]), num(n["world_size"], 0)] for n in d["nodes"]], "job-nodes")
    gpus = table(["node", "GPU", "GPU util %", "samples"],
                 [[node_link(g["node_id"], g["node_id"]), num(g["gpu"], 0), num(g["gpu_util_percent"]),
                   num(g["samples"], 0)] for g in d["gpus"]], "job-gpus")
    step = svgplot.lines("plot-step-time", "step time (median of ranks' p50)", "s",
                         [("step time", [(s["t"], s["step_time_s"]) for s in d["steps"]])])
    tput = svgplot.lines("plot-throughput", "throughput", "samples/s",
                         [("samples/s", [(s["t"], s["samples_per_s"]) for s in d["steps"]])])
    flags = table(["severity", "kind", "component", "node", "GPU", "state", "first seen", "what"],
                  [[f'<span class="{esc(f["severity"])}">{esc(f["severity"])}</span>', esc(f["kind"]),
                    esc(f["component"]), node_link(f["node_id"], f["hostname"] or f["node_id"], f["first_seen"]),
                    num(f["gpu"], 0) if f["gpu"] is not None else "host", esc(f["state"]), esc(when(f["first_seen"])),
                    esc(f["sentence"])] for f in d["flags"]], "job-flags")
    body = (f'<p>{esc(first["job_name"])} ({esc(first["source"])}) {who}; {esc(when(d["start"]))} to '
            f'{esc(when(d["end"]))}</p><h2>Nodes</h2>{nodes}<h2>GPUs</h2>{gpus}<h2>Step time and throughput</h2>'
            f"{step}{tput}<h2>Flags that touched it</h2>{flags}")
    return f"Job {job_id}", body


def _page(q: dict[str, str]) -> int:
    try:
        return max(1, int(q.get("page", "1")))
    except ValueError:
        raise ValueError(f"page {q.get('page')!r} is not a number") from None


def _float(v: str | None) -> float | None:
    if v in (None, ""):
        return None
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"{v!r} is not a time in epoch seconds") from None


# ------------------------------------------------------------------------------------------ server

class Console:
    """Routing, auth and sessions; one per collector."""

    def __init__(self, cursor_factory: Callable[[], Any], policy: AuthPolicy, fleet_cache_s: float | None = None):
        self.cursor_factory = cursor_factory
        self.policy = policy
        self._sessions: dict[str, tuple[Principal, float]] = {}
        self._lock = threading.Lock()
        self.served = 0
        self.fleet_cache = TtlCache(FLEET_CACHE_S if fleet_cache_s is None else fleet_cache_s)

    def principal(self, headers, cookie: str | None, peer_cert: dict | None = None) -> tuple[Principal | None, str]:
        """Who asks: a bearer header, else a session cookie, else a verified client certificate (HTTPS with
        the collector's client CA), by the same rules as the gRPC front door."""
        if not self.policy.enabled:
            return ANYONE, ""
        got = headers.get("Authorization")
        if got is not None:
            return self.policy.authenticate([(AUTHORIZATION_KEY, got)], None)
        if cookie:
            with self._lock:
                entry = self._sessions.get(cookie)
            if entry and entry[1] > time.time():
                return entry[0], ""
        if self.policy.client_certs:
            p = peer_cert_principal(peer_cert)
            if p is not None:
                return p, ""
        return None, ("this console needs a token with the query role: open /login?token=<token> once, or send "
                      "'Authorization: Bearer <token>'"
                      + (", or a client certificate with OU=query" if self.policy.client_certs else ""))

    def login(self, token: str) -> tuple[str | None, str]:
        p, why = self.policy.authenticate([(AUTHORIZATION_KEY, BEARER_PREFIX + token)], None) if self.policy.enabled \
            else (ANYONE, "")
        if p is None:
            return None, why
        sid = secrets.token_urlsafe(32)
        with self._lock:
            now = time.time()
            self._sessions = {k: v for k, v in self._sessions.items() if v[1] > now}
            self._sessions[sid] = (p, now + SESSION_S)
        return sid, ""

    def render(self, path: str, q: dict[str, str]) -> tuple[int, str]:
        t0 = time.perf_counter()
        code, text = self._render(path, q)
        # what the page cost: the server's time here, and the browser's own load time once it loaded
        ms = (time.perf_counter() - t0) * 1000
        return code, text.replace("</main>", f'</main><footer id="timing" data-server-ms="{ms:.0f}">{FOOTER_JS}'
                                  "</footer>", 1)

    def _render(self, path: str, q: dict[str, str]) -> tuple[int, str]:
        r = cd.Reader(self.cursor_factory)
        parts = [p for p in path.split("/") if p]
        if not parts:
            got = view_fleet(r, q, self.fleet_cache)
        elif parts == ["findings"]:
            got = view_findings(r, q)
        elif len(parts) == 2 and parts[0] == "pool":
            got = view_pool(r, unquote(parts[1]), q)
        elif len(parts) == 2 and parts[0] == "node":
            got = view_node(r, unquote(parts[1]), q)
        elif len(parts) == 2 and parts[0] == "job":
            got = view_job(r, unquote(parts[1]), q)
        else:
            return 404, page_html("Not found", f"<p>There is no page {esc(path)}.</p>", 0)
        if got is None:
            return 404, page_html("Not found", f"<p>{esc(parts[0])} {esc(parts[1])} is not in this collector's "
                                  "database.</p>", cd.synthetic_nodes(r))
        title, body = got
        return 200, page_html(title, body, cd.synthetic_nodes(r))


def _handler(console: Console):
    class Handler(BaseHTTPRequestHandler):
        server_version = "gpuagent-console"

        def log_message(self, fmt, *args):  # noqa: A002 - http.server's name
            log.debug("console %s", fmt % args)

        def _send(self, code: int, text: str, extra: dict[str, str] | None = None) -> None:
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Content-Security-Policy", CSP)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Cache-Control", "no-store")
            self.send_header("Referrer-Policy", "no-referrer")
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _cookie(self) -> str | None:
            for part in (self.headers.get("Cookie") or "").split(";"):
                k, _, v = part.strip().partition("=")
                if k == COOKIE:
                    return v
            return None

        def do_GET(self):  # noqa: N802 - http.server's name
            url = urlsplit(self.path)
            q = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if url.path == "/login":
                sid, why = console.login(q.get("token", ""))
                if sid is None:
                    return self._send(401, page_html("Login", f"<p>{esc(why)}.</p>", 0))
                return self._send(303, "", {"Location": "/", "Set-Cookie": f"{COOKIE}={sid}; HttpOnly; "
                                            f"SameSite=Strict; Path=/; Max-Age={SESSION_S}"})
            peer = self.connection.getpeercert() if isinstance(self.connection, ssl.SSLSocket) else None
            principal, why = console.principal(self.headers, self._cookie(), peer)
            if principal is None:
                return self._send(401, page_html("Login needed", f"<p>{esc(why)}.</p><form method='get' "
                                                 "action='/login'><input name='token' type='password' size='40'> "
                                                 "<button>open</button></form>", 0),
                                  {"WWW-Authenticate": 'Bearer realm="gpuagent console"'})
            if not principal.allows_role("query"):
                return self._send(403, page_html("Not allowed", f"<p>The console needs the query role, and "
                                                 f"{esc(principal.who)} has only "
                                                 f"{esc(', '.join(sorted(principal.roles)))}.</p>", 0))
            try:
                code, text = console.render(url.path, q)
            except ValueError as exc:
                code, text = 400, page_html("Bad request", f"<p>{esc(first_line(exc))}.</p>", 0)
            except Exception as exc:  # noqa: BLE001 - one page failing must not take the console down
                log.warning("console page %s failed: %s", url.path, first_line(exc))
                code, text = 503, page_html("Unavailable", f"<p>The page could not be read now: "
                                            f"{esc(first_line(exc))}.</p>", 0)
            console.served += 1
            self._send(code, text)

        do_HEAD = do_GET  # noqa: N815

        def _refuse(self):
            self._send(405, page_html("Read-only", "<p>The console is read-only: only GET and HEAD.</p>", 0),
                       {"Allow": "GET, HEAD"})

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

    return Handler


class _HttpsServer(ThreadingHTTPServer):
    """HTTPS with the handshake in each connection's own thread, so a slow or failed handshake (a
    certificate from another CA, a plain-HTTP client) never holds up the others."""

    handshake_timeout_s = 10.0

    def __init__(self, address, handler, tls):
        self.tls = tls
        super().__init__(address, handler)

    def finish_request(self, request, client_address):
        request.settimeout(self.handshake_timeout_s)
        try:
            request = self.tls.ssl_context().wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            log.debug("console TLS handshake with %s failed: %s", client_address[0], exc)
            request.close()
            return
        request.settimeout(None)
        try:
            super().finish_request(request, client_address)
        finally:
            self.shutdown_request(request)

    def handle_error(self, request, client_address):
        log.debug("console connection from %s ended with an error", client_address[0], exc_info=True)


class ConsoleServer:
    """The console's HTTP server (HTTPS when the collector has TLS files) on its own threads."""

    def __init__(self, console: Console, listen: str, tls=None):
        try:
            host, port = split_host_port(listen)
        except AddressError as exc:
            raise ConsoleError(f"--ui-listen {listen!r}: {exc}") from None
        if not is_loopback(host) and not console.policy.enabled:
            raise ConsoleError(f"the console on {listen} would show the fleet's data to anyone who can reach it: "
                               "give the collector a token (--token or --tokens-file) or a client CA "
                               "(--tls-client-ca), or listen on loopback")
        try:
            address = (host.strip("[]"), port)
            self.httpd = _HttpsServer(address, _handler(console), tls) if tls is not None \
                else ThreadingHTTPServer(address, _handler(console))
        except OSError as exc:
            raise ConsoleError(f"cannot listen on {listen} for the console: {exc.strerror or exc}") from None
        self.httpd.daemon_threads = True
        self.console = console
        self.port = self.httpd.server_address[1]
        self.address = f"{host}:{self.port}"
        self.scheme = "https" if tls is not None else "http"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="gpuagent-console", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)


def start_console(cursor_factory: Callable[[], Any], policy: AuthPolicy, listen: str,
                  fleet_cache_s: float | None = None, tls=None) -> ConsoleServer:
    """``tls``: the collector's TlsFiles (ingest/listen.py) to serve HTTPS with, or None for HTTP."""
    return ConsoleServer(Console(cursor_factory, policy, fleet_cache_s), listen, tls)
