"""``spokefs top URL``: a live view of a spoke in a plain terminal (works over SSH).

Each refresh reads the spoke's ``GET /v1/status`` and ``GET /metrics`` (the same client, token
and CA bundle as every other command) into a ``Sample``. ``frame(sample, prev)`` turns one
sample, and the one before it for rates, into a plain dict (what ``--json`` prints), and
``render(doc)`` into text; both are pure, so they are tested without a terminal or a spoke.

In a terminal, rich draws the frame (``rich.live.Live``: the alternate screen, no cursor, the
frame redrawn in place and cropped to the window as it is resized, the terminal given back on
exit); piped or ``--once``, the same text is printed plain, one frame after another. rich
reads no keys, so ``q`` is read here (the terminal in cbreak mode, a ``select`` with the
refresh interval as its timeout): a full TUI framework (textual) would do that too, at three
times rich's import cost and with an app model of its own, for one key.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from spokefs.tables import table
from spokefs.units import format_size

# name -> [(labels, value)] of every sample in a scrape.
Metrics = dict[str, list[tuple[dict[str, str], float]]]


@dataclass
class Sample:
    """One reading of a spoke: its status document and its metrics, and when."""

    url: str
    status: dict[str, Any]
    metrics: Metrics = field(default_factory=dict)
    time: float = 0.0


def parse_metrics(text: str) -> Metrics:
    """The samples of a Prometheus text exposition, by sample name (``_total``,
    ``_bucket``... included)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def total(metrics: Metrics, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when absent)."""
    return sum(v for lab, v in metrics.get(name, ())
               if all(lab.get(k) == want for k, want in labels.items()))


def by_label(metrics: Metrics, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for lab, v in metrics.get(name, ()):
        if label in lab:
            out[lab[label]] = out.get(lab[label], 0.0) + v
    return out


def quantile(buckets: Iterable[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of a cumulative histogram ((upper bound, count) pairs), linearly
    interpolated inside its bucket, as Prometheus's histogram_quantile does."""
    pts = sorted(buckets)
    if not pts or pts[-1][1] <= 0:
        return None
    rank = q * pts[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in pts:
        if count >= rank:
            if bound == float("inf"):
                return lo_bound  # past the last finite bucket: its bound is all we know
            span = count - lo_count
            return lo_bound + (bound - lo_bound) * ((rank - lo_count) / span if span else 1.0)
        lo_bound, lo_count = bound, count
    return None


def _buckets(metrics: Metrics, name: str) -> dict[float, float]:
    return {float(lab["le"]): v for lab, v in metrics.get(f"{name}_bucket", ()) if "le" in lab}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def frame(s: Sample, prev: Sample | None = None) -> dict[str, Any]:
    """What one refresh shows, as plain data: totals from ``s``, rates over the time since
    ``prev`` (None without one)."""
    st, m = s.status, s.metrics
    dt = s.time - prev.time if prev is not None and s.time > prev.time else 0.0

    def rate(name: str, **labels: str) -> float | None:
        if not dt or prev is None:
            return None
        return max(0.0, total(m, name, **labels) - total(prev.metrics, name, **labels)) / dt

    cache = st.get("cache") or {}
    hits, misses = float(st.get("hits") or 0), float(st.get("misses") or 0)
    recent = None
    if prev is not None:
        dh = hits - float(prev.status.get("hits") or 0)
        dm = misses - float(prev.status.get("misses") or 0)
        recent = _ratio(dh, dh + dm) if dh >= 0 and dm >= 0 else None

    link = st.get("link") or {}
    lat = _buckets(m, "spokefs_fetch_seconds")
    if prev is not None:  # latency of the fetches since the last refresh, when there were
        before = _buckets(prev.metrics, "spokefs_fetch_seconds")
        delta = {b: c - before.get(b, 0.0) for b, c in lat.items()}
        if delta.get(float("inf"), 0) > 0:
            lat = delta
    prefetched = total(m, "spokefs_upstream_bytes_total", reason="prefetch")
    used = total(m, "spokefs_prefetch_used_bytes_total")
    pf = st.get("prefetch") or {}

    asked = by_label(m, "spokefs_warm_blocks_total", "dataset")
    done = by_label(m, "spokefs_warm_done_blocks_total", "dataset")
    resident = (st.get("datasets") or {}).get("resident_bytes") or {}
    hm = (st.get("datasets") or {}).get("hits_misses") or {}
    capacity = float(cache.get("capacity_bytes") or 0)
    datasets = []
    for name in sorted(set(resident) | set(asked) | set(hm)):
        warm = None
        if name in asked:
            warm = {"blocks": int(asked[name]), "done": int(done.get(name, 0)),
                    "fraction": min(1.0, done.get(name, 0) / asked[name]) if asked[name]
                    else 1.0}
        h, mi = hm.get(name, (0, 0))
        datasets.append({"dataset": name, "resident_bytes": int(resident.get(name, 0)),
                         "share_of_cache": _ratio(resident.get(name, 0), capacity),
                         "hit_ratio": _ratio(h, h + mi) if h + mi else None,
                         "warm": warm})

    working_sets = []
    for j in pf.get("working_sets") or ():
        order = j.get("order") or {}
        working_sets.append({"dataset": j["dataset"], "job": j["job"],
                     "working_set_bytes": j.get("working_set_bytes"),
                     "kept_bytes": j.get("kept_bytes"),
                     "resident_bytes": j.get("resident_bytes"),
                     "resident_share": _ratio(j.get("resident_bytes") or 0,
                                              j.get("kept_bytes") or 0),
                     "order_read": order.get("read"), "order_positions": order.get("positions")})

    integrity = by_label(m, "spokefs_integrity_failures_total", "where")
    doc: dict[str, Any] = {
        "url": s.url, "time": s.time, "role": st.get("role"), "uptime_s": st.get("uptime_s"),
        "interval_s": dt or None,
        "cache": {"used_bytes": cache.get("data_bytes", cache.get("used_bytes")),
                  "capacity_bytes": cache.get("capacity_bytes"),
                  "fill": _ratio(float(cache.get("used_bytes") or 0), capacity),
                  "blocks": cache.get("blocks"), "policy": cache.get("policy"),
                  "writable": cache.get("writable"),
                  "pinned_bytes": int(cache.get("warm_pinned_bytes") or 0)
                  + int(pf.get("pinned_bytes") or 0)},
        "reads": {"hits": hits, "misses": misses, "hit_ratio": st.get("hit_ratio"),
                  "hit_ratio_recent": recent},
        "link": {"upstream": st.get("upstream"),
                 "state": "down" if st.get("upstream_error") else "up",
                 "error": st.get("upstream_error"),
                 "rtt_s": link.get("rtt_s"),
                 "delivery_rate_bytes_per_s": link.get("bandwidth_bytes_per_s"),
                 "window_bytes": link.get("window_bytes"),
                 "startup": link.get("startup"), "probing": link.get("probing"),
                 "inflight_requests": st.get("inflight"),
                 "inflight_bytes": st.get("inflight_bytes"),
                 "queued": st.get("queued"),
                 "fetch_p50_s": quantile(lat.items(), 0.5),
                 "fetch_p99_s": quantile(lat.items(), 0.99)},
        "traffic": {"upstream_demand_bytes": total(m, "spokefs_upstream_bytes_total",
                                                   reason="demand"),
                    "upstream_prefetch_bytes": prefetched,
                    "served_bytes": total(m, "spokefs_served_bytes_total"),
                    "short_circuit_bytes": total(m, "spokefs_short_circuit_bytes_total"),
                    "passthrough_bytes": total(m, "spokefs_passthrough_bytes_total"),
                    "upstream_bytes_per_s": rate("spokefs_upstream_bytes_total"),
                    "served_bytes_per_s": rate("spokefs_served_bytes_total")},
        "prefetch": {"prefetched_bytes": prefetched, "used_bytes": used,
                     "accuracy": _ratio(used, prefetched),
                     "inflight_bytes": pf.get("inflight_bytes")},
        "evictions": {"blocks": total(m, "spokefs_cache_evictions_total"),
                      "per_s": rate("spokefs_cache_evictions_total")},
        "errors": {"upstream": total(m, "spokefs_upstream_errors_total"),
                   "integrity_cache": integrity.get("cache", 0.0),
                   "integrity_upstream": integrity.get("upstream", 0.0),
                   "cache_write": total(m, "spokefs_cache_write_errors_total"),
                   "tasks": total(m, "spokefs_task_failures_total"),
                   "http_5xx": sum(v for lab, v in m.get("spokefs_requests_total", ())
                                   if lab.get("status", "").startswith("5"))},
        "datasets": datasets,
        "working_sets": working_sets,
    }
    tier = st.get("tier")
    if tier:  # a member of a spoke tier: the members, and what crosses between them
        got = by_label(m, "spokefs_tier_peer_bytes_total", "peer")
        failed = {}
        for lab, v in m.get("spokefs_tier_peer_requests_total", ()):
            if lab.get("outcome") in ("failed", "timed_out"):
                failed[lab.get("peer", "")] = failed.get(lab.get("peer", ""), 0.0) + v
        doc["tier"] = {
            "source": tier.get("source"), "refresh_error": tier.get("refresh_error"),
            "copies": tier.get("copies"), "copy_bytes": tier.get("copy_bytes"),
            "served_bytes": total(m, "spokefs_tier_served_bytes_total"),
            "served_bytes_per_s": rate("spokefs_tier_served_bytes_total"),
            "received_bytes_per_s": rate("spokefs_tier_peer_bytes_total"),
            "members": [{"url": x["url"], "state": x["state"], "share": x.get("share"),
                         "self": bool(x.get("self")),
                         "received_bytes": got.get(x["url"], 0.0),
                         "failed_requests": failed.get(x["url"], 0.0)}
                        for x in tier.get("members") or ()]}
    shares = [r for r in (st.get("datasets") or {}).get("shares") or ()
              if r.get("min_share") or r.get("max_share")]
    if shares:  # reserved shares and ceilings (--dataset-config), where the rules set them
        doc["shares"] = [{k: r.get(k) for k in ("dataset", "resident_bytes", "min_bytes",
                                                "max_bytes", "in_use", "share")}
                         for r in shares]
    if st.get("jobs"):  # training-side step reports, where jobs send them
        doc["training"] = [{k: j.get(k) for k in ("dataset", "job", "steps", "data_wait_share",
                                                   "utilisation")} for j in st["jobs"]]
    return doc


# -- text --------------------------------------------------------------------------------------
def _size(n: float | None) -> str:
    return "-" if n is None else format_size(n)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _rate(n: float | None) -> str:
    return "-" if n is None else f"{format_size(n)}/s"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.1f} ms"


def _n(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _uptime(s: float | None) -> str:
    if s is None:
        return "-"
    h, rest = divmod(int(s), 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def render(doc: dict[str, Any], note: str = "") -> str:
    """The frame as lines of plain text (no colours, no cursor moves)."""
    c, r, lk, t = doc["cache"], doc["reads"], doc["link"], doc["traffic"]
    pf, ev, er = doc["prefetch"], doc["evictions"], doc["errors"]
    clock = time.strftime("%H:%M:%S", time.localtime(doc["time"])) if doc["time"] else "-"
    lines = [f"spokefs top  {doc['url']}  {doc['role'] or '?'} up {_uptime(doc['uptime_s'])}"
             f"  {clock}  (q quits)" + (f"  {note}" if note else "")]
    lines.append(f"cache     {_size(c['used_bytes'])} of {_size(c['capacity_bytes'])} "
                 f"({_pct(c['fill'])})  {_n(c['blocks'])} blocks  policy {c['policy']}  "
                 f"pinned {_size(c['pinned_bytes'])}"
                 + ("" if c["writable"] in (True, None) else "  NOT WRITABLE (passing through)"))
    recent = ""
    if doc["interval_s"]:  # since the last refresh
        rr = r["hit_ratio_recent"]
        recent = f" (last {doc['interval_s']:.0f} s: {'no reads' if rr is None else _pct(rr)})"
    lines.append(f"reads     hit ratio {_pct(r['hit_ratio'])}{recent}  hits {_n(r['hits'])}  "
                 f"misses {_n(r['misses'])}")
    state = lk["state"].upper()
    if lk["state"] == "up" and (lk["startup"] or lk["probing"]):
        state += " (startup)" if lk["startup"] else " (probing rtt)"
    lines.append(f"link      {state}  {lk['upstream']}  rtt {_ms(lk['rtt_s'])}  delivery "
                 f"{_rate(lk['delivery_rate_bytes_per_s'])}  window {_size(lk['window_bytes'])}")
    if lk["error"]:
        lines.append(f"          error: {lk['error']}")
    lines.append(f"fetch     {_n(lk['inflight_requests'])} requests in flight "
                 f"({_size(lk['inflight_bytes'])}), queue {_n(lk['queued'])} blocks, "
                 f"latency p50 {_ms(lk['fetch_p50_s'])} p99 {_ms(lk['fetch_p99_s'])}")
    lines.append(f"traffic   from upstream {_size(t['upstream_demand_bytes'])} demand + "
                 f"{_size(t['upstream_prefetch_bytes'])} prefetch "
                 f"({_rate(t['upstream_bytes_per_s'])})  served {_size(t['served_bytes'])} "
                 f"({_rate(t['served_bytes_per_s'])})  short circuit "
                 f"{_size(t['short_circuit_bytes'])}")
    lines.append(f"prefetch  accuracy {_pct(pf['accuracy'])} ({_size(pf['used_bytes'])} of "
                 f"{_size(pf['prefetched_bytes'])} prefetched later read)  in flight "
                 f"{_size(pf['inflight_bytes'])}")
    per_s = "" if ev["per_s"] is None else f" ({ev['per_s']:.1f}/s)"
    lines.append(f"evictions {_n(ev['blocks'])} blocks{per_s}")
    lines.append(f"errors    upstream {_n(er['upstream'])}  integrity cache "
                 f"{_n(er['integrity_cache'])} upstream {_n(er['integrity_upstream'])}  "
                 f"cache writes {_n(er['cache_write'])}  tasks {_n(er['tasks'])}  "
                 f"HTTP 5xx {_n(er['http_5xx'])}")
    if doc["datasets"]:
        rows = []
        for d in doc["datasets"]:
            w = d["warm"]
            warm = "-" if w is None else (f"{_pct(w['fraction'])} ({w['done']}/{w['blocks']} "
                                          "blocks)" + (" done" if w["done"] >= w["blocks"]
                                                       else ""))
            rows.append([d["dataset"], _size(d["resident_bytes"]), _pct(d["share_of_cache"]),
                         _pct(d["hit_ratio"]), warm])
        lines += ["", table(rows, ["dataset", "resident", "of cache", "hit ratio", "warm-up"])]
    if doc["working_sets"]:
        rows = []
        for j in doc["working_sets"]:
            order = ("-" if j["order_positions"] is None
                     else f"{j['order_read']}/{j['order_positions']}")
            rows.append([f"{j['dataset']}/{j['job'] or '(no job name)'}",
                         _size(j["working_set_bytes"]),
                         _size(j["kept_bytes"]), _pct(j["resident_share"]), order])
        lines += ["", table(rows, ["job", "working set", "kept", "kept resident",
                                   "order read"])]
    if doc.get("shares"):
        rows = [[r["dataset"], _size(r["resident_bytes"]), _size(r["min_bytes"] or None),
                 _size(r["max_bytes"]),
                 "-" if r["in_use"] is None else "in use" if r["in_use"] else "idle",
                 {"over_max": "over its ceiling", "over": "over its reservation"}.get(
                     r["share"], "within its reservation")] for r in doc["shares"]]
        lines += ["", table(rows, ["dataset", "resident", "reserved", "ceiling", "use",
                                   "share"])]
    if doc.get("tier"):
        tr = doc["tier"]
        copies = (f"copies {_size(tr['copy_bytes'])}" if tr["copies"] else "no copies")
        lines += ["", f"tier      {len(tr['members'])} members ({tr['source']})  {copies}  "
                  f"served to members {_size(tr['served_bytes'])} "
                  f"({_rate(tr['served_bytes_per_s'])})  from members "
                  f"{_rate(tr['received_bytes_per_s'])}"
                  + (f"  LIST NOT REFRESHED: {tr['refresh_error']}"
                     if tr["refresh_error"] else "")]
        rows = [[x["url"] + ("  (this member)" if x["self"] else ""), x["state"],
                 _pct(x["share"]), "-" if x["self"] else _size(x["received_bytes"]),
                 "-" if x["self"] else _n(x["failed_requests"])] for x in tr["members"]]
        lines.append(table(rows, ["member", "state", "share", "got from it",
                                  "failed requests"]))
    if doc.get("training"):
        rows = [[f"{j['dataset']}/{j['job']}", _n(j["steps"]), _pct(j["data_wait_share"]),
                 _pct(j["utilisation"])] for j in doc["training"]]
        lines += ["", table(rows, ["training job", "steps", "data wait", "utilisation"])]
    return "\n".join(lines)


# -- reading a spoke -----------------------------------------------------------------------
def read_sample(base: str, deadline: float = 5.0) -> Sample:
    from spokefs.client.sync import Client

    client = Client(base, deadline=deadline, timeout=deadline)
    status = client.get_json("/v1/status")
    if status.get("role") != "spoke":
        from spokefs.errors import ConfigError

        raise ConfigError(f"{base} is a {status.get('role')}, not a spoke: spokefs top watches "
                          "a spoke (spokefs status URL shows a hub)")
    text = client.request("GET", "/metrics").data.decode()
    return Sample(base, status, parse_metrics(text), time.time())


# -- the live view ------------------------------------------------------------------------
# Words that mean trouble, in red on a terminal (the text itself is render()'s, unchanged).
_ALARM = r"\b(?:DOWN|down|suspect)\b|NOT WRITABLE|LIST NOT REFRESHED|cannot read"


def run(base: str, interval: float = 2.0, once: bool = False, as_json: bool = False,
        out: TextIO = sys.stdout) -> int:
    """Show ``base``'s spoke until ``q`` (or Ctrl-C); ``once``/``as_json``: one frame."""
    base = base.rstrip("/")
    if once or as_json:
        one = frame(read_sample(base))
        out.write(json.dumps(one, indent=2) + "\n" if as_json else render(one) + "\n")
        return 0
    if not out.isatty():  # piped: one frame after another, like top -b
        try:
            for text in _frames(base):
                out.write(text + "\n\n")
                out.flush()
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
        return 0
    return _live(base, interval, out)


def _frames(base: str) -> Iterator[str]:
    """The text of each refresh, forever; a spoke that cannot be read (restarting, the
    network) is noted on the last frame rather than ending the watch."""
    from spokefs.errors import ConfigError, SpokeError

    prev: Sample | None = None
    doc: dict[str, Any] | None = None
    while True:
        note = ""
        try:
            s = read_sample(base)
            doc, prev = frame(s, prev), s
        except ConfigError:
            raise  # not a spoke: no point watching
        except (SpokeError, OSError) as exc:
            note = f"cannot read {base}: {exc}"
        yield note if doc is None else render(doc, note)


def _live(base: str, interval: float, out: TextIO) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console(file=out, highlight=False, markup=False, emoji=False)
    keys = _Keys()
    try:
        with Live(console=console, screen=True, auto_refresh=False,
                  vertical_overflow="crop") as live:
            for text in _frames(base):
                view = Text(text, no_wrap=True, overflow="crop")
                view.stylize("bold", 0, text.find("\n") if "\n" in text else len(text))
                view.highlight_regex(_ALARM, "bold red")
                live.update(view, refresh=True)
                if keys.wait_for_quit(interval):
                    break
    except KeyboardInterrupt:
        pass
    finally:
        keys.restore()
    return 0


class _Keys:
    """Single key presses from the terminal (cbreak: no Enter needed), restored on exit."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.saved: list[Any] | None = None
        if sys.stdin.isatty():
            import termios
            import tty

            self.fd = sys.stdin.fileno()
            self.saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)

    def wait_for_quit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s; True once ``q`` is pressed (or stdin ends)."""
        if self.fd is None:
            time.sleep(timeout)
            return False
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            if not select.select([self.fd], [], [], left)[0]:
                return False
            ch = os.read(self.fd, 32)
            if not ch or b"q" in ch.lower():
                return True
        return False

    def restore(self) -> None:
        if self.fd is not None and self.saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)
            self.fd = None
