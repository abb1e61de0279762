// StaleFlow dashboard page: polls the JSON API once a second and redraws.
// Plain JavaScript and <canvas>; no library, no build step. Every element a test counts
// carries a data attribute: data-buffer / data-slot, data-instance, data-chart.
"use strict";

const POLL_MS = 1000;
const KEEP_LOAD = 40000; // load samples kept in the page (oldest dropped)
const STALENESS_COLOURS = ["#1565c0", "#2e7d32", "#f9a825", "#ef6c00", "#c62828", "#6a1b9a", "#00838f", "#5d4037"];
const INSTANCE_COLOURS = ["#1565c0", "#c62828", "#2e7d32", "#6a1b9a", "#ef6c00", "#00838f", "#5d4037", "#ad1457"];

const state = {
  records: [],
  load: [],
  events: [],
  cursor: { records: 0, load: 0, events: 0 },
  overview: null,
  updates: 0,
};

function $(id) { return document.getElementById(id); }

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  }
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function fmt(value, digits) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  if (digits === undefined) digits = Math.abs(value) >= 100 ? 0 : 2;
  return value.toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

function pct(value) { return value === null || value === undefined ? "–" : (100 * value).toFixed(0) + "%"; }

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response.json();
}

// -- polling ---------------------------------------------------------------------------

async function poll() {
  try {
    const c = state.cursor;
    const [overview, metrics, load, events] = await Promise.all([
      getJSON("api/overview"),
      getJSON("api/metrics?since=" + c.records + "&limit=2000"),
      getJSON("api/load?since=" + c.load + "&limit=10000"),
      getJSON("api/events?since=" + c.events + "&limit=10000"),
    ]);
    state.overview = overview;
    state.records.push(...metrics.records);
    c.records = metrics.next;
    state.load.push(...load.samples);
    if (state.load.length > KEEP_LOAD) state.load.splice(0, state.load.length - KEEP_LOAD);
    c.load = load.next;
    state.events.push(...events.events);
    c.events = events.next;
    state.updates += 1;
    render();
  } catch (err) {
    setStatus("disconnected", "disconnected: " + err.message);
  }
  setTimeout(poll, POLL_MS);
}

function setStatus(status, text) {
  const node = $("run-status");
  node.dataset.status = status;
  node.textContent = text || status;
}

// -- rendering -------------------------------------------------------------------------

function render() {
  const o = state.overview;
  renderHeader(o.run, o.ps);
  renderBuffers(o.buffers, o.run);
  renderInstances(o.instances);
  renderTS(o.ts);
  renderPS(o.ps);
  renderNotes(o);
  renderRecoveries();
  drawLoad($("load-chart"), o.run);
  drawStaleness($("staleness-chart"), o.run);
  drawFreshness($("freshness-chart"), o.run);
  drawThroughput($("throughput-chart"), o.run);
  drawReward($("reward-chart"));
  drawEval($("eval-chart"));
  drawSeries($("episodes-chart"), EPISODE_SERIES, { yLabel: "per episode", empty: EPISODES_EMPTY });
  drawSeries($("tool-wait-chart"), TOOL_WAIT_SERIES, { yLabel: "seconds", empty: EPISODES_EMPTY });
  drawSeries($("speculation-chart"), SPECULATION_SERIES, { yLabel: "tokens", empty: SPECULATION_EMPTY });
  drawIdle($("idle-chart"));
  document.body.dataset.updates = String(state.updates);
}

function renderHeader(run, ps) {
  $("run-name").textContent = run.name + " (" + run.kind + ")";
  const status = run.state || (run.finished ? "finished" : "running");
  setStatus(status);
  const unit = run.clock === "virtual" ? " virtual s" : " s";
  const facts = [
    ["η", run.eta],
    ["batch", run.batch_size === null ? null : run.batch_size + " × " + run.group_size],
    ["instances", run.instances],
    ["steps", run.steps],
    ["trainer v", run.trainer_version],
    ["PS v", ps.latest !== null ? ps.latest : run.ps_version],
    ["time", fmt(run.elapsed_s, 0) + unit],
    ["cycles", run.cycles],
  ];
  if (run.phase) facts.push(["phase", run.phase]);
  const dl = $("run-facts");
  dl.replaceChildren(...facts.map(([k, v]) => {
    const d = el("div");
    d.append(el("dt", {}, k), el("dd", {}, v === null || v === undefined ? "–" : v));
    return d;
  }));
}

function renderBuffers(b, run) {
  const root = $("buffers");
  root.dataset.count = String(b.buffers.length);
  $("buffers-note").textContent = b.available
    ? "trainer at version " + b.trainer_version + " consumes buffer " + b.trainer_version +
      " next · " + b.consumed_batches + " consumed · " + b.aborted_groups + " groups aborted"
    : b.notes.join(" ");
  const rows = b.buffers.map((buf) => {
    const row = el("div", {
      class: "buffer-row" + (buf.version === b.trainer_version ? " trainer" : ""),
      "data-buffer": buf.version,
      "data-state": buf.state,
      "data-capacity": buf.capacity,
    });
    const label = el("div", { class: "buffer-label" });
    label.append(
      el("span", {}, "V_buf " + buf.version + " "),
      el("span", { class: "state state-" + buf.state }, buf.state),
      el("span", {}, " " + buf.occupied + "/" + buf.capacity),
    );
    const slots = el("div", { class: "slots" + (buf.capacity > 48 ? " dense" : "") });
    for (let j = 0; j < buf.capacity; j++) {
      const entry = buf.entries[j];
      const kind = entry ? entry.kind : "empty";
      const slot = el("div", { class: "slot " + kind, "data-slot": j, "data-kind": kind });
      if (entry) {
        slot.textContent = String(entry.version);
        slot.title = kind + ": group " + entry.group_id + ", version " + entry.version +
          " (staleness " + (buf.version - entry.version) + ")";
      }
      slots.append(slot);
    }
    row.append(label, slots);
    return row;
  });
  root.replaceChildren(...rows);
}

function renderInstances(data) {
  const body = $("instances").querySelector("tbody");
  const rows = data.instances.map((d) => {
    const tr = el("tr", { "data-instance": d.inst, "data-version": d.model_version });
    const kv = el("td");
    if (d.kv_cache_tokens !== null) {
      const share = d.kv_budget_tokens ? Math.min(d.kv_cache_tokens / d.kv_budget_tokens, 1) : 0;
      const bar = el("span", { class: "kvbar", title: share.toFixed(2) + " of the KV budget" });
      const fill = el("span");
      fill.style.width = (100 * share).toFixed(1) + "%";
      bar.append(fill);
      kv.append(bar, " " + fmt(d.kv_cache_tokens, 0));
    } else {
      kv.textContent = "–";
    }
    const counts = d.commands_total || d.last_cycle_commands;
    const commands = counts
      ? Object.entries(counts).sort().map(([k, n]) => k + " " + n).join(", ") || "none"
      : "–";
    tr.append(
      el("td", {}, d.inst),
      el("td", {}, d.model_version === null ? "–" : "v" + d.model_version),
      el("td", {}, fmt(d.running)),
      el("td", {}, fmt(d.waiting)),
      el("td", {}, fmt(d.completed)),
      kv,
      el("td", {}, fmt(d.throughput_estimate_tokens_per_s, 0)),
      el("td", {}, fmt(d.measured_tokens_per_s, 0)),
      el("td", {}, pct(d.idle_ratio)),
      el("td", {}, commands),
    );
    return tr;
  });
  body.replaceChildren(...rows);
  $("instances-note").textContent = data.notes.join(" ");
}

function renderTS(ts) {
  const table = $("ts");
  if (!ts.available) {
    table.replaceChildren(el("caption", {}, ts.notes.join(" ")));
    return;
  }
  const versions = new Set();
  for (const byV of Object.values(ts.by_v_traj)) Object.keys(byV).forEach((v) => versions.add(Number(v)));
  const vs = [...versions].sort((a, b) => a - b);
  const head = el("tr");
  head.append(el("th", {}, "state"), el("th", {}, "total"), ...vs.map((v) => el("th", {}, "V_traj " + v)));
  const rows = ["queued", "routed", "completed"].map((s) => {
    const tr = el("tr", { "data-ts-state": s });
    tr.append(el("td", {}, s), el("td", {}, ts.by_state[s]),
      ...vs.map((v) => el("td", {}, (ts.by_v_traj[s] || {})[v] || 0)));
    return tr;
  });
  const initial = el("tr", { "data-ts-state": "initial" });
  initial.append(el("td", {}, "initial (no V_traj yet)"), el("td", {}, ts.by_state.initial));
  const totals = el("tr");
  totals.append(el("td", {}, "created / consumed / aborted"),
    el("td", { colspan: 1 + vs.length },
      ts.totals.created_trajectories + " / " + ts.totals.consumed_trajectories + " / " +
      ts.totals.aborted_trajectories + " trajectories"));
  table.replaceChildren(head, ...rows, initial, totals);
}

function renderPS(ps) {
  const facts = [
    ["latest", ps.latest],
    ["held", ps.held === null ? null : ps.held.join(", ")],
    ["slots", ps.num_slots],
    ["being read", ps.readers === null ? null : ps.readers.join(", ") || "none"],
    ["pushing", ps.pushing === null ? null : ps.pushing ? "yes" : "no"],
    ["last push at", ps.last_push_s === null ? null : fmt(ps.last_push_s, 1) + " s"],
    ["pulls", Object.keys(ps.last_pull_s).length + " instances"],
    ["bytes per version", ps.version_bytes],
  ];
  $("ps").replaceChildren(...facts.map(([k, v]) => {
    const d = el("div");
    d.append(el("dt", {}, k), el("dd", {}, v === null || v === undefined ? "n/a" : v));
    return d;
  }));
}

function renderRecoveries() {
  const shown = state.events.filter((e) => e.kind === "recovery").slice(-20).reverse();
  if (!shown.length) return;
  $("recoveries").replaceChildren(
    ...shown.map((e) => el("li", {}, fmt(e.time, 1) + " s, after step " + e.version + ": " + e.detail)),
  );
}

function renderNotes(o) {
  const notes = new Set([...o.run.notes, ...o.ps.notes, ...o.ts.notes, ...o.instances.notes]);
  $("notes").replaceChildren(...[...notes].map((n) => el("li", {}, n)));
}

// -- charts ----------------------------------------------------------------------------

function canvasContext(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 600;
  const height = Number(canvas.getAttribute("height")) || 220;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  canvas.style.height = height + "px";
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, width, height };
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(value)));
  for (const m of [1, 2, 2.5, 5, 10]) if (value <= m * p) return m * p;
  return 10 * p;
}

function axes(ctx, box, xMax, yMax, xLabel, yLabel) {
  ctx.strokeStyle = "#bbb";
  ctx.fillStyle = "#777";
  ctx.beginPath();
  ctx.moveTo(box.x, box.y);
  ctx.lineTo(box.x, box.y + box.h);
  ctx.lineTo(box.x + box.w, box.y + box.h);
  ctx.stroke();
  ctx.textAlign = "right";
  ctx.fillText(fmt(yMax), box.x - 4, box.y + 8);
  ctx.fillText("0", box.x - 4, box.y + box.h);
  ctx.textAlign = "center";
  ctx.fillText(xLabel + " (max " + fmt(xMax) + ")", box.x + box.w / 2, box.y + box.h + 14);
  ctx.save();
  ctx.translate(10, box.y + box.h / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.fillText(yLabel, 0, 0);
  ctx.restore();
}

function empty(ctx, width, height, text) {
  ctx.fillStyle = "#999";
  ctx.textAlign = "center";
  ctx.fillText(text, width / 2, height / 2);
}

function lineChart(canvas, series, opts) {
  const { ctx, width, height } = canvasContext(canvas);
  const points = series.flatMap((s) => s.points);
  canvas.dataset.points = String(points.length);
  canvas.dataset.seriesPoints = series.map((s) => s.points.length).join(","); // per series, in order
  if (!points.length) return empty(ctx, width, height, opts.empty || "no data yet");
  const box = { x: 48, y: 8, w: width - 60, h: height - 34 };
  const xMax = niceMax(points.reduce((m, p) => Math.max(m, p[0]), 0));
  const yMax = opts.yMax || niceMax(points.reduce((m, p) => Math.max(m, p[1]), 0));
  axes(ctx, box, xMax, yMax, opts.xLabel, opts.yLabel);
  const X = (x) => box.x + (box.w * x) / xMax;
  const Y = (y) => box.y + box.h - (box.h * Math.min(y, yMax)) / yMax;
  series.forEach((s, k) => {
    ctx.strokeStyle = s.colour;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    s.points.forEach(([x, y], i) => (i ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
    ctx.stroke();
    ctx.fillStyle = s.colour;
    ctx.textAlign = "left";
    ctx.fillText(s.label, box.x + 8 + k * 150, box.y + 10);
  });
}

function drawThroughput(canvas, run) {
  const r = state.records;
  const t = (x) => x["time/elapsed_s"];
  lineChart(canvas, [
    { label: "cumulative", colour: "#1565c0", points: r.filter((x) => x["throughput/tokens_per_s"] !== undefined).map((x) => [t(x), x["throughput/tokens_per_s"]]) },
    { label: "per step", colour: "#90caf9", points: r.filter((x) => x["throughput/step_tokens_per_s"] !== undefined).map((x) => [t(x), x["throughput/step_tokens_per_s"]]) },
  ], { xLabel: run.clock === "virtual" ? "virtual s" : "s", yLabel: "tokens/s", empty: "no training step yet" });
}

function drawReward(canvas) {
  const points = state.records
    .filter((x) => x["rollout/reward_mean"] !== undefined && x["rollout/reward_mean"] !== null)
    .map((x) => [x.step, x["rollout/reward_mean"]]);
  const note = state.overview && state.overview.run.kind === "sim"
    ? "no reward: the simulator does not grade responses"
    : "no reward recorded yet";
  lineChart(canvas, [{ label: "mean reward", colour: "#2e7d32", points }],
    { xLabel: "step", yLabel: "reward", empty: note });
}

// the held-out evaluation (eval.every): only the steps evaluated carry these keys
const EVAL_SERIES = [
  { key: "eval/mean_at_k", label: "mean@k", colour: "#2e7d32" },
  { key: "eval/pass_at_k", label: "pass@k", colour: "#6a1b9a" },
];

function drawEval(canvas) {
  const series = EVAL_SERIES.map((s) => ({
    label: s.label,
    colour: s.colour,
    points: state.records.filter((x) => x[s.key] !== undefined && x[s.key] !== null).map((x) => [x.step, x[s.key]]),
  }));
  lineChart(canvas, series, { xLabel: "step", yLabel: "held-out", yMax: 1, empty: "no evaluation yet (eval.every)" });
}

// multi-turn episodes (data.task=calculator or env): the step record's env/* keys, over
// the episodes rewarded since the last step (rollout/rewarded of them); `per` divides a
// step's sum by that count. Single-turn runs have no env/* key: the charts stay empty.
const EPISODE_SERIES = [
  { key: "env/turns_mean", label: "model turns", colour: "#1565c0" },
  { key: "env/tool_calls", per: "rollout/rewarded", label: "tool calls", colour: "#2e7d32" },
  { key: "env/errors", per: "rollout/rewarded", label: "environment errors", colour: "#c62828" },
];
const TOOL_WAIT_SERIES = [
  { key: "env/tool_wait_s", label: "tool wait, all episodes", colour: "#ef6c00" },
  { key: "env/tool_wait_s", per: "rollout/rewarded", label: "per episode", colour: "#6a1b9a" },
];
const EPISODES_EMPTY = "no multi-turn episode yet (data.task=calculator or env)";
// counters summed over the instances since the run started (docs/speculation.md)
const SPECULATION_SERIES = [
  { key: "speculation/accepted", per: "speculation/verifications", label: "accepted per verification", colour: "#2e7d32" },
  { key: "speculation/wasted", per: "speculation/verifications", label: "rejected per verification", colour: "#c62828" },
];
const SPECULATION_EMPTY = "no draft verified yet (rollout.speculation.method: off, or a full batch)";

function seriesPoints(s) {
  const has = (x, k) => x[k] !== undefined && x[k] !== null;
  return state.records
    .filter((x) => has(x, s.key) && (!s.per || x[s.per] > 0))
    .map((x) => [x.step, s.per ? x[s.key] / x[s.per] : x[s.key]]);
}

function drawSeries(canvas, declared, opts) {
  const series = declared.map((s) => ({ label: s.label, colour: s.colour, points: seriesPoints(s) }));
  lineChart(canvas, series, { xLabel: "step", ...opts });
}

function drawIdle(canvas) {
  const r = state.records;
  lineChart(canvas, [
    { label: "trainer", colour: "#c62828", points: r.filter((x) => x["trainer/idle_ratio"] !== undefined).map((x) => [x.step, x["trainer/idle_ratio"]]) },
    { label: "rollout (mean)", colour: "#1565c0", points: r.filter((x) => x["rollout/idle_ratio"] !== undefined).map((x) => [x.step, x["rollout/idle_ratio"]]) },
  ], { xLabel: "step", yLabel: "idle share", yMax: 1, empty: "no training step yet" });
}

function drawFreshness(canvas, run) {
  // 1: every sample as stale as eta allows (eta as a target); lower: fresher data
  const r = state.records;
  const eta = run.eta || 1;
  lineChart(canvas, [
    { label: "mean staleness / eta", colour: "#6a1b9a", points: r.filter((x) => x["staleness/mean"] !== undefined).map((x) => [x.step, x["staleness/mean"] / eta]) },
    { label: "tokens clipped or masked", colour: "#ef6c00", points: r.filter((x) => x["train/corrected_frac"] !== undefined).map((x) => [x.step, x["train/corrected_frac"]]) },
  ], { xLabel: "step", yLabel: "share", yMax: 1, empty: "no training step yet" });
}

function drawStaleness(canvas, run) {
  const { ctx, width, height } = canvasContext(canvas);
  const rows = state.records.map((r) => {
    const hist = {};
    for (const [k, v] of Object.entries(r)) {
      if (k.startsWith("staleness/hist/")) hist[Number(k.slice(15))] = v;
    }
    return { step: r.step, version: r.version, hist };
  });
  canvas.dataset.bars = String(rows.length);
  if (!rows.length) return empty(ctx, width, height, "no buffer consumed yet");
  const eta = run.eta === null ? Math.max(0, ...rows.flatMap((r) => Object.keys(r.hist).map(Number))) : run.eta;
  const shown = rows.slice(-120);
  const yMax = niceMax(Math.max(...shown.map((r) => Object.values(r.hist).reduce((a, b) => a + b, 0))));
  const box = { x: 48, y: 18, w: width - 60, h: height - 44 };
  axes(ctx, box, shown[shown.length - 1].version, yMax, "consumed buffer V_buf", "trajectories");
  const bw = box.w / shown.length;
  shown.forEach((r, i) => {
    let y = box.y + box.h;
    for (let k = 0; k <= Math.max(eta, ...Object.keys(r.hist).map(Number)); k++) {
      const n = r.hist[k] || 0;
      if (!n) continue;
      const h = (box.h * n) / yMax;
      ctx.fillStyle = STALENESS_COLOURS[k % STALENESS_COLOURS.length];
      ctx.fillRect(box.x + i * bw + 0.5, y - h, Math.max(bw - 1, 1), h);
      y -= h;
    }
  });
  for (let k = 0; k <= eta; k++) {
    ctx.fillStyle = STALENESS_COLOURS[k % STALENESS_COLOURS.length];
    ctx.fillRect(box.x + 8 + k * 90, 2, 10, 10);
    ctx.fillStyle = "#555";
    ctx.textAlign = "left";
    ctx.fillText("staleness " + k, box.x + 22 + k * 90, 11);
  }
}

function drawLoad(canvas, run) {
  const samples = state.load;
  const insts = [...new Set(samples.map((s) => s.inst))].sort((a, b) => a - b);
  const strip = insts.length ? Math.max(22, Math.min(60, Math.floor(480 / insts.length))) : 0;
  canvas.setAttribute("height", String(Math.max(120, strip * insts.length + 34)));
  const { ctx, width, height } = canvasContext(canvas);
  canvas.dataset.instances = String(insts.length);
  canvas.dataset.pullMarks = "0";
  if (!samples.length) return empty(ctx, width, height, "no load sample yet");
  const busy = samples[0].running === null; // a run folder: busy share per step only
  const value = (s) => (busy ? s.busy_ratio || 0 : (s.running || 0) + (s.waiting || 0));
  const t0 = samples[0].time;
  const t1 = Math.max(samples[samples.length - 1].time, t0 + 1e-9);
  const yMax = busy ? 1 : niceMax(samples.reduce((m, s) => Math.max(m, value(s)), 1));
  const box = { x: 48, y: 4, w: width - 60, h: strip * insts.length };
  const X = (t) => box.x + (box.w * (t - t0)) / (t1 - t0);
  const pulls = state.events.filter((e) => e.kind === "pull");
  const pushes = state.events.filter((e) => e.kind === "push" && e.time >= t0);
  canvas.dataset.pulls = String(pulls.length);
  ctx.setLineDash([3, 3]);
  ctx.strokeStyle = "#b0bec5";
  for (const e of pushes) {
    ctx.beginPath();
    ctx.moveTo(X(e.time), box.y);
    ctx.lineTo(X(e.time), box.y + box.h);
    ctx.stroke();
  }
  ctx.setLineDash([]);
  let marks = 0; // Pull marks drawn: pulls of a charted instance since the first sample
  insts.forEach((inst, row) => {
    const top = box.y + row * strip;
    const Y = (v) => top + strip - 2 - ((strip - 6) * Math.min(v, yMax)) / yMax;
    const colour = INSTANCE_COLOURS[row % INSTANCE_COLOURS.length];
    ctx.fillStyle = "#555";
    ctx.textAlign = "right";
    ctx.fillText("inst " + inst, box.x - 4, top + strip / 2 + 4);
    ctx.strokeStyle = "#eee";
    ctx.beginPath();
    ctx.moveTo(box.x, top + strip - 1);
    ctx.lineTo(box.x + box.w, top + strip - 1);
    ctx.stroke();
    const mine = samples.filter((s) => s.inst === inst);
    ctx.fillStyle = colour + "55";
    ctx.strokeStyle = colour;
    ctx.beginPath();
    ctx.moveTo(X(mine[0].time), Y(0));
    for (const s of mine) ctx.lineTo(X(s.time), Y(value(s)));
    ctx.lineTo(X(mine[mine.length - 1].time), Y(0));
    ctx.closePath();
    ctx.fill();
    ctx.stroke();
    ctx.strokeStyle = "#6a1b9a";
    ctx.lineWidth = 2;
    for (const e of pulls) {
      if (e.inst !== inst || e.time < t0) continue;
      marks += 1;
      ctx.beginPath();
      ctx.moveTo(X(e.time), top + 1);
      ctx.lineTo(X(e.time), top + strip - 1);
      ctx.stroke();
    }
    ctx.lineWidth = 1;
  });
  canvas.dataset.pullMarks = String(marks);
  ctx.fillStyle = "#777";
  ctx.textAlign = "center";
  const unit = run.clock === "virtual" ? "virtual s" : "s";
  const what = busy ? "busy share per step" : "running + waiting trajectories (max " + fmt(yMax) + ")";
  ctx.fillText(what + " · time " + fmt(t0, 0) + "–" + fmt(t1, 0) + " " + unit, box.x + box.w / 2, box.y + box.h + 16);
}

window.addEventListener("resize", () => state.overview && render());
poll();
