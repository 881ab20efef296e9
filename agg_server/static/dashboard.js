// fedrec dashboard: polls v1/dashboard and redraws.  Hand-written, no library.
// Invariant: every value from the server reaches the page through textContent or a numeric SVG
// attribute, never parsed as HTML markup, so a hostile string (an error message quoting a
// request path) is shown as text and never parsed as markup.
"use strict";

(function () {
  const POLL_MS = 2000;
  const PHASES = ["advertise_keys", "share_keys", "masked_input", "unmask"];
  const PHASE_LABEL = { advertise_keys: "keys", share_keys: "shares", masked_input: "masked", unmask: "unmask" };
  const PHASE_COLOR = ["#4c78a8", "#72b7b2", "#f58518", "#9d755d"];
  const SVG_NS = "http://www.w3.org/2000/svg";
  let updates = 0;

  // -- DOM helpers (text only) -------------------------------------------------------------------
  function $(id) { return document.getElementById(id); }

  function setText(id, value) {
    const node = $(id);
    if (node) node.textContent = value === null || value === undefined ? "–" : String(value);
  }

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }

  function svg(tag, attrs, title) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (title) {
      const t = document.createElementNS(SVG_NS, "title");
      t.textContent = title;
      node.appendChild(t);
    }
    return node;
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  function row(cells, cls) {
    const tr = el("tr", null, cls);
    for (const c of cells) {
      const td = el("td", c.text, c.cls);
      tr.appendChild(td);
    }
    return tr;
  }

  function num(x, digits) {
    if (typeof x !== "number" || !isFinite(x)) return "–";
    return digits === undefined ? String(x) : x.toFixed(digits);
  }

  function clock(t) {
    if (typeof t !== "number") return "–";
    return new Date(t * 1000).toISOString().slice(11, 19);
  }

  // -- sections ------------------------------------------------------------------------------------
  function renderTiles(d) {
    const s = d.status;
    setText("model-version", s.model.version);
    setText("model-shape", s.model.kind + ", " + s.model.n_items + " items × " + s.model.bits + " bits");
    setText("rounds-committed", s.rounds.committed);
    setText("rounds-aborted", s.rounds.aborted);
    setText("rounds-abandoned", s.rounds.abandoned);
    setText("registered-devices", s.registered_devices);
    setText("waiting-devices", s.waiting_devices);
    const bar = $("epsilon-bar");
    clear(bar);
    const p = s.privacy;
    if (!p) {
      setText("epsilon-text", "off");
      setText("epsilon-sub", "distributed DP is disabled");
      return;
    }
    setText("epsilon-text", num(p.epsilon_spent, 3) + " / " + num(p.epsilon_budget, 2));
    setText("epsilon-sub", "δ = " + p.delta + " · " + p.rounds_charged + " rounds charged");
    const frac = Math.max(0, Math.min(1, p.epsilon_spent / p.epsilon_budget));
    bar.appendChild(svg("rect", { x: 0, y: 0, width: 200, height: 10, fill: "#e3e6eb" }));
    bar.appendChild(svg("rect", {
      id: "epsilon-spent-bar", x: 0, y: 0, width: (200 * frac).toFixed(2), height: 10,
      fill: frac > 0.9 ? "#c53030" : "#4c78a8",
    }, "ε " + num(p.epsilon_spent, 3) + " of " + num(p.epsilon_budget, 2)));
  }

  function renderRound(d) {
    const r = d.status.round;
    $("round-none").hidden = !!r;
    $("round-open").hidden = !r;
    const stopped = $("stopped");
    stopped.hidden = !d.status.stopped;
    stopped.textContent = d.status.stopped ? "rounds stopped: " + d.status.stopped : "";
    if (!r) return;
    setText("round-id", r.round_id);
    setText("round-phase", r.phase);
    setText("round-cohort", r.cohort);
    setText("round-alive", r.alive);
    setText("round-awaiting", r.awaiting);
    setText("round-seconds", num(r.seconds, 1) + " s");
    setText("round-dropouts", PHASES.map((p) => PHASE_LABEL[p] + " " + (r.dropouts[p] || 0)).join(" · "));
    const steps = $("phase-steps");
    clear(steps);
    const at = PHASES.indexOf(r.phase);
    PHASES.forEach((p, i) => {
      steps.appendChild(el("li", PHASE_LABEL[p], i < at || at < 0 ? "done" : i === at ? "now" : ""));
    });
  }

  function axes(chart, w, h, pad, ymax, unit) {
    chart.appendChild(svg("line", { x1: pad.l, y1: h - pad.b, x2: w - pad.r, y2: h - pad.b, stroke: "#ccc" }));
    chart.appendChild(svg("line", { x1: pad.l, y1: pad.t, x2: pad.l, y2: h - pad.b, stroke: "#ccc" }));
    for (const f of [0, 0.5, 1]) {
      const y = h - pad.b - f * (h - pad.t - pad.b);
      const label = svg("text", { x: pad.l - 6, y: y + 4, "text-anchor": "end" });
      label.textContent = (ymax * f).toPrecision(3) + (f === 1 ? " " + unit : "");
      chart.appendChild(label);
      if (f > 0) chart.appendChild(svg("line", { x1: pad.l, y1: y, x2: w - pad.r, y2: y, stroke: "#eee" }));
    }
  }

  function renderDurations(d) {
    const chart = $("duration-chart");
    clear(chart);
    const rounds = d.history.filter((r) => r.outcome !== "abandoned").slice(-30);
    const w = 600, h = 220, pad = { l: 56, r: 10, t: 10, b: 28 };
    if (!rounds.length) {
      const t = svg("text", { x: w / 2, y: h / 2, "text-anchor": "middle" });
      t.textContent = "no finished round yet";
      chart.appendChild(t);
      return;
    }
    const ymax = Math.max(...rounds.map((r) => r.seconds), 1e-3);
    axes(chart, w, h, pad, ymax, "s");
    const slot = (w - pad.l - pad.r) / rounds.length;
    const bw = Math.max(2, Math.min(40, slot * 0.7));
    const scale = (h - pad.t - pad.b) / ymax;
    rounds.forEach((r, i) => {
      const x = pad.l + i * slot + (slot - bw) / 2;
      const g = svg("g", { class: "round", "data-round": r.round_id, "data-outcome": r.outcome });
      g.appendChild(svg("rect", {
        class: "bar", "data-round": r.round_id, x: x.toFixed(2), y: (h - pad.b - r.seconds * scale).toFixed(2),
        width: bw.toFixed(2), height: Math.max(0.5, r.seconds * scale).toFixed(2),
        fill: "none", stroke: r.outcome === "committed" ? "#2f855a" : "#c53030", "stroke-width": 1.5,
      }, "round " + r.round_id + " (" + r.outcome + "): " + num(r.seconds, 2) + " s"));
      let y = h - pad.b;
      (r.phases || []).forEach((p) => {
        const i2 = PHASES.indexOf(p.phase);
        const ph = p.seconds * scale;
        y -= ph;
        g.appendChild(svg("rect", {
          class: "phase", x: x.toFixed(2), y: y.toFixed(2), width: bw.toFixed(2), height: Math.max(0, ph).toFixed(2),
          fill: PHASE_COLOR[i2 < 0 ? 0 : i2],
        }, "round " + r.round_id + " " + p.phase + ": " + num(p.seconds, 3) + " s, " + p.dropped + " dropped"));
      });
      chart.appendChild(g);
      if (rounds.length <= 15 || i % Math.ceil(rounds.length / 15) === 0) {
        const t = svg("text", { x: (x + bw / 2).toFixed(2), y: h - pad.b + 14, "text-anchor": "middle" });
        t.textContent = String(r.round_id);
        chart.appendChild(t);
      }
    });
    const legend = $("duration-legend");
    if (!legend.firstChild) {
      PHASES.forEach((p, i) => {
        const item = el("span", null);
        const swatch = el("i", null);
        swatch.style.background = PHASE_COLOR[i];
        item.appendChild(swatch);
        item.appendChild(document.createTextNode(PHASE_LABEL[p]));
        legend.appendChild(item);
      });
      legend.appendChild(el("span", "outline: green committed, red aborted"));
    }
  }

  function renderEpsilon(d) {
    const chart = $("epsilon-chart");
    clear(chart);
    const p = d.status.privacy;
    const w = 600, h = 220, pad = { l: 56, r: 10, t: 10, b: 28 };
    const points = d.history.filter((r) => typeof r.epsilon_spent === "number" && r.outcome === "committed");
    if (!p) {
      const t = svg("text", { x: w / 2, y: h / 2, "text-anchor": "middle" });
      t.textContent = "distributed DP is off: no privacy ledger";
      chart.appendChild(t);
      setText("epsilon-note", "");
      return;
    }
    const ymax = Math.max(p.epsilon_budget, ...points.map((r) => r.epsilon_spent)) * 1.05;
    axes(chart, w, h, pad, ymax, "ε");
    const yOf = (v) => h - pad.b - (v / ymax) * (h - pad.t - pad.b);
    const by = yOf(p.epsilon_budget);
    chart.appendChild(svg("line", {
      class: "budget", x1: pad.l, y1: by.toFixed(2), x2: w - pad.r, y2: by.toFixed(2),
      stroke: "#c53030", "stroke-dasharray": "6 4",
    }, "budget ε = " + num(p.epsilon_budget, 3)));
    const budgetLabel = svg("text", { x: w - pad.r - 4, y: (by - 4).toFixed(2), "text-anchor": "end" });
    budgetLabel.textContent = "budget " + num(p.epsilon_budget, 2);
    chart.appendChild(budgetLabel);
    const n = Math.max(points.length, 1);
    const xOf = (i) => pad.l + ((i + 0.5) * (w - pad.l - pad.r)) / n;
    if (points.length > 1) {
      const path = points.map((r, i) => (i ? "L" : "M") + xOf(i).toFixed(2) + " " + yOf(r.epsilon_spent).toFixed(2));
      chart.appendChild(svg("path", { d: path.join(" "), fill: "none", stroke: "#4c78a8", "stroke-width": 2 }));
    }
    points.forEach((r, i) => {
      chart.appendChild(svg("circle", {
        class: "point", "data-round": r.round_id, cx: xOf(i).toFixed(2), cy: yOf(r.epsilon_spent).toFixed(2), r: 4,
        fill: "#4c78a8",
      }, "after round " + r.round_id + ": ε = " + num(r.epsilon_spent, 4)));
      const t = svg("text", { x: xOf(i).toFixed(2), y: h - pad.b + 14, "text-anchor": "middle" });
      t.textContent = String(r.round_id);
      chart.appendChild(t);
    });
    setText("epsilon-note", "ε " + num(p.epsilon_spent, 4) + " spent of " + num(p.epsilon_budget, 3) +
      " at δ = " + p.delta + "; the server refuses a round that would exceed the budget.");
  }

  function renderRounds(d) {
    const body = $("rounds-table").tBodies[0];
    clear(body);
    for (const r of d.history.slice(-12).reverse()) {
      const drops = PHASES.map((p) => {
        const ph = (r.phases || []).find((x) => x.phase === p);
        return ph ? String(ph.dropped) : "–";
      }).join(" / ");
      body.appendChild(row([
        { text: r.round_id, cls: "num" },
        { text: r.outcome, cls: "outcome" },
        { text: r.cohort === null ? "–" : r.cohort, cls: "num" },
        { text: r.survivors === null ? "–" : r.survivors, cls: "num" },
        { text: drops },
        { text: num(r.seconds, 2), cls: "num" },
        { text: num(r.epsilon_spent, 3), cls: "num" },
        { text: r.model_version === null ? "–" : "v" + r.model_version },
        { text: r.reason || "", cls: "msg" },
      ], r.outcome === "committed" ? "ok" : "bad"));
    }
  }

  function renderVersions(d) {
    const body = $("versions-table").tBodies[0];
    clear(body);
    const versions = new Map();
    const current = d.status.model.version;
    versions.set(current, { version: current, round: null, survivors: null, eps: null });
    for (const r of d.history) {
      if (r.outcome === "committed" && r.model_version !== null) {
        versions.set(r.model_version, { version: r.model_version, round: r.round_id, survivors: r.survivors, eps: r.epsilon_spent });
      }
    }
    const quality = new Map();
    for (const q of d.quality) {
      if (!versions.has(q.model_version)) versions.set(q.model_version, { version: q.model_version, round: null, survivors: null, eps: null });
      if (!quality.has(q.model_version)) quality.set(q.model_version, []);
      quality.get(q.model_version).push(q);
    }
    const list = [...versions.values()].sort((a, b) => b.version - a.version).slice(0, 15);
    for (const v of list) {
      const tr = row([
        { text: "v" + v.version + (v.version === current ? " (current)" : "") },
        { text: v.round === null ? "–" : v.round, cls: "num" },
        { text: v.survivors === null ? "–" : v.survivors, cls: "num" },
        { text: num(v.eps, 3), cls: "num" },
      ]);
      tr.setAttribute("data-version", String(v.version));
      const td = el("td", null, "quality");
      const figures = quality.get(v.version) || [];
      if (!figures.length) td.textContent = "–";
      figures.forEach((q, i) => {
        const span = el("span", q.metric + " = " + num(q.value, 4) + " (" + q.dataset + ")", "figure");
        if (i) td.appendChild(document.createTextNode("; "));
        td.appendChild(span);
      });
      tr.appendChild(td);
      body.appendChild(tr);
    }
  }

  function renderErrors(d) {
    const body = $("errors-table").tBodies[0];
    clear(body);
    if (!d.errors.length) {
      const tr = row([{ text: "no errors since the server started" }], "empty");
      tr.firstChild.colSpan = 6;
      body.appendChild(tr);
      return;
    }
    for (const e of d.errors.slice(0, 20)) {
      body.appendChild(row([
        { text: clock(e.time) },
        { text: e.status, cls: e.status >= 500 ? "num status-bad" : "num" },
        { text: e.code },
        { text: e.method + " " + e.route },
        { text: e.message, cls: "msg" },
        { text: e.request_id, cls: "msg" },
      ], "error"));
    }
  }

  // -- loop ----------------------------------------------------------------------------------------
  function setConnection(ok, text) {
    const pill = $("connection");
    pill.className = "pill " + (ok ? "pill-ok" : "pill-bad");
    pill.textContent = text;
  }

  function render(d) {
    renderTiles(d);
    renderRound(d);
    renderDurations(d);
    renderEpsilon(d);
    renderRounds(d);
    renderVersions(d);
    renderErrors(d);
    setText("updated", clock(d.generated_at) + " UTC");
    updates += 1;
    document.body.setAttribute("data-updates", String(updates));
  }

  async function poll() {
    try {
      // A server that protects its operator endpoints (server.protect_operator_endpoints) wants the admin
      // token: open the page as /#token=<admin token> (a fragment never reaches the server or its logs).
      const token = new URLSearchParams(location.hash.slice(1)).get("token");
      const headers = token ? { Authorization: "Bearer " + token } : {};
      const resp = await fetch(new URL("v1/dashboard", document.baseURI), { cache: "no-store", headers });
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      render(await resp.json());
      setConnection(true, "live");
    } catch (err) {
      setConnection(false, "disconnected: " + (err && err.message ? err.message : String(err)));
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  document.addEventListener("DOMContentLoaded", poll);
})();
