// seamline console: polls /api/status and /metrics, draws the mesh, streams chat answers.
"use strict";
const $ = (id) => document.getElementById(id);
const seen = new Map(); // node id -> last known row (a node gone from the status is drawn down)
let lastTokens = null, lastTime = null;

function headers() {
  const key = $("key").value || localStorage.getItem("seamline-key") || "";
  if ($("key").value) localStorage.setItem("seamline-key", $("key").value);
  return key ? { Authorization: "Bearer " + key } : {};
}

function showError(text) { $("error").textContent = text || ""; }

async function fetchOk(path) {
  const reply = await fetch(path, { headers: headers() });
  if (!reply.ok) {
    let message = reply.status + " " + reply.statusText;
    try { message = (await reply.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(path + ": " + message);
  }
  return reply;
}

function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{([^}]*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    (m[3] || "").replace(/(\w+)="([^"]*)"/g, (_, k, v) => { labels[k] = v; });
    (out[m[1]] = out[m[1]] || []).push({ labels, value: parseFloat(m[4]) });
  }
  return out;
}

const one = (metrics, name) => ((metrics[name] || [])[0] || { value: 0 }).value;
const gib = (bytes) => bytes == null ? "" : (bytes / 2 ** 30).toFixed(2) + " GiB";
const mib = (bytes) => bytes == null ? "" : (bytes / 2 ** 20).toFixed(1) + " MiB";

function drawMesh(status, metrics) {
  const svg = $("drawing"), ns = "http://www.w3.org/2000/svg";
  svg.innerHTML = "";
  const stages = status.stages || [];
  const members = new Set((status.nodes || []).map((n) => n.node_id));
  const live = new Set(stages.flatMap((s) => s.ranks).filter((id) => members.has(id)));
  for (const n of status.nodes || []) seen.set(n.node_id, n);
  const columns = stages.map((s) => s.ranks.map((r) => ({ id: r, layers: s.layers })));
  const down = [...seen.keys()].filter((id) => !live.has(id));
  if (down.length) columns.push(down.map((id) => ({ id, layers: null })));
  const width = svg.clientWidth || 600, step = width / Math.max(columns.length, 1);
  const place = {};
  columns.forEach((column, x) => column.forEach((node, y) => {
    const g = document.createElementNS(ns, "g");
    const isDown = !live.has(node.id);
    g.setAttribute("class", "node" + (isDown ? " down" : ""));
    g.setAttribute("data-node", node.id);
    const cx = x * step + 15, cy = 20 + y * 70;
    place[node.id] = [cx, cy];
    const rect = document.createElementNS(ns, "rect");
    Object.entries({ x: cx, y: cy, width: Math.min(step - 40, 170), height: 52, rx: 6 }).forEach(([k, v]) => rect.setAttribute(k, v));
    g.appendChild(rect);
    const label = [node.id, isDown ? "down" : "layers [" + node.layers.join(", ") + ")"];
    label.forEach((text, i) => {
      const t = document.createElementNS(ns, "text");
      t.setAttribute("x", cx + 8); t.setAttribute("y", cy + 20 + 18 * i); t.textContent = text;
      g.appendChild(t);
    });
    svg.appendChild(g);
  }));
  const rtts = metrics.seamline_link_rtt_seconds || [];
  for (let i = 0; i + 1 < stages.length; i++) {
    const a = place[stages[i].ranks[0]], b = place[stages[i + 1].ranks[0]];
    if (!a || !b) continue;
    const line = document.createElementNS(ns, "line");
    Object.entries({ x1: a[0] + Math.min(step - 40, 170), y1: a[1] + 26, x2: b[0], y2: b[1] + 26, stroke: "#4a5468" })
      .forEach(([k, v]) => line.setAttribute(k, v));
    svg.appendChild(line);
    const pair = rtts.find((r) => (r.labels.src === stages[i].ranks[0] && r.labels.dst === stages[i + 1].ranks[0]) ||
                                  (r.labels.dst === stages[i].ranks[0] && r.labels.src === stages[i + 1].ranks[0]));
    if (pair) {
      const t = document.createElementNS(ns, "text");
      t.setAttribute("x", (a[0] + b[0]) / 2 + 60); t.setAttribute("y", a[1] + 18);
      t.textContent = (pair.value * 1e3).toFixed(2) + " ms";
      svg.appendChild(t);
    }
  }
  fillTable(status, live);
}

function fillTable(status, live) {
  const body = $("nodes").querySelector("tbody");
  body.innerHTML = "";
  const layers = {};
  for (const s of status.stages || []) for (const r of s.ranks) layers[r] = "[" + s.layers.join(", ") + ")";
  for (const [id, n] of seen) {
    const row = document.createElement("tr");
    row.setAttribute("data-node", id);
    const cells = [id, layers[id] || "", live.has(id) ? "up" : "down", gib(n.free_memory_bytes),
                   downloads(n), n.rtt_ms == null ? "" : n.rtt_ms + " ms"];
    for (const c of cells) { const td = document.createElement("td"); td.textContent = c; row.appendChild(td); }
    body.appendChild(row);
  }
}

function downloads(n) {
  const d = n.downloading;
  if (!d) return mib(n.bytes_downloaded);
  const share = d.bytes_total ? Math.floor((100 * d.bytes_done) / d.bytes_total) : 100;
  return "downloading " + mib(d.bytes_done) + " of " + mib(d.bytes_total) + " (" + share + "%)";
}

function showEvents(events) {
  const list = $("events");
  list.innerHTML = "";
  for (const e of (events || []).slice().reverse()) {
    const li = document.createElement("li");
    li.className = e.level;
    li.textContent = new Date(e.time * 1000).toLocaleTimeString() + " " + e.message;
    list.appendChild(li);
  }
}

async function poll() {
  try {
    const metrics = parseMetrics(await (await fetchOk("/metrics")).text());
    const now = performance.now() / 1000, tokens = one(metrics, "seamline_generation_tokens_total");
    if (lastTokens != null && now > lastTime) $("rate").textContent = ((tokens - lastTokens) / (now - lastTime)).toFixed(1);
    lastTokens = tokens; lastTime = now;
    $("running").textContent = one(metrics, "seamline_requests_running");
    $("waiting").textContent = one(metrics, "seamline_requests_waiting");
    const accepted = metrics.seamline_speculative_acceptance, perWindow = metrics.seamline_speculative_tokens_per_window;
    $("acceptance").textContent = accepted ? (100 * accepted[0].value).toFixed(0) + "%" : "–";
    $("per-window").textContent = perWindow ? perWindow[0].value.toFixed(2) : "–";
    let status = null;
    try { status = await (await fetchOk("/api/status")).json(); } catch (e) { status = null; }
    if (status) {
      $("model").textContent = status.model;
      $("state").textContent = status.ready ? "serving" : status.state;
      drawMesh(status, metrics);
      showEvents(status.events);
    } else {
      const up = metrics.seamline_node_up || [];
      drawMesh({ stages: up.filter((n) => n.value).map((n) => ({ ranks: [n.labels.node], layers: ["all"] })),
                 nodes: up.map((n) => ({ node_id: n.labels.node })) }, metrics);
      $("state").textContent = "serving";
    }
    showError("");
  } catch (e) {
    showError(String(e.message || e));
  }
}

async function send() {
  const answer = $("answer");
  answer.textContent = "";
  try {
    const reply = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...headers() },
      body: JSON.stringify({ model: "default", stream: true, max_tokens: 256,
                             messages: [{ role: "user", content: $("prompt").value }] }),
    });
    if (!reply.ok) throw new Error((await reply.json()).error.message);
    const reader = reply.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut).replace(/^data: /, "");
        buffer = buffer.slice(cut + 2);
        if (event === "[DONE]") return;
        const chunk = JSON.parse(event);
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) answer.textContent += delta.content;
      }
    }
  } catch (e) {
    showError("chat: " + (e.message || e));
  }
}

$("send").addEventListener("click", send);
$("key").value = localStorage.getItem("seamline-key") || "";
poll();
setInterval(poll, 1000);
