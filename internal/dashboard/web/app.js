// The trajflow run dashboard. Everything here is served by the trajflow
// binary; the page fetches only its own JSON API (/api/...).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4d7c0f", "#be185d"];

// ---- DOM helpers -----------------------------------------------------

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const k of kids.flat()) {
    if (k === null || k === undefined) continue;
    e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  }
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x) && digits === undefined) return String(x);
  return x.toFixed(digits === undefined ? 3 : digits);
}

function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }

function card(key, label, value) {
  return el("div", { class: "card", "data-field": key },
    el("div", { class: "k", text: label }), el("div", { class: "v", text: value }));
}

// table builds a table from rows; cols are [header, fn(row) -> text|Node, numeric?].
function table(cls, cols, rows) {
  const head = el("tr", {}, cols.map(c => el("th", { text: c[0] })));
  const body = el("tbody", {}, rows.map(r => el("tr", {}, cols.map(c => {
    const v = c[1](r);
    return el("td", { class: c[2] ? "num" : null }, v instanceof Node ? v : fmtCell(v));
  }))));
  return el("table", { class: cls }, el("thead", {}, head), body);
}

function fmtCell(v) { return typeof v === "number" ? fmt(v) : (v === undefined || v === null ? "–" : String(v)); }

function note(text) { return el("p", { class: "note", text }); }

// ---- charts ------------------------------------------------------------

// lineChart draws series of points {x, y, lo?, hi?} with error bars where
// lo/hi are given. opts: id, title, xlabel, ylabel, w, h, ymin, ymax.
function lineChart(opts, series) {
  const W = opts.w || 360, H = opts.h || 200, L = 44, R = 10, T = 10, B = 30;
  const pts = series.flatMap(s => s.points);
  const box = el("div", { class: "chartbox" }, el("h4", { text: opts.title }));
  const s = svg("svg", { class: "chart", "data-chart": opts.id, width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  box.append(s);
  if (pts.length === 0) {
    const t = svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle" });
    t.textContent = "no data";
    s.append(t);
    return box;
  }
  let x0 = Math.min(...pts.map(p => p.x)), x1 = Math.max(...pts.map(p => p.x));
  let y0 = opts.ymin !== undefined ? opts.ymin : Math.min(0, ...pts.map(p => p.lo !== undefined ? p.lo : p.y));
  let y1 = opts.ymax !== undefined ? opts.ymax : Math.max(...pts.map(p => p.hi !== undefined ? p.hi : p.y));
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y1 = y0 + 1; }
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  axes(s, W, H, L, R, T, B, x0, x1, y0, y1, X, Y, { ...opts, intX: pts.every(p => Number.isInteger(p.x)) });
  series.forEach((sr, i) => {
    const color = sr.color || COLORS[i % COLORS.length];
    const ps = sr.points.slice().sort((a, b) => a.x - b.x);
    if (ps.length > 1) {
      s.append(svg("polyline", { class: "line", "data-series": sr.name, fill: "none", stroke: color, "stroke-width": 1.5,
        points: ps.map(p => `${X(p.x).toFixed(1)},${Y(p.y).toFixed(1)}`).join(" ") }));
    }
    for (const p of ps) {
      if (p.lo !== undefined && p.hi !== undefined) {
        s.append(svg("line", { class: "err", x1: X(p.x), x2: X(p.x), y1: Y(p.lo), y2: Y(p.hi), stroke: color, "stroke-opacity": 0.5 }));
      }
      const c = svg("circle", { class: "pt", "data-series": sr.name, cx: X(p.x), cy: Y(p.y), r: 2.5, fill: color });
      const tip = svg("title", {});
      tip.textContent = `${sr.name} @ ${p.x}: ${fmt(p.y)}` + (p.lo !== undefined ? ` [${fmt(p.lo)}, ${fmt(p.hi)}]` : "");
      c.append(tip);
      s.append(c);
    }
  });
  legend(s, series, L);
  return box;
}

function axes(s, W, H, L, R, T, B, x0, x1, y0, y1, X, Y, opts) {
  s.append(svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#99a" }));
  s.append(svg("line", { x1: L, x2: L, y1: T, y2: H - B, stroke: "#99a" }));
  let xs = [0, 1, 2, 3, 4].map(i => x0 + (x1 - x0) * i / 4);
  if (opts.intX) {
    const step = Math.max(1, Math.ceil((x1 - x0) / 6));
    xs = [];
    for (let x = Math.ceil(x0); x <= x1; x += step) xs.push(x);
  }
  for (let i = 0; i <= 4; i++) {
    const yv = y0 + (y1 - y0) * i / 4;
    const ty = svg("text", { x: L - 4, y: Y(yv) + 3, "text-anchor": "end" });
    ty.textContent = tick(yv);
    s.append(ty, svg("line", { x1: L, x2: W - R, y1: Y(yv), y2: Y(yv), stroke: "#eef" }));
  }
  for (const xv of opts.noX ? [] : xs) {
    const tx = svg("text", { x: X(xv), y: H - B + 12, "text-anchor": "middle" });
    tx.textContent = tick(xv);
    s.append(tx);
  }
  if (opts.xlabel) {
    const t = svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" });
    t.textContent = opts.xlabel;
    s.append(t);
  }
}

function tick(v) {
  const a = Math.abs(v);
  if (a !== 0 && (a < 0.01 || a >= 1e5)) return v.toExponential(1);
  return Number.isInteger(v) ? String(v) : v.toFixed(a < 1 ? 3 : 1);
}

function legend(s, series, L) {
  if (series.length < 2) return;
  let x = L + 4;
  series.forEach((sr, i) => {
    const color = sr.color || COLORS[i % COLORS.length];
    s.append(svg("rect", { x, y: 2, width: 8, height: 8, fill: color }));
    const t = svg("text", { x: x + 10, y: 10 });
    t.textContent = sr.name;
    s.append(t);
    x += 14 + 6 * sr.name.length;
  });
}

// barChart draws labelled bars {label, value}.
function barChart(opts, bars) {
  const W = opts.w || 360, H = opts.h || 200, L = 44, B = 46, T = 10, R = 10;
  const box = el("div", { class: "chartbox" }, el("h4", { text: opts.title }));
  const s = svg("svg", { class: "chart", "data-chart": opts.id, width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  box.append(s);
  if (bars.length === 0) {
    const t = svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle" });
    t.textContent = "no data";
    s.append(t);
    return box;
  }
  const vmax = Math.max(...bars.map(b => b.value), 1e-12);
  const bw = Math.min(60, (W - L - R) / bars.length);
  const Y = v => H - B - v / vmax * (H - T - B);
  axes(s, W, H, L, R, T, B, 0, 1, 0, vmax, x => L + x * (W - L - R), Y, { noX: true });
  bars.forEach((b, i) => {
    const r = svg("rect", { class: "bar", x: L + i * bw + 2, y: Y(b.value), width: Math.max(1, bw - 4), height: H - B - Y(b.value),
      fill: b.color || COLORS[0] });
    const tip = svg("title", {});
    tip.textContent = `${b.label}: ${fmt(b.value)}`;
    r.append(tip);
    const t = svg("text", { x: L + i * bw + bw / 2, y: H - B + 12, "text-anchor": "end",
      transform: `rotate(-30 ${L + i * bw + bw / 2} ${H - B + 12})` });
    t.textContent = b.label.length > 18 ? b.label.slice(0, 17) + "…" : b.label;
    s.append(r, t);
  });
  return box;
}

function charts(...boxes) { return el("div", { class: "charts" }, boxes); }

// ---- panels ------------------------------------------------------------

function renderHeader(S) {
  document.getElementById("run-id").textContent = "run " + S.run.run;
  document.getElementById("run-meta").textContent =
    `${S.run.source} · ${S.run.mode} mode · contract ${S.run.contract_hash.slice(0, 19)}… · read ${new Date(S.run.read_at).toLocaleTimeString()}` +
    (S.run.live ? " · live, refreshing" : "");
  const err = document.getElementById("refresh-error");
  err.hidden = !S.refresh_error;
  err.textContent = S.refresh_error ? "last refresh failed: " + S.refresh_error : "";
}

function renderOverview(S) {
  const o = S.overview;
  const body = el("div", { class: "body" },
    el("div", { class: "cards" },
      card("updates", "updates", fmt(o.updates)),
      card("rounds", "rounds dispatched", fmt(o.rounds)),
      card("batches", "batches", fmt(o.batches)),
      card("attempts_launched", "attempts launched", fmt(o.attempts_launched)),
      card("trajectories_recorded", "trajectories recorded", fmt(o.trajectories_recorded)),
      card("trajectories_admitted", "admitted", fmt(o.trajectories_admitted)),
      card("trajectories_filtered", "filtered", fmt(o.trajectories_filtered)),
      card("quarantined", "quarantined", fmt(o.quarantined)),
      card("duplicates_admitted", "duplicates admitted", fmt(o.duplicates_admitted)),
      card("undecided", S.run.live ? "in flight" : "lost", fmt(o.undecided)),
      card("eval_success_initial", "hidden eval, first", fmt(o.eval_success_initial, 3)),
      card("eval_success_final", "hidden eval, last", fmt(o.eval_success_final, 3)),
      card("last_version", "last policy version", fmt(o.last_version))));
  // Unreadable snapshot files first: every count of the panel lacks their
  // records, so a difference from summary.json is no evidence against the run.
  const unreadable = o.unreadable_files || [];
  if (unreadable.length) {
    body.prepend(el("div", { class: "error", id: "unreadable-files" },
      el("strong", { text: `${unreadable.length} snapshot file${unreadable.length === 1 ? "" : "s"} unreadable` }),
      " (missing, or failing verification): the counts below lack their records and the checks against summary.json " +
      "compare partial data; the errors are under safety and integrity, hashes and lineage.",
      el("ul", {}, unreadable.map(f => el("li", { text: f })))));
  }
  if (o.checks && o.checks.length) {
    body.append(el("h3", { text: "against the run's summary.json" }),
      table("checks", [["count", c => c.name], ["dashboard", c => c.dashboard, 1], ["summary.json", c => c.recorded, 1],
        ["", c => c.partial
          ? el("span", { class: "bad", text: (c.ok ? "equal, " : "") + c.partial })
          : el("span", { class: c.ok ? "ok" : "bad", text: c.ok ? "equal" : "DIFFERENT" })]], o.checks));
  }
  return body;
}

function renderCapability(S) {
  const c = S.capability, body = el("div", { class: "body" });
  const vs = c.by_version;
  body.append(note("verified success: " + c.success_definition + "; intervals are Wilson 95%."));
  const passSeries = c.ks.map(k => ({ name: "pass@" + k,
    points: vs.filter(v => v.pass_at_k.some(p => p.k === k)).map(v => ({ x: v.version, y: v.pass_at_k.find(p => p.k === k).value })) }));
  const evalPts = c.eval.map(e => ({ x: e.version, y: e.success, lo: e.lo, hi: e.hi }));
  const recorded = (c.recorded_evals || []).map(e => ({ x: e.version, y: e.success }));
  body.append(charts(
    lineChart({ id: "success-by-version", title: "verified success of rollouts by behavior version", xlabel: "policy version", ymin: 0, ymax: 1 },
      [{ name: "success", points: vs.map(v => ({ x: v.version, y: v.success, lo: v.lo, hi: v.hi })) }]),
    lineChart({ id: "pass-at-k", title: "pass@k over each group's samples (one task, one version)", xlabel: "policy version", ymin: 0, ymax: 1 }, passSeries),
    lineChart({ id: "validity", title: "action validity (share of turns parsed and authorized)", xlabel: "policy version", ymin: 0, ymax: 1 },
      [{ name: "valid", points: vs.map(v => ({ x: v.version, y: v.validity })) }]),
    lineChart({ id: "eval-success", title: "hidden eval success (held out)", xlabel: "policy version", ymin: 0, ymax: 1 },
      [{ name: "re-measured", points: evalPts }, { name: "summary.json", points: recorded }])));
  body.append(el("h3", { text: "by behavior version" }),
    table("by-version", [["version", v => v.version, 1], ["attempts", v => v.attempts, 1], ["judged", v => v.judged, 1],
      ["successes", v => v.successes, 1], ["success", v => v.success, 1], ["95% interval", v => `[${fmt(v.lo)}, ${fmt(v.hi)}]`],
      ["groups", v => v.groups, 1], ...c.ks.map(k => ["pass@" + k, v => { const p = v.pass_at_k.find(q => q.k === k); return p ? p.value : null; }, 1]),
      ["validity", v => v.validity, 1], ["invalid", v => v.turns_invalid, 1], ["denied", v => v.turns_denied, 1]], vs));
  body.append(el("h3", { text: "hidden eval" }), note(c.eval_note || ""),
    table("eval", [["version", e => e.version, 1], ["attempts", e => e.attempts, 1], ["successes", e => e.successes, 1],
      ["success", e => e.success, 1], ["95% interval", e => `[${fmt(e.lo)}, ${fmt(e.hi)}]`],
      ["pass@k", e => e.pass_at_k.map(p => `@${p.k} ${fmt(p.value)}`).join("  ")],
      ["summary.json", e => e.recorded === undefined ? null : e.recorded, 1],
      ["", e => e.recorded === undefined ? "" : el("span", { class: e.match ? "ok" : "bad", text: e.match ? "equal" : "DIFFERENT" })]], c.eval));
  const tasks = c.by_task.slice(0, 15);
  body.append(el("h3", { text: `by task (${tasks.length} of ${c.tasks} tasks, most attempts first; find the others in the viewer)` }),
    table("by-task", [["task", t => taskLink(t.task)], ["attempts", t => t.attempts, 1], ["admitted", t => t.admitted, 1],
      ["successes", t => t.successes, 1], ["success", t => t.success, 1], ["95% interval", t => `[${fmt(t.lo)}, ${fmt(t.hi)}]`]], tasks));
  return body;
}

function taskLink(task) {
  return el("a", { href: "#viewer", text: task, onclick: () => { document.getElementById("q-task").value = task; find(); } });
}

function renderLearning(S) {
  const l = S.learning, body = el("div", { class: "body" });
  if (l.note) body.append(note(l.note));
  const u = l.updates, xv = r => r.version;
  const line = (name, f) => ({ name, points: u.map(r => ({ x: xv(r), y: f(r) })) });
  const comps = [...new Set(l.by_version.flatMap(v => v.components.map(c => c.name)))];
  body.append(charts(
    lineChart({ id: "loss", title: "loss and policy loss (first step)", xlabel: "update" }, [line("loss", r => r.loss), line("policy loss", r => r.policy_loss)]),
    lineChart({ id: "kl", title: "approx KL to behavior (last step) and KL to reference", xlabel: "update" }, [line("approx KL", r => r.approx_kl), line("KL ref", r => r.kl)]),
    lineChart({ id: "clip", title: "clip fraction by advantage sign (last step)", xlabel: "update", ymin: 0 }, [line("A>0", r => r.clip_frac_pos), line("A<0", r => r.clip_frac_neg)]),
    lineChart({ id: "ratio", title: "ratio to behavior: first step (on policy = 1) and last step", xlabel: "update" },
      [line("first step", r => r.first_ratio_mean), { name: "last step", points: u.map(r => ({ x: r.version, y: r.ratio_mean, lo: r.ratio_min, hi: r.ratio_max })) }]),
    lineChart({ id: "entropy", title: "entropy (nats)", xlabel: "update", ymin: 0 }, [line("first step", r => r.entropy), line("last step", r => r.last_entropy)]),
    lineChart({ id: "grad-norm", title: "gradient norm before clipping", xlabel: "update", ymin: 0 }, [line("grad norm", r => r.grad_norm)]),
    lineChart({ id: "reward-components", title: "reward components (mean value) by behavior version", xlabel: "policy version" },
      comps.map(n => ({ name: n, points: l.by_version.filter(v => v.components.some(c => c.name === n)).map(v => ({ x: v.version, y: v.components.find(c => c.name === n).mean })) }))),
    lineChart({ id: "advantages", title: "turn advantages: mean with p10–p90", xlabel: "policy version" },
      [{ name: "advantage", points: l.by_version.filter(v => v.advantage.n > 0).map(v => ({ x: v.version, y: v.advantage.mean, lo: v.advantage.p10, hi: v.advantage.p90 })) }]),
    lineChart({ id: "lengths", title: "trajectory length (tokens, mean with p10–p90)", xlabel: "policy version", ymin: 0 },
      [{ name: "tokens", points: l.by_version.map(v => ({ x: v.version, y: v.tokens.mean, lo: v.tokens.p10, hi: v.tokens.p90 })) },
        { name: "action tokens", points: l.by_version.map(v => ({ x: v.version, y: v.action_tokens.mean })) }])));
  body.append(el("h3", { text: "ratio and KL to the behavior policy by lag (first optimizer step of every update, token-weighted)" }),
    table("lag", [["lag", r => r.lag, 1], ["tokens", r => r.tokens, 1], ["updates", r => r.updates, 1], ["ratio mean", r => r.ratio_mean, 1],
      ["ratio min", r => r.ratio_min, 1], ["ratio max", r => r.ratio_max, 1], ["approx KL (k2)", r => r.approx_kl, 1], ["k3", r => r.k3, 1]], l.lag));
  body.append(el("h3", { text: "by behavior version" }),
    table("learning-by-version", [["version", v => v.version, 1], ["rewarded", v => v.rewarded, 1], ["reward mean", v => v.reward_mean, 1],
      ["components", v => v.components.map(c => `${c.name} v${c.version}: ${fmt(c.mean)}` + (c.errors ? ` (${c.errors} unavailable)` : "")).join("; ")],
      ["groups", v => v.groups, 1], ["zero-variance groups", v => v.zero_variance_groups, 1], ["group std mean", v => v.group_std_mean, 1],
      ["zero advantages", v => pct(v.zero_advantage_share), 1], ["return mean", v => v.return.mean, 1], ["turns mean", v => v.turns.mean, 1]], l.by_version));
  body.append(el("h3", { text: "updates" }),
    table("updates", [["version", r => r.version, 1], ["batch", r => r.batch_id.slice(0, 12)], ["tokens", r => r.tokens, 1],
      ["segments", r => r.segments, 1], ["loss", r => r.loss, 1], ["approx KL", r => r.approx_kl, 1], ["clip A>0", r => r.clip_frac_pos, 1],
      ["clip A<0", r => r.clip_frac_neg, 1], ["entropy", r => r.entropy, 1], ["grad norm", r => r.grad_norm, 1],
      ["duplicates", r => r.duplicates, 1], ["step s", r => r.step_seconds, 1],
      ["rollout tokens", r => r.cost ? r.cost.rollout.rollout_tokens : "", 1], ["rejected tokens", r => r.cost ? r.cost.rejected.rollout_tokens : "", 1],
      ["failed tokens", r => r.cost && r.cost.failed ? r.cost.failed.rollout_tokens : "", 1],
      ["optimizer tokens", r => r.cost ? r.cost.training.optimizer_tokens : "", 1]], u));
  return body;
}

function renderSystems(S) {
  const s = S.systems, body = el("div", { class: "body" });
  const stageSeries = s.stages.map(st => ({ name: st.stage, points: st.series.map((v, i) => ({ x: +(i * s.bucket_seconds).toFixed(2), y: v })) }));
  body.append(charts(
    lineChart({ id: "stage-tokens", title: "tokens/s per stage (output topic, by broker time)", xlabel: "seconds since the first record", w: 520 }, stageSeries),
    lineChart({ id: "trainer-tokens", title: "trainer: batch tokens over the time since the previous release", xlabel: "update" },
      [{ name: "tokens/s", points: s.trainer.map(r => ({ x: r.version, y: r.tokens_per_s })) }]),
    barChart({ id: "yield-losses", title: `accepted-token yield ${pct(s.yield.yield)}: lost action tokens` },
      s.yield.losses.map(l => ({ label: `${l.kind}: ${l.reason}`, value: l.action_tokens, color: "#dc2626" }))),
    lineChart({ id: "sync", title: "seconds: batch → release (train) and release → first rollout with it (sync)", xlabel: "policy version", ymin: 0 },
      [{ name: "train", points: s.sync.filter(r => r.train_seconds !== null).map(r => ({ x: r.version, y: r.train_seconds })) },
        { name: "sync", points: s.sync.filter(r => r.sync_seconds !== null).map(r => ({ x: r.version, y: r.sync_seconds })) }]),
    barChart({ id: "policy-lag", title: "trained tokens by policy lag" }, s.policy_lag.map(p => ({ label: "lag " + p.lag, value: p.tokens }))),
    lineChart({ id: "attempt-latency", title: "attempt wall time (s): median and p99 by behavior version", xlabel: "policy version", ymin: 0 },
      [line2("p50", s.latency.by_version, v => v.attempt_seconds.p50), line2("p99", s.latency.by_version, v => v.attempt_seconds.p99)])));
  body.append(el("h3", { text: "stages" }),
    table("stages", [["stage", r => r.stage], ["topic", r => r.topic], ["messages", r => r.messages, 1], ["records", r => r.records, 1],
      ["tokens", r => r.tokens, 1], ["active s", r => r.seconds, 1], ["tokens/s", r => r.tokens_per_s, 1]], s.stages));
  body.append(el("h3", { text: "consumer lag" }), s.consumer_lag_note ? note(s.consumer_lag_note) : "",
    table("consumer-lag", [["group", r => r.group], ["topic", r => r.topic], ["end", r => r.end, 1], ["committed", r => r.committed, 1],
      ["lag", r => r.lag, 1], ["uncommitted partitions", r => r.uncommitted_partitions, 1]], s.consumer_lag || []));
  const y = s.yield;
  body.append(el("h3", { text: "accepted-token yield" }),
    el("p", {}, `generated action tokens ${y.generated_action_tokens}, trained ${y.trained_action_tokens}: yield `, el("b", { id: "yield", text: pct(y.yield) }),
      `; ${y.attempts_without_trajectory} launched attempts have no trajectory.`),
    table("losses", [["kind", l => l.kind], ["reason", l => l.reason], ["attempts", l => l.attempts, 1], ["action tokens", l => l.action_tokens, 1],
      ["share", l => pct(l.share), 1]], y.losses));
  body.append(el("h3", { text: "releases" }),
    table("sync", [["version", r => r.version, 1], ["released", r => new Date(r.released_at).toLocaleTimeString()],
      ["batch → release s", r => r.train_seconds, 1], ["optimizer s", r => r.step_seconds, 1], ["release → first rollout s", r => r.sync_seconds, 1]], s.sync));
  body.append(latencySection(s.latency));
  body.append(el("h3", { text: "pack windows" }),
    table("windows", [["batch", r => r.batch_index, 1], ["closed by", r => r.closed_by], ["records", r => r.records, 1], ["admitted", r => r.admitted, 1],
      ["filtered at close", r => r.filtered, 1], ["tokens", r => r.tokens, 1], ["trained", r => r.trained_tokens, 1], ["efficiency", r => r.efficiency, 1],
      ["max lag", r => r.max_lag, 1], ["success", r => r.success_rate, 1]], s.windows || []));
  return body;
}

function line2(name, rows, y) { return { name, points: (rows || []).map(v => ({ x: v.version, y: y(v) })) }; }

// latencySection: where rollout time went, per turn and per attempt, the
// long tail, by version and by domain, and the slowest attempts.
function latencySection(l) {
  const distCols = [["n", d => d.n, 1], ["mean", d => d.mean, 1], ["p50", d => d.p50, 1], ["p90", d => d.p90, 1], ["p99", d => d.p99, 1], ["max", d => d.max, 1]];
  const dists = [["generation per turn, ms", l.generation_ms], ["environment step per turn, ms", l.env_step_ms], ["attempt wall time, s", l.attempt_seconds]];
  return el("div", {}, el("h3", { text: "rollout latency" }),
    el("p", {}, `The policy server's answers took ${pct(l.generation_share)} of the attempts' wall time, the environment's steps ${pct(l.env_share)}; `,
      el("b", { id: "tail-attempts", text: String(l.tail_attempts) }), ` of ${l.attempt_seconds.n} timed attempts took more than ${l.tail_factor}× the median of their version` +
      (l.untimed_attempts ? `; ${l.untimed_attempts} attempts carry no times.` : ".")),
    table("latency", [["", r => r[0]], ...distCols.map(c => [c[0], r => c[1](r[1]), 1])], dists),
    table("latency-by-version", [["version", v => v.version, 1], ["attempts", v => v.attempt_seconds.n, 1], ["attempt p50 s", v => v.attempt_seconds.p50, 1],
      ["p99 s", v => v.attempt_seconds.p99, 1], ["max s", v => v.attempt_seconds.max, 1], ["in the tail", v => v.tail_attempts, 1],
      ["generation p50 ms", v => v.generation_ms.p50, 1], ["environment p50 ms", v => v.env_step_ms.p50, 1], ["environment p99 ms", v => v.env_step_ms.p99, 1]], l.by_version || []),
    table("latency-by-domain", [["domain", d => d.domain], ["attempts", d => d.attempts, 1], ["turns", d => d.turns, 1],
      ["environment p50 ms", d => d.env_step_ms.p50, 1], ["p90 ms", d => d.env_step_ms.p90, 1], ["p99 ms", d => d.env_step_ms.p99, 1], ["max ms", d => d.env_step_ms.max, 1],
      ["invalid turns", d => d.turns_invalid, 1], ["denied turns", d => d.turns_denied, 1]], l.by_domain || []),
    el("h3", { text: "failed attempts and retried environment calls (census)" }),
    (l.failures || []).length ? table("failures", [["kind", f => f.kind], ["stage", f => f.stage], ["reason", f => f.reason],
      ["infrastructure", f => f.infra ? "yes" : "no"], ["events", f => f.events, 1], ["attempts", f => f.attempts, 1]], l.failures)
      : note("none: no attempt failed and no environment call was retried"),
    el("h3", { text: "slowest attempts" }),
    table("slowest", [["attempt", a => attemptLink(a.id)], ["task", a => a.task], ["version", a => a.version, 1], ["seconds", a => a.seconds, 1],
      ["turns", a => a.turns, 1], ["generation s", a => a.generation_seconds, 1], ["environment s", a => a.env_seconds, 1],
      ["in the tail", a => a.in_tail ? "yes" : "no"], ["outcome", a => a.outcome || "undecided"]], l.slowest || []));
}

function renderIntegrity(S) {
  const g = S.integrity, body = el("div", { class: "body" });
  const h = g.hashes, files = h.snapshot_files;
  body.append(el("div", { class: "cards" },
    card("denied_turns", "denied turns", fmt(g.denied.turns)),
    card("invalid_turns", "invalid turns", fmt(g.invalid.turns)),
    card("eval_access", "eval-id access", fmt(g.eval_access.incidents + g.eval_access.quarantined + g.eval_access.census + g.eval_access.eval_split_trajectories)),
    card("incidents", "incidents", fmt(g.incident_total)),
    card("quarantine", "quarantine records", fmt(g.quarantine.total)),
    card("unattributed", "unattributed quarantine", fmt(g.quarantine.unattributed)),
    card("hash_failures", "hash failures", fmt((files ? files.failures.length : 0) + h.release_failures.length + h.manifest_mismatch.length + h.header_mismatch)),
    card("releases_verified", "releases verified", fmt(h.releases_verified)),
    card("files_verified", "snapshot files verified", files ? fmt(files.verified) : "live")));
  body.append(charts(
    barChart({ id: "denials", title: "authorization denials by policy version" }, g.denied.by_version.map(v => ({ label: "v" + v.version, value: v.count, color: "#b45309" }))),
    barChart({ id: "quarantine-reasons", title: "quarantine by stage and reason" }, g.quarantine.reasons.map(r => ({ label: `${r.stage}: ${r.reason}`, value: r.count, color: "#7c3aed" })))));
  body.append(el("h3", { text: "denials and invalid actions by reason" }),
    table("denial-reasons", [["decision", r => r.d], ["reason", r => r.reason], ["turns", r => r.count, 1]],
      [...g.denied.reasons.map(r => ({ d: "denied", ...r })), ...g.invalid.reasons.map(r => ({ d: "invalid", ...r }))]));
  body.append(el("h3", { text: "hidden-eval ids on the training plane" }),
    table("eval-access", [["incidents", r => r.incidents, 1], ["quarantined", r => r.quarantined, 1], ["census events", r => r.census, 1],
      ["eval-split trajectories", r => r.eval_split_trajectories, 1]], [g.eval_access]));
  body.append(el("h3", { text: `incidents (${g.incident_total})` }),
    table("incidents", [["stage", i => i.stage], ["reason", i => i.reason], ["attempt", i => attemptLink(i.attempt_id)], ["detail", i => i.detail], ["source", i => i.source]], g.incidents || []));
  body.append(el("h3", { text: `quarantine (${g.quarantine.total} records, ${g.quarantine.unattributed} not tied to an attempt)` }),
    table("quarantine", [["stage", q => q.stage], ["reason", q => q.reason], ["kind", q => q.kind], ["attempts", q => (q.attempts || []).length ? attemptLink(q.attempts[0]) : q.id],
      ["detail", q => q.detail], ["source", q => q.source]], g.quarantine.records || []));
  const fails = [...(files ? files.failures.map(f => ({ what: f.file, error: f.error })) : []),
    ...h.release_failures.map(r => ({ what: "release v" + r.version, error: r.error })),
    ...h.manifest_mismatch.map(m => ({ what: "manifest", error: m })),
    ...(files ? files.gaps.map(gp => ({ what: "offsets", error: gp })) : [])];
  body.append(el("h3", { text: "hashes and lineage" }),
    note(files ? `${files.verified} snapshot files verified against their sidecars and lineage; ${h.releases_verified} release checkpoints verified against their manifests; ${h.header_mismatch} header mismatches quarantined.`
      : `${h.releases_verified} release checkpoints verified against their manifests; ${h.header_mismatch} header mismatches quarantined.`),
    table("hash-failures", [["what", f => f.what], ["error", f => f.error]], fails));
  const und = Object.entries(g.undecodable || {}).map(([k, v]) => ({ topic: k, n: v }));
  if (und.length || (g.problems || []).length) {
    body.append(el("h3", { text: "records the dashboard could not read" }), table("undecodable", [["topic", r => r.topic], ["messages", r => r.n, 1]], und),
      el("ul", {}, (g.problems || []).map(p => el("li", { text: p }))));
  }
  return body;
}

function attemptLink(id) {
  if (!id) return "–";
  return el("a", { href: "#viewer", text: id.slice(0, 12), title: id, onclick: () => openTrajectory(id) });
}

// ---- trajectory viewer -------------------------------------------------

let colorMode = "logprob";
let current = null;

async function find(ev) {
  if (ev) ev.preventDefault();
  const q = new URLSearchParams();
  for (const k of ["id", "task", "group", "version", "outcome"]) {
    const v = document.getElementById("q-" + k).value.trim();
    if (v) q.set(k, v);
  }
  const res = document.getElementById("results");
  const r = await fetch("/api/trajectories?" + q.toString());
  const list = await r.json();
  if (!r.ok) { res.replaceChildren(el("div", { class: "error", text: list.error })); return; }
  res.replaceChildren(el("p", { text: `${list.total} attempts match` + (list.total > list.rows.length ? `; the first ${list.rows.length}:` : ":") }),
    table("results", [["id", t => t.id.slice(0, 16)], ["task", t => t.task], ["group", t => t.group.slice(0, 12)], ["member", t => t.member, 1],
      ["version", t => t.version, 1], ["turns", t => t.turns, 1], ["tokens", t => t.tokens, 1], ["reward", t => t.reward, 1],
      ["verified", t => t.success === null ? "–" : (t.success ? "success" : "fail")], ["outcome", t => t.outcome || "undecided"], ["reason", t => t.reason || ""]], list.rows));
  res.querySelectorAll("tbody tr").forEach((tr, i) => {
    tr.classList.add("pick");
    tr.dataset.id = list.rows[i].id;
    tr.addEventListener("click", () => openTrajectory(list.rows[i].id));
  });
}

async function openTrajectory(id) {
  const r = await fetch("/api/trajectory?id=" + encodeURIComponent(id));
  const d = await r.json();
  const box = document.getElementById("detail");
  if (!r.ok) { box.replaceChildren(el("div", { class: "error", text: d.error })); return; }
  current = d;
  location.hash = "traj=" + id;
  box.replaceChildren(renderDetail(d));
  box.scrollIntoView();
}

function renderDetail(d) {
  const t = d.trajectory, a = d.task;
  const body = el("div", { id: "trajectory", "data-id": d.id });
  const meta = t || a || {};
  body.append(el("h3", { text: "attempt " + d.id }),
    table("meta", [["task", () => meta.task_id], ["group", () => meta.group_id], ["member", () => meta.member, 1], ["attempt", () => meta.attempt, 1],
      ["seed", () => meta.seed, 1], ["status", () => t ? `${t.status} (${t.end}: ${t.end_reason})` : "no trajectory recorded"],
      ["fate", () => d.fate.outcome ? `${d.fate.outcome}${d.fate.reason ? " (" + d.fate.reason + ")" : ""} at ${d.fate.stage}` : "undecided"],
      ["latency ms", () => t ? (t.finished_at_us - t.started_at_us) / 1000 : null, 1]], [0]));
  if (!t) { body.append(census(d)); return body; }
  body.append(el("p", { class: "note", text: "decoded with the " + d.vocabulary + "; sampler " + t.sampler_id.slice(0, 19) + "…, parser " + t.parser_version }));
  const modes = el("div", { id: "color-modes" }, "colour tokens by ",
    ...["logprob", "advantage", "mask"].map(m => el("label", {}, el("input", { type: "radio", name: "cmode", value: m, id: "cmode-" + m,
      onchange: () => { colorMode = m; paintTokens(); } }), " " + m + " ")));
  body.append(modes, el("div", { id: "legend", class: "legend" }), el("div", { id: "tokens" }));
  body.append(el("h3", { text: "turns" }),
    table("turns", [["turn", x => x.index, 1], ["version", x => x.version, 1], ["decision", x => x.decision + (x.reason ? ": " + x.reason : "")],
      ["action", x => x.call], ["observation", x => x.result], ["prompt/action/obs tokens", x => `${x.prompt}/${x.action}/${x.observation}`],
      ["reward", x => x.reward, 1], ["return", x => x.return, 1], ["advantage", x => x.advantage, 1], ["gen ms", x => x.gen_ms, 1], ["env ms", x => x.env_ms, 1]], d.turns));
  body.append(el("h3", { text: "reward components (total " + fmt(d.reward_total) + ")" }),
    table("rewards", [["name", c => c.name], ["version", c => c.version], ["evaluator", c => c.evaluator_version], ["scope", c => c.scope + (c.turn >= 0 ? " " + c.turn : "")],
      ["raw", c => c.raw, 1], ["weight", c => c.weight, 1], ["transform", c => c.transform], ["value", c => c.value, 1],
      ["evidence", c => el("pre", { class: "evidence", text: pretty(c.evidence) })], ["error", c => c.error || ""]], d.rewards || []));
  if (d.scored) {
    const g = d.scored.group;
    body.append(el("p", {}, `advantages by ${d.scored.estimator} v${d.scored.estimator_version}; group: ${g.size}/${g.expected} members, mean ${fmt(g.mean)}, std ${fmt(g.std)}` +
      (g.zero_var ? ", zero variance" : "") + (g.filtered ? `, filtered (${g.filtered})` : "")));
  }
  body.append(census(d));
  body.append(el("h3", { text: "batch and update" }), trained(d));
  if ((d.quarantine || []).length) {
    body.append(el("h3", { text: "quarantine" }), table("traj-quarantine", [["stage", q => q.stage], ["reason", q => q.reason], ["detail", q => q.detail], ["source", q => q.source]], d.quarantine));
  }
  if ((d.incidents || []).length) {
    body.append(el("h3", { text: "incidents" }), table("traj-incidents", [["stage", i => i.stage], ["reason", i => i.reason], ["detail", i => i.detail]], d.incidents));
  }
  setTimeout(() => { document.getElementById("cmode-" + colorMode).checked = true; paintTokens(); });
  return body;
}

function census(d) {
  return el("div", {}, el("h3", { text: `census history (${d.census.length} events)` }),
    el("div", { id: "census-history" }, table("census", [["at", e => new Date(e.at_us / 1000).toISOString().slice(11, 23)], ["kind", e => e.kind], ["stage", e => e.stage],
      ["reason", e => e.reason || ""], ["version", e => e.policy_version || 0, 1], ["tokens", e => e.tokens || "", 1], ["reward", e => e.reward || "", 1],
      ["batch", e => e.batch_id ? e.batch_id.slice(0, 12) : ""], ["update", e => e.update || "", 1], ["latency ms", e => e.latency_us ? e.latency_us / 1000 : "", 1]], d.census)));
}

function trained(d) {
  const b = d.batch, u = d.update, w = d.window;
  if (!b) return note(w ? `decided in window ${w.batch_index} without being admitted` : "not in any batch");
  const rows = [
    ["batch", `${b.batch_id} (index ${b.batch_index}, packed at trainer version ${b.trainer_version})`],
    ["row / segment", `row ${b.row}, segment ${b.segment}, positions ${b.start}–${b.start + b.length - 1}` + (b.truncated ? ", truncated" : "")],
    ["trained tokens", `${b.trained_tokens} (mask 1), weight ${b.weight}, admitted ${b.admissions}×`],
    ["alignment", b.aligned ? "input ids equal the stream; every trained token's old log-prob equals its behavior log-prob" : "MISALIGNED: " + b.misaligned],
  ];
  if (u) rows.push(["update", `version ${u.from_version} → ${u.version}: loss ${fmt(u.loss)}, approx KL ${fmt(u.approx_kl)}, clip A>0 ${fmt(u.clip_frac_pos)} A<0 ${fmt(u.clip_frac_neg)}, entropy ${fmt(u.entropy)}, ${u.tokens} tokens`]);
  else rows.push(["update", "no update record of this batch (trainer not done, or no release directory)"]);
  if (w) rows.push(["window", `closed by ${w.closed_by}: ${w.admitted} admitted, efficiency ${fmt(w.efficiency)}, max lag ${w.max_lag}`]);
  return el("div", { id: "trained-by" }, table("batch", [["", r => r[0]], ["", r => r[1]]], rows));
}

function pretty(s) {
  try { return JSON.stringify(JSON.parse(s), null, 1); } catch (e) { return s; }
}

// tokenValue returns the value a token is coloured by in the current
// mode, or null when it has none (it stays grey).
function tokenValue(t) {
  switch (colorMode) {
    case "logprob": return t.logprob;
    case "advantage": return t.mask !== null ? (t.mask === 1 ? t.advantage : null) : (t.role === "action" ? t.advantage : null);
    case "mask": return t.mask === 1 ? 1 : null;
  }
  return null;
}

function paintTokens() {
  const d = current, box = document.getElementById("tokens");
  if (!d || !box) return;
  const vals = d.tokens.map(tokenValue);
  const amax = Math.max(1e-9, ...vals.filter(v => v !== null).map(Math.abs));
  let turn = -1;
  const kids = [];
  d.tokens.forEach((t, i) => {
    if (t.turn !== turn && turn >= 0) kids.push(el("span", { class: "turnbreak" }));
    turn = t.turn;
    const v = vals[i];
    const s = el("span", { class: "tok role-" + t.role + (v !== null && v !== undefined ? " col" : ""), "data-i": i, "data-role": t.role,
      title: tokenTitle(t, i) }, t.text);
    if (v !== null && v !== undefined) s.style.background = colorOf(v, amax);
    kids.push(s);
  });
  box.replaceChildren(...kids);
  const lg = document.getElementById("legend");
  const sw = c => { const s = el("span"); s.style.background = c; return s; };
  const legends = {
    logprob: ["behavior probability exp(log-prob) of action tokens:", sw(colorOf(Math.log(0.05), 1)), "0.05", sw(colorOf(Math.log(0.5), 1)), "0.5", sw(colorOf(0, 1)), "1"],
    advantage: ["advantage of trained tokens (the packed row's column; the scored turn advantage when not packed):", sw(colorOf(-amax, amax)), fmt(-amax), sw(colorOf(amax, amax)), fmt(amax)],
    mask: ["action_mask = 1 (a training target):", sw(colorOf(1, 1)), "trained; grey: context or not a target"],
  };
  lg.replaceChildren(...legends[colorMode]);
}

function colorOf(v, amax) {
  switch (colorMode) {
    case "logprob": { const p = Math.exp(v); return `hsl(${Math.round(120 * p)}, 70%, 72%)`; }
    case "advantage": { const a = Math.min(1, Math.abs(v) / amax); return v >= 0 ? `hsl(215, 80%, ${Math.round(92 - 35 * a)}%)` : `hsl(0, 80%, ${Math.round(92 - 35 * a)}%)`; }
    case "mask": return "hsl(140, 60%, 70%)";
  }
  return "";
}

function tokenTitle(t, i) {
  const parts = [`#${i} ${t.role} turn ${t.turn} id ${t.id}`];
  if (t.logprob !== null) parts.push(`behavior log-prob ${fmt(t.logprob, 4)} (p ${fmt(Math.exp(t.logprob), 3)})`);
  if (t.mask !== null) parts.push(`mask ${t.mask}`, `old log-prob ${fmt(t.old_logprob, 4)}`, `advantage ${fmt(t.advantage, 4)}`);
  else if (t.advantage !== null) parts.push(`advantage ${fmt(t.advantage, 4)} (scored)`);
  if (t.lag !== null) parts.push(`lag ${t.lag}`);
  return parts.join("\n");
}

// ---- main --------------------------------------------------------------

async function load() {
  const r = await fetch("/api/summary");
  const S = await r.json();
  renderHeader(S);
  for (const [id, fn] of [["overview", renderOverview], ["capability", renderCapability], ["learning", renderLearning],
    ["systems", renderSystems], ["integrity", renderIntegrity]]) {
    const sec = document.getElementById(id);
    let body;
    try { body = fn(S); } catch (e) { body = el("div", { class: "body error", text: "cannot render: " + e }); }
    body.classList.add("body");
    sec.querySelector(".body").replaceWith(body);
  }
  document.body.dataset.loaded = String(Number(document.body.dataset.loaded || 0) + 1);
  return S;
}

document.addEventListener("DOMContentLoaded", async () => {
  document.getElementById("finder").addEventListener("submit", find);
  const S = await load();
  const m = location.hash.match(/^#traj=(.+)$/);
  if (m) openTrajectory(decodeURIComponent(m[1]));
  if (S.run.live) setInterval(load, 5000);
});
