// The spokefs dashboard: polls this server's /v1/status and /metrics and draws what they say.
// No library and nothing from another origin (the page's Content-Security-Policy forbids it).
// Every figure is written as text for people and as data-value (the raw number) for tests.
"use strict";

(() => {
  const params = new URLSearchParams(location.search);
  const EVERY_MS = Math.max(250, Number(params.get("every") || 2) * 1000);
  const SPAN_S = 300;          // what the charts show, and the history kept
  const RATE_S = 10;           // rates (bytes/s, blocks/s) are taken over about this long
  const DATA_BOUND = 0.10;     // a job waiting this share of its step time for data is data-bound
  const TOKEN_KEY = "spokefs-token";
  const base = new URL("../", location.href);  // the page is at /ui/: the API is one up
  const COLORS = ["#2563eb", "#d97706", "#059669", "#db2777", "#7c3aed", "#0891b2"];

  const $ = (id) => document.getElementById(id);
  const hist = [];   // one sample a poll: {t, ...sums, warm: {ds: [asked, done]}, jobs: {key: share}}
  let polls = 0;

  // -- formatting ---------------------------------------------------------------------------
  const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  function bytes(n) {
    if (n == null || !isFinite(n)) return "–";
    let i = 0;
    while (Math.abs(n) >= 1024 && i < UNITS.length - 1) { n /= 1024; i++; }
    return `${i ? n.toFixed(n < 10 ? 2 : n < 100 ? 1 : 0) : Math.round(n)} ${UNITS[i]}`;
  }
  const rate = (n) => (n == null ? "–" : `${bytes(n)}/s`);
  const pct = (x) => (x == null || !isFinite(x) ? "–" : `${(100 * x).toFixed(1)}%`);
  function duration(s) {
    if (s == null || !isFinite(s)) return "–";
    s = Math.round(s);
    if (s < 60) return `${s} s`;
    const [h, min, sec] = [Math.floor(s / 3600), Math.floor((s % 3600) / 60), s % 60];
    if (!h) return sec ? `${min} min ${sec} s` : `${min} min`;
    return min ? `${h} h ${min} min` : `${h} h`;
  }
  const count = (n) => (n == null ? "–" : Math.round(n).toLocaleString("en"));

  function show(id, value, text) {
    const el = $(id);
    el.dataset.value = value == null || !isFinite(value) ? "" : String(value);
    el.textContent = text;
  }

  // -- Prometheus text format (only what this page reads) ----------------------------------
  const LINE = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/;
  const LABEL = /(\w+)="((?:[^"\\]|\\.)*)"/g;
  function parseMetrics(text) {
    const out = new Map();
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const m = LINE.exec(line);
      if (!m) continue;
      const labels = {};
      for (const l of (m[2] || "").matchAll(LABEL)) {
        labels[l[1]] = l[2].replace(/\\n/g, "\n").replace(/\\(.)/g, "$1");
      }
      if (!out.has(m[1])) out.set(m[1], []);
      out.get(m[1]).push({labels, value: Number(m[3])});
    }
    return out;
  }
  const sum = (m, name) => (m.get(name) || []).reduce((a, s) => a + s.value, 0);
  const has = (m, name) => m.has(name);
  function byLabel(m, name, label) {
    const out = {};
    for (const s of m.get(name) || []) out[s.labels[label]] = (out[s.labels[label]] || 0) + s.value;
    return out;
  }

  // -- history and rates ---------------------------------------------------------------------
  function older(now, seconds, get = null) {
    // The oldest sample within the last ``seconds`` (not the newest) that has the figure:
    // the start of the span to measure.
    for (const s of hist) {
      if (s.t >= now.t - seconds && s !== now && (!get || get(s) != null)) return s;
    }
    return null;
  }
  function perSecond(now, get, seconds = RATE_S) {
    const then = older(now, seconds, get);
    if (!then || now.t <= then.t) return null;
    const a = get(then), b = get(now);
    return a == null || b == null ? null : Math.max(0, (b - a) / (now.t - then.t));
  }

  // -- fetching --------------------------------------------------------------------------------
  function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }
  async function get(path) {
    const headers = {};
    if (token()) headers.Authorization = `Bearer ${token()}`;
    const resp = await fetch(new URL(path, base), {headers, cache: "no-store"});
    if (resp.status === 401 || resp.status === 403) {
      let why = "";
      try { why = (await resp.json()).error.message; } catch (e) { /* not JSON */ }
      throw new Error(`${resp.status}: ${why || "refused"}. This server runs with --auth: ` +
                      "type a token with read scope above.");
    }
    if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
    return resp;
  }

  async function poll() {
    try {
      const [st, mt] = await Promise.all([get("v1/status"), get("metrics")]);
      const status = await st.json();
      const metrics = parseMetrics(await mt.text());
      record(status, metrics);
      render(status, metrics);
      polls++;
      document.body.dataset.polls = String(polls);
      $("error").hidden = true;
      show("updated", Date.now() / 1000, new Date().toLocaleTimeString());
    } catch (err) {
      $("error").textContent = `Cannot read this server: ${err.message}`;
      $("error").hidden = false;
    } finally {
      setTimeout(poll, EVERY_MS);
    }
  }

  function record(status, m) {
    const warm = {};
    const asked = byLabel(m, "spokefs_warm_blocks_total", "dataset");
    const done = byLabel(m, "spokefs_warm_done_blocks_total", "dataset");
    for (const ds of Object.keys(asked)) warm[ds] = [asked[ds], done[ds] || 0];
    const jobs = {};
    for (const j of status.jobs || []) jobs[`${j.dataset}/${j.job}`] = j.data_wait_share;
    hist.push({
      t: performance.now() / 1000,
      upstream: sum(m, "spokefs_upstream_bytes_total"),
      served: sum(m, "spokefs_served_bytes_total") + sum(m, "spokefs_short_circuit_bytes_total"),
      requests: sum(m, "spokefs_requests_total"),
      hits: sum(m, "spokefs_cache_hits_total"),
      misses: sum(m, "spokefs_cache_misses_total"),
      fill: has(m, "spokefs_cache_capacity_bytes") && sum(m, "spokefs_cache_capacity_bytes") > 0
        ? sum(m, "spokefs_cache_bytes") / sum(m, "spokefs_cache_capacity_bytes") : null,
      warm, jobs,
      sent: sum(m, "spokefs_writeback_sent_bytes_total"),
    });
    const now = hist[hist.length - 1].t;
    while (hist.length && hist[0].t < now - SPAN_S) hist.shift();
  }

  // -- rendering -------------------------------------------------------------------------------
  function render(status, m) {
    const role = status.role || "hub";
    show("role", null, role);
    $("role").dataset.value = role;
    for (const el of document.querySelectorAll("[data-role]")) el.hidden = el.dataset.role !== role;
    $("upstream").textContent = status.upstream || "none: this is the source";
    show("uptime", status.uptime_s, duration(status.uptime_s));
    $("uptime").parentElement.hidden = status.uptime_s == null;
    const now = hist[hist.length - 1];

    const served = now.served;
    show("served-bytes", served, bytes(served));
    const sr = perSecond(now, (s) => s.served);
    show("served-rate", sr, rate(sr));
    const rr = perSecond(now, (s) => s.requests);
    show("request-rate", rr, rr == null ? "–" : `${rr.toFixed(1)}/s`);
    const ur = perSecond(now, (s) => s.upstream);
    if (role === "spoke") {
      renderCache(m, now);
      show("upstream-bytes", now.upstream, bytes(now.upstream));
      show("upstream-rate", ur, rate(ur));
      const link = renderLink(status, ur);
      const warm = renderWarm(status, now, ur);
      renderJobs(status, now, link);
      renderShares(status);
      renderWriteback(m, now);
      renderWarmVerdict(warm);
      drawCacheChart();
      drawJobsChart(status);
    } else {
      renderDatasets(status);
    }
    drawBytesChart(role);
    renderRequests(m, now);
  }

  const lastRequests = new Map();  // "route status" -> [t, count] of the poll RATE_S ago or so
  function renderRequests(m, now) {
    const rows = [];
    const samples = (m.get("spokefs_requests_total") || []).slice()
      .sort((a, b) => b.value - a.value).slice(0, 8);
    for (const s of samples) {
      const key = `${s.labels.route} ${s.labels.status}`;
      const before = lastRequests.get(key);
      const r = before && now.t > before[0] ? (s.value - before[1]) / (now.t - before[0]) : null;
      if (!before || now.t - before[0] > RATE_S) lastRequests.set(key, [now.t, s.value]);
      const row = document.createElement("tr");
      row.dataset.route = key;
      cell(row, s.labels.route || "", "name");
      cell(row, s.labels.status || "", Number(s.labels.status) >= 400 ? "status bad" : "status");
      cell(row, count(s.value), "count", s.value);
      cell(row, r == null ? "–" : `${r.toFixed(1)}/s`, "rate", r);
      rows.push(row);
    }
    fillTable("requests", rows);
  }

  function renderCache(m, now) {
    const cap = sum(m, "spokefs_cache_capacity_bytes");
    const used = sum(m, "spokefs_cache_bytes");
    show("cache-fill", now.fill, pct(now.fill));
    show("cache-bytes", used, bytes(used));
    show("cache-capacity", cap, bytes(cap));
    const ratio = now.hits + now.misses ? now.hits / (now.hits + now.misses) : null;
    show("hit-ratio", ratio, pct(ratio));
    $("hits-misses").textContent = `${count(now.hits)} / ${count(now.misses)}`;
    const ev = sum(m, "spokefs_cache_evictions_total");
    show("evictions", ev, `${count(ev)} blocks`);
  }

  function renderLink(status, ur) {
    const link = status.link || {};
    const down = status.upstream_error;
    const state = down ? "down" : !status.link ? "up (not measured: --no-pacing)"
      : link.startup ? "up (measuring)" : "up";
    show("link-state", null, state);
    $("link-state").dataset.value = down ? "down" : "up";
    show("link-rtt", link.rtt_s, link.rtt_s == null ? "–" : `${(1000 * link.rtt_s).toFixed(1)} ms`);
    show("link-bandwidth", link.bandwidth_bytes_per_s, rate(link.bandwidth_bytes_per_s));
    show("link-window", link.window_bytes, bytes(link.window_bytes));
    show("link-inflight", status.inflight_bytes, bytes(status.inflight_bytes));
    show("link-queued", status.queued, count(status.queued));
    $("link-error").hidden = !down;
    $("link-error").textContent = down ? `last upstream error: ${down}` : "";
    // The link limits reads when blocks wait for it: the fetch queue holds blocks back, or
    // what is out fills the window, while bytes flow.
    const full = status.queued > 0 ||
      (link.window_bytes > 0 && status.inflight_bytes >= 0.9 * link.window_bytes);
    let verdict, why, st;
    if (down) {
      [verdict, st] = ["the link is down", "bad"];
      why = "Cached reads go on; uncached reads fail after the deadline.";
    } else if (full && ur > 0) {
      [verdict, st] = ["yes: blocks wait for the link", "bad"];
      why = `${rate(ur)} arrive; ${count(status.queued)} blocks queued, ` +
        `${bytes(status.inflight_bytes)} in flight of a ${bytes(link.window_bytes)} window.`;
    } else if (!ur) {
      [verdict, st] = ["no: nothing crosses it now", "ok"];
      why = "Reads are served from the cache (or there are none).";
    } else {
      [verdict, st] = ["no: it keeps up", "ok"];
      why = `${rate(ur)} arrive with nothing waiting` +
        (link.bandwidth_bytes_per_s ? ` (best lately ${rate(link.bandwidth_bytes_per_s)}).` : ".");
    }
    setVerdict("link", verdict, st, why);
    return {full, down};
  }

  function setVerdict(which, text, state, why) {
    $(`verdict-${which}`).textContent = text;
    $(`verdict-${which}`).dataset.state = state;
    $(`why-${which}`).textContent = why;
  }

  function cell(row, text, cls, value) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    if (value !== undefined) td.dataset.value = value == null ? "" : String(value);
    row.appendChild(td);
    return td;
  }
  function bar(row, fraction, cls) {
    const td = document.createElement("td");
    td.className = `bar ${cls || ""}`;
    const fill = document.createElement("div");
    fill.className = "fill";
    fill.style.width = `${Math.max(0, Math.min(1, fraction || 0)) * 100}%`;
    td.appendChild(fill);
    row.appendChild(td);
  }
  function fillTable(id, rows) {
    const body = $(id).querySelector("tbody");
    body.replaceChildren(...rows);
    $(`${id}-empty`) && ($(`${id}-empty`).hidden = rows.length > 0);
    $(id).hidden = rows.length === 0;
  }

  function renderWarm(status, now) {
    const rows = [];
    let running = 0, left = 0, asked = 0, done = 0, eta = 0;
    for (const ds of Object.keys(now.warm).sort()) {
      const [a, d] = now.warm[ds];
      const r = perSecond(now, (s) => (s.warm[ds] ? s.warm[ds][1] : null));
      const remaining = Math.max(0, a - d);
      const dsEta = remaining === 0 ? 0 : r ? remaining / r : null;
      const row = document.createElement("tr");
      row.dataset.dataset = ds;
      cell(row, ds, "name");
      cell(row, pct(a ? d / a : 1), "progress", a ? d / a : 1);
      cell(row, `${count(d)} / ${count(a)}`, "blocks");
      cell(row, r == null ? "–" : `${r.toFixed(0)}/s`, "rate", r);
      cell(row, remaining === 0 ? "done" : duration(dsEta), "eta", dsEta);
      rows.push(row);
      asked += a;
      done += d;
      if (remaining) {
        running++;
        left += remaining;
        eta = dsEta == null || eta == null ? null : Math.max(eta, dsEta);
      }
    }
    fillTable("warmups", rows);
    const sets = (status.prefetch && status.prefetch.working_sets) || [];
    const setRows = [];
    let keptLeft = 0;
    for (const w of sets) {
      const row = document.createElement("tr");
      row.dataset.job = `${w.dataset}/${w.job}`;
      const kept = w.kept_bytes || 0, res = w.resident_bytes || 0;
      keptLeft += Math.max(0, kept - res);
      cell(row, w.dataset, "name");
      cell(row, w.job || "(readers without a job)", "name");
      cell(row, kept ? pct(res / kept) : "–", "resident", kept ? res / kept : null);
      cell(row, bytes(kept || w.working_set_bytes), "kept", kept);
      cell(row, w.order ? `${count(w.order.read)} / ${count(w.order.positions)}` : "–", "order");
      setRows.push(row);
    }
    fillTable("working-sets", setRows);
    return {running, left, asked, done, eta, keptLeft};
  }

  function renderWarmVerdict(w) {
    const now = hist[hist.length - 1];
    const fillRate = perSecond(now, (s) => s.upstream);
    const verdict = $("verdict-warm");
    if (w.running) {
      const frac = w.asked ? w.done / w.asked : 0;
      setVerdict("warm", `yes: ${pct(frac)}` + (w.eta == null ? "" : `, done in about ${duration(w.eta)}`),
                 "busy", `${count(w.left)} blocks to go at the fill rate of the last ${RATE_S} s ` +
                 `(${rate(fillRate)} from upstream).`);
      verdict.dataset.value = String(frac);
      verdict.dataset.eta = w.eta == null ? "" : String(w.eta);
    } else if (w.keptLeft > 0) {
      const eta = fillRate ? w.keptLeft / fillRate : null;
      setVerdict("warm", "filling working sets" + (eta == null ? "" : `, about ${duration(eta)}`),
                 "busy", `${bytes(w.keptLeft)} of what jobs read is not resident yet.`);
      verdict.dataset.value = "";
      verdict.dataset.eta = eta == null ? "" : String(eta);
    } else {
      setVerdict("warm", w.asked ? "no: warm" : "no warm-up running", "ok",
                 w.asked ? `Every warm-up is done (${count(w.done)} blocks).`
                   : "Warm with `spokefs warm URL --wait` before the job starts.");
      verdict.dataset.value = w.asked ? "1" : "";
      verdict.dataset.eta = w.asked ? "0" : "";
    }
  }

  function renderJobs(status, now, link) {
    const jobs = status.jobs || [];
    const rows = [];
    let worst = null;
    for (const j of jobs) {
      const row = document.createElement("tr");
      row.dataset.job = `${j.dataset}/${j.job}`;
      cell(row, j.dataset, "name");
      cell(row, j.job, "name");
      cell(row, count(j.steps), "steps", j.steps);
      cell(row, pct(j.data_wait_share), "share", j.data_wait_share);
      bar(row, j.data_wait_share, j.data_wait_share >= DATA_BOUND ? "bad" : "ok");
      cell(row, pct(j.utilisation), "util", j.utilisation);
      rows.push(row);
      if (j.data_wait_share != null && (worst == null || j.data_wait_share > worst.data_wait_share)) {
        worst = j;
      }
    }
    fillTable("jobs", rows);
    const v = $("verdict-data");
    if (!worst) {
      setVerdict("data", jobs.length ? "no step time reported yet" : "no job reports steps",
                 "unknown", "Report steps with spokefs.torch.StepReporter (see docs/dashboard.md).");
      v.dataset.value = "";
      return;
    }
    v.dataset.value = String(worst.data_wait_share);
    const then = older(now, RATE_S);
    const dh = then ? now.hits - then.hits : 0, dm = then ? now.misses - then.misses : 0;
    const recent = dh + dm ? dh / (dh + dm) : null;
    if (worst.data_wait_share >= DATA_BOUND) {
      let why;
      if (link.down) why = "The upstream is down: only cached reads are served.";
      else if (recent == null) {
        why = "No reads reached the spoke lately: the wait is in the loader (workers, " +
          "decoding), not the spoke.";
      } else if (recent < 0.95) {
        why = `Reads miss the cache (${pct(recent)} hits lately)` +
          (link.full ? " and blocks wait for the link." : ": the spoke is still fetching.");
      } else {
        why = "Reads hit the cache: the loader itself (workers, decoding) is the limit, " +
          "not the spoke.";
      }
      setVerdict("data", `yes: ${worst.job} waits ${pct(worst.data_wait_share)} of its time`,
                 "bad", why);
    } else {
      setVerdict("data", `no: ${pct(1 - worst.data_wait_share)} busy at worst`, "ok",
                 `${jobs.length} job${jobs.length > 1 ? "s" : ""}; the worst waits ` +
                 `${pct(worst.data_wait_share)} of its step time for data.`);
    }
  }

  // Reserved shares and ceilings (the spoke's dataset rules): what eviction takes first.
  const SHARE_TEXT = {over_max: "over its ceiling", over: "over its reservation",
                      under: "within its reservation"};
  function renderShares(status) {
    const rows = [];
    for (const r of (status.datasets && status.datasets.shares) || []) {
      if (!r.min_share && !r.max_share) continue;
      const row = document.createElement("tr");
      row.dataset.dataset = r.dataset;
      cell(row, r.dataset, "name");
      cell(row, bytes(r.resident_bytes), "resident", r.resident_bytes);
      cell(row, r.min_bytes ? bytes(r.min_bytes) : "–", "reserved", r.min_bytes || null);
      cell(row, r.max_bytes == null ? "–" : bytes(r.max_bytes), "ceiling", r.max_bytes);
      cell(row, r.in_use == null ? "–" : r.in_use ? "in use" : "idle", "use",
           r.in_use == null ? null : r.in_use);
      cell(row, SHARE_TEXT[r.share] || r.share, "share", r.share);
      rows.push(row);
    }
    fillTable("shares", rows);
  }

  // Write-back (spoke/writeback.py): what was written here and is not yet safe at the hub.
  function renderWriteback(m, now) {
    show("wb-sent", now.sent, bytes(now.sent));
    const r = perSecond(now, (s) => s.sent);
    show("wb-rate", r, rate(r));
    const pinned = has(m, "spokefs_writeback_pinned_bytes")
      ? sum(m, "spokefs_writeback_pinned_bytes") : null;
    show("wb-pinned", pinned, pinned == null ? "off (--keep-checkpoints 0)" : bytes(pinned));
    const unsafe = byLabel(m, "spokefs_writeback_unsafe_bytes", "dataset");
    const oldest = byLabel(m, "spokefs_writeback_oldest_unsafe_seconds", "dataset");
    const waiting = byLabel(m, "spokefs_writeback_commits_waiting", "dataset");
    const rows = [];
    for (const ds of Object.keys(unsafe).sort()) {
      const row = document.createElement("tr");
      row.dataset.dataset = ds;
      cell(row, ds, "name");
      cell(row, bytes(unsafe[ds]), "unsafe", unsafe[ds]);
      cell(row, oldest[ds] ? duration(oldest[ds]) : "–", "oldest", oldest[ds] || 0);
      cell(row, count(waiting[ds] || 0), "waiting", waiting[ds] || 0);
      rows.push(row);
    }
    fillTable("writeback", rows);
  }

  function renderDatasets(status) {
    const rows = [];
    for (const d of status.datasets || []) {
      const row = document.createElement("tr");
      row.dataset.dataset = d.name;
      cell(row, d.name, "name");
      cell(row, count(d.snapshots), "snapshots", d.snapshots);
      cell(row, d.latest ? d.latest.id : "–", "latest");
      cell(row, d.latest ? count(d.latest.files) : "–", "files", d.latest && d.latest.files);
      cell(row, d.latest ? bytes(d.latest.bytes) : "–", "bytes", d.latest && d.latest.bytes);
      rows.push(row);
    }
    $("datasets").querySelector("tbody").replaceChildren(...rows);
  }

  // -- charts (canvas, drawn from the history) ----------------------------------------------
  function series(get) {
    const out = [];
    for (let i = 1; i < hist.length; i++) out.push([hist[i].t, get(hist[i], hist[i - 1])]);
    return out;
  }

  function draw(canvas, lines, opts) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
    if (canvas.width !== Math.round(w * dpr)) canvas.width = Math.round(w * dpr);
    if (canvas.height !== Math.round(h * dpr)) canvas.height = Math.round(h * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const left = 64, right = 8, top = 8, bottom = 18;
    let max = opts.max;
    if (max == null) {
      max = 0;
      for (const l of lines) for (const [, v] of l.points) if (v != null) max = Math.max(max, v);
      max = Math.max(opts.least || 0, max * 1.15) || 1;
    }
    const now = hist.length ? hist[hist.length - 1].t : 0;
    // The span drawn grows with the page's history (at least a minute), up to SPAN_S.
    const span = Math.min(SPAN_S, Math.max(60, hist.length ? now - hist[0].t : 0));
    const x = (t) => left + (w - left - right) * (1 - (now - t) / span);
    const y = (v) => top + (h - top - bottom) * (1 - v / max);
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#6b7280";
    ctx.strokeStyle = "#e5e7eb";
    ctx.lineWidth = 1;
    for (const f of [0, 0.5, 1]) {
      const yy = Math.round(y(f * max)) + 0.5;
      ctx.beginPath(); ctx.moveTo(left, yy); ctx.lineTo(w - right, yy); ctx.stroke();
      ctx.fillText(opts.fmt(f * max), 4, yy + 4);
    }
    ctx.fillText(`-${duration(span)}`, left, h - 4);
    ctx.fillText("now", w - right - 22, h - 4);
    let points = 0;
    for (const l of lines) {
      ctx.strokeStyle = l.color;
      ctx.lineWidth = 2;
      ctx.beginPath();
      let pen = false;
      for (const [t, v] of l.points) {
        if (v == null || !isFinite(v)) { pen = false; continue; }
        const xx = x(t), yy = y(Math.min(v, max));
        if (pen) ctx.lineTo(xx, yy); else ctx.moveTo(xx, yy);
        pen = true;
        points++;
      }
      ctx.stroke();
    }
    canvas.dataset.points = String(points);
  }

  function drawCacheChart() {
    draw($("chart-cache"), [
      {color: COLORS[0], points: series((s) => s.fill)},
      {color: COLORS[1], points: series((s, p) => {
        const dh = s.hits - p.hits, dm = s.misses - p.misses;
        return dh + dm > 0 ? dh / (dh + dm) : null;
      })},
    ], {max: 1, fmt: (v) => `${Math.round(100 * v)}%`});
  }

  function drawBytesChart(role) {
    const per = (get) => (s, p) => (s.t > p.t ? Math.max(0, (get(s) - get(p)) / (s.t - p.t)) : null);
    const lines = [{color: COLORS[2], points: series(per((s) => s.served))}];
    if (role === "spoke") lines.unshift({color: COLORS[0], points: series(per((s) => s.upstream))});
    draw($("chart-bytes"), lines, {least: 1024, fmt: (v) => `${bytes(v)}/s`});
  }

  function drawJobsChart(status) {
    const keys = (status.jobs || []).map((j) => `${j.dataset}/${j.job}`).slice(0, COLORS.length);
    draw($("chart-jobs"), keys.map((k, i) => ({
      color: COLORS[i], points: series((s) => (s.jobs[k] === undefined ? null : s.jobs[k])),
    })), {max: 1, fmt: (v) => `${Math.round(100 * v)}%`});
    const legend = $("jobs-legend");
    legend.replaceChildren(...keys.map((k, i) => {
      const span = document.createElement("span");
      const dot = document.createElement("i");
      dot.style.background = COLORS[i];
      span.append(dot, `${k} `);
      return span;
    }));
    if (keys.length) legend.prepend("data-wait share: ");
  }

  // -- start ----------------------------------------------------------------------------------
  $("every").textContent = String(EVERY_MS / 1000);
  $("span").textContent = String(SPAN_S / 60);
  $("token").value = token();
  $("auth").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const t = $("token").value.trim();
    if (t) sessionStorage.setItem(TOKEN_KEY, t); else sessionStorage.removeItem(TOKEN_KEY);
    $("error").hidden = true;
  });
  poll();
})();
