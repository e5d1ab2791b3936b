// The cpn console: one module for every page. Pages are server-rendered shells; this fills
// them from the REST API (/v1/...) with the session cookie, sending the page's CSRF token on
// every request that changes something. No framework, no build step, nothing from elsewhere.

const main = document.getElementById("main");
const ROLE = main.dataset.role;
const TENANT = main.dataset.tenant;
const CSRF = document.querySelector('meta[name="cpn-csrf"]').content;
const SVG = "http://www.w3.org/2000/svg";
const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);

// ---- helpers -------------------------------------------------------------------------------

class Problem extends Error {
  constructor(status, body) {
    super(body.detail || body.title || `HTTP ${status}`);
    this.status = status;
    this.errors = body.errors || [];
  }
}

async function api(method, path, body, headers = {}) {
  // Signed out (the login page) there is no token yet: any value shows the page sent it.
  const init = { method, credentials: "same-origin", headers: { "X-CPN-CSRF": CSRF || "sign-in", ...headers } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await fetch(path, init);
  if (res.status === 401 && path.startsWith("/v1/")) {
    location.assign(`/ui/login?next=${encodeURIComponent(location.pathname)}`);
    throw new Problem(401, { detail: "signed out" });
  }
  if (res.status === 204) return null;
  const data = await res.json().catch(() => ({}));
  if (!res.ok) throw new Problem(res.status, data);
  return data;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) node.append(c instanceof Node ? c : String(c ?? ""));
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

const $ = (id) => document.getElementById(id);
// A form's control by name (`form.name` and `form.role` are the form's own properties).
const field = (form, name) => form.elements.namedItem(name);
const when = (iso) => (iso ? new Date(iso).toLocaleString() : "—");
const num = (x, digits = 2) => (x === null || x === undefined ? "—" : Number(x).toFixed(digits));

function secs(x) {
  if (x === null || x === undefined) return "—";
  return x >= 100 ? `${Math.round(x)} s` : `${Number(x).toPrecision(2)} s`;
}

function money(x) {
  if (x === null || x === undefined) return "—";
  return x >= 1 ? `$${Number(x).toFixed(2)}` : `$${Number(x).toPrecision(3)}`;
}

function ago(iso) {
  if (!iso) return "never";
  const s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  return `${Math.round(s / 3600)} h ago`;
}

function bytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  let x = Number(n || 0);
  while (x >= 1000 && i < units.length - 1) { x /= 1000; i += 1; }
  return `${x.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fill(tbody, rows) {
  // Each cell carries its column's name: on a phone a row is drawn as a card of labelled cells.
  const names = [...(tbody.parentElement.tHead?.rows[0]?.cells || [])].map((th) => th.textContent);
  tbody.replaceChildren(...rows.map((cells) => el("tr", {},
    ...cells.map((c, i) => el("td", names[i] ? { "data-label": names[i] } : {}, c)))));
}

function dl(node, pairs) {
  node.replaceChildren(...pairs.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}

function fieldErrors(form, err) {
  // Put each problem's message next to the field it names; the rest at the form's foot.
  form.querySelectorAll(".field-error").forEach((p) => { p.textContent = ""; });
  form.querySelectorAll("[aria-invalid]").forEach((i) => i.removeAttribute("aria-invalid"));
  let placed = false;
  for (const e of err.errors || []) {
    const name = String(e.field).split(".").pop();
    const slot = form.querySelector(`[data-for="${name}"]`) || form.querySelector(`#${name}-error`);
    const input = form.querySelector(`[name="${name}"]`);
    if (slot) {
      slot.textContent = e.message;
      placed = true;
      if (input) input.setAttribute("aria-invalid", "true");
    }
  }
  const foot = form.querySelector("#form-error");
  if (foot && !placed) foot.textContent = err.message;
  if (!foot && !placed) alertText(err.message);
}

function alertText(text) {
  const slot = $("action-error") || $("form-error");
  if (slot) slot.textContent = text;
}

// Refresh `fn` every `ms` while the page is open; errors are shown, not thrown.
function every(ms, fn) {
  let timer = null;
  const run = async () => {
    try { await fn(); } catch (e) { if (e.status !== 401) alertText(e.message); }
    timer = setTimeout(run, ms);
  };
  run();
  addEventListener("pagehide", () => clearTimeout(timer));
}

function stamp() {
  const u = $("updated");
  if (u) u.textContent = `updated ${new Date().toLocaleTimeString()}`;
}

async function allPages(path) {
  const sep = path.includes("?") ? "&" : "?";
  const out = [];
  for (let offset = 0; ; offset += 500) {
    const page = await api("GET", `${path}${sep}limit=500&offset=${offset}`);
    out.push(...page.items);
    if (out.length >= page.total || page.items.length === 0) return out;
  }
}

// Tenants by id, so pages show names, not UUIDs. Admins only (a tenant sees only its own
// objects and may not list tenants); fetched once per page and kept.
let tenantNamesOnce = null;
function tenantNames() {
  if (ROLE !== "admin") return Promise.resolve(new Map());
  tenantNamesOnce ??= allPages("/v1/tenants").then((ts) => new Map(ts.map((t) => [t.id, t.name])),
    () => new Map());
  return tenantNamesOnce;
}
const tenantName = (names, id) => (ROLE !== "admin" ? "you" : names.get(id) || (id ? id.slice(0, 8) : "—"));

// ---- sign in and out -----------------------------------------------------------------------

function login() {
  const form = $("login");
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    try {
      await api("POST", "/ui/session", { key: field(form, "key").value });
      location.assign(form.dataset.next || "/ui");
    } catch (e) { fieldErrors(form, e); }
  });
  field(form, "key").focus();
}

const signOut = $("sign-out");
if (signOut) {
  signOut.addEventListener("click", async () => {
    await api("POST", "/ui/session/end");
    location.assign("/ui/login");
  });
}

// ---- the network ---------------------------------------------------------------------------

const STATE_CLASS = { READY: "ok", SUSPECT: "warn", DOWN: "bad", PENDING: "idle" };
const STALE_S = 600;

function gpuText(gpus) {
  if (!gpus.length) return "none";
  return gpus.map((g) => `${g.model} ${Math.max(0, g.allocatable - g.in_use)}/${g.count}`).join(", ");
}

function linkHealth(link, byName) {
  const ends = [byName[link.src], byName[link.dst]].map((c) => (c ? c.state : "DOWN"));
  if (ends.includes("DOWN")) return "bad";
  const age = (Date.now() - new Date(link.measured_at).getTime()) / 1000;
  if (ends.includes("SUSPECT") || link.loss > 0.01 || (link.source === "measured" && age > STALE_S)) return "warn";
  return "ok";
}

function gbps(value) {
  return value === null ? "no limit" : `${+value.toFixed(3)} Gb/s`;
}

function portText(ports, name) {
  const mine = ports.filter((p) => p.cluster === name && p.capacity_gbps);
  return mine.map((p) => `${p.direction === "up" ? "↑" : "↓"} ${Math.round((100 * p.reserved_gbps) / p.capacity_gbps)}%`).join(" ");
}

function ringPositions(names) {
  const pos = {};
  names.forEach((name, i) => {
    const a = (2 * Math.PI * i) / Math.max(names.length, 1) - Math.PI / 2;
    pos[name] = names.length === 1 ? [400, 230] : [400 + 280 * Math.cos(a), 230 + 170 * Math.sin(a)];
  });
  return pos;
}

// A tenant's map: what it can buy (clusters, their GPU models at the standard price, each
// link's egress price), read from /v1/pricing; nothing of what others use.
function drawOffer(pricing) {
  const graph = $("graph");
  const clusters = [...new Set(pricing.gpu.map((g) => g.cluster))].sort();
  const pos = ringPositions(clusters);
  const parts = [graph.querySelector("title")];
  const drawn = new Set();
  for (const e of pricing.egress) {
    const key = [e.src, e.dst].sort().join("|");
    if (!pos[e.src] || !pos[e.dst] || drawn.has(key)) continue;
    drawn.add(key);
    const [[x1, y1], [x2, y2]] = [pos[e.src], pos[e.dst]];
    const both = pricing.egress.filter((o) => [o.src, o.dst].sort().join("|") === key);
    parts.push(svg("line", { x1, y1, x2, y2, class: "link ok", "stroke-width": 2 },
      svg("title", {}, both.map((o) => `${o.src}→${o.dst}: $${num(o.price_per_gb, 4)}/GB`).join("\n"))));
    parts.push(svg("text", { x: (x1 + x2) / 2, y: (y1 + y2) / 2 - 6, class: "link-label", "text-anchor": "middle" },
      `$${num(e.price_per_gb, 3)}/GB`));
  }
  for (const c of clusters) {
    const [x, y] = pos[c];
    const models = pricing.gpu.filter((g) => g.cluster === c && g.qos_class === "standard")
      .map((g) => `${g.gpu_model} $${num(g.price_per_gpu_hour, 2)}/h`).join(", ");
    parts.push(svg("g", { class: "node ok", "data-cluster": c },
      svg("title", {}, `${c}: ${models || "no standard price"}`),
      svg("circle", { cx: x, cy: y, r: 30 }),
      svg("text", { x, y: y + 4, "text-anchor": "middle", class: "node-name" }, c),
      svg("text", { x, y: y + 48, "text-anchor": "middle", class: "node-gpus" }, models)));
  }
  graph.replaceChildren(...parts);
}

function drawNetwork(clusters, links, ports = []) {
  const graph = $("graph");
  const byName = Object.fromEntries(clusters.map((c) => [c.name, c]));
  const pos = ringPositions(clusters.map((c) => c.name));
  const keep = graph.querySelector("title");
  const parts = [keep];
  const pairs = new Map();
  for (const l of links) {
    const key = [l.src, l.dst].sort().join("|");
    if (!pairs.has(key)) pairs.set(key, []);
    pairs.get(key).push(l);
  }
  for (const group of pairs.values()) {
    const l = group[0];
    if (!pos[l.src] || !pos[l.dst]) continue;
    const [x1, y1] = pos[l.src];
    const [x2, y2] = pos[l.dst];
    const health = group.map((g) => linkHealth(g, byName)).sort((a, b) => "okwarnbad".indexOf(b) - "okwarnbad".indexOf(a))[0];
    const width = 1.5 + Math.min(6, Math.log10(1 + l.bandwidth_gbps) * 2.5);
    parts.push(svg("line", { x1, y1, x2, y2, class: `link ${health}`, "stroke-width": width.toFixed(1) },
      svg("title", {}, group.map((g) => `${g.src}→${g.dst}: ${g.bandwidth_gbps} Gb/s, ${g.rtt_ms} ms, $${g.egress_price_per_gb}/GB, ${g.source} ${ago(g.measured_at)}`).join("\n"))));
    parts.push(svg("text", { x: (x1 + x2) / 2, y: (y1 + y2) / 2 - 6, class: "link-label", "text-anchor": "middle" },
      `${l.bandwidth_gbps} Gb/s · ${l.rtt_ms} ms`));
  }
  for (const c of clusters) {
    const [x, y] = pos[c.name];
    const cls = `node ${STATE_CLASS[c.state] || "idle"}${c.cordoned ? " cordoned" : ""}`;
    parts.push(svg("g", { class: cls, "data-cluster": c.name },
      svg("title", {}, `${c.name} (${c.region}): ${c.state}${c.cordoned ? ", cordoned" : ""}; GPUs ${gpuText(c.gpus)}`),
      svg("circle", { cx: x, cy: y, r: 30 }),
      svg("text", { x, y: y + 4, "text-anchor": "middle", class: "node-name" }, c.name),
      svg("text", { x, y: y + 48, "text-anchor": "middle", class: "node-gpus" }, gpuText(c.gpus)),
      svg("text", { x, y: y + 62, "text-anchor": "middle", class: "node-gpus node-ports" }, portText(ports, c.name))));
  }
  graph.replaceChildren(...parts);
}

function network() {
  if (ROLE !== "admin") {
    const note = $("network-note");
    note.hidden = false;
    note.textContent = "The clusters you can run on, their GPUs at the standard price per GPU-hour, and the egress price of each link. Quotes plan over this network; Pricing lists every class.";
    for (const id of ["clusters-h", "links-h", "ports-h"]) $(id).parentElement.hidden = true;
    document.querySelector(".legend").hidden = true;
    $("network-intro").hidden = true;
    $("offer-section").hidden = false;
    api("GET", "/v1/pricing").then((p) => {
      drawOffer(p);
      const rows = new Map();
      for (const g of p.gpu) {
        const key = `${g.cluster}|${g.gpu_model}`;
        if (!rows.has(key)) rows.set(key, { cluster: g.cluster, model: g.gpu_model, prices: {} });
        rows.get(key).prices[g.qos_class] = `$${num(g.price_per_gpu_hour, 2)}`;
      }
      fill($("offer").tBodies[0], [...rows.values()].map((r) => [
        r.cluster, r.model, r.prices.guaranteed || "—", r.prices.standard || "—", r.prices.spot || "—"]));
      stamp();
    }).catch((e) => alertText(e.message));
    return;
  }
  every(3000, async () => {
    const [clusters, links, ports] = await Promise.all([
      allPages("/v1/clusters"), allPages("/v1/links?view=effective"), allPages("/v1/network/ports"),
    ]);
    drawNetwork(clusters, links, ports);
    fill($("clusters").tBodies[0], clusters.map((c) => [
      c.name, c.region, el("span", { class: `badge ${STATE_CLASS[c.state] || "idle"}` }, c.state),
      gpuText(c.gpus), c.cordoned ? (c.draining ? "cordoned, draining" : "cordoned") : "no", ago(c.last_heartbeat_at),
    ]));
    fill($("links").tBodies[0], links.map((l) => [
      l.src, l.dst, `${l.bandwidth_gbps} Gb/s`, l.free_gbps == null ? "-" : `${l.free_gbps} Gb/s`,
      `${l.rtt_ms} ms`, `${(l.loss * 100).toFixed(2)} %`,
      `$${l.egress_price_per_gb}/GB`, l.source, ago(l.measured_at),
    ]));
    fill($("ports").tBodies[0], ports.length === 0 ? [["none declared", "", "", "", "", ""]] : ports.map((p) => [
      p.cluster, p.direction === "up" ? "uplink" : "downlink", gbps(p.capacity_gbps), gbps(p.reserved_gbps),
      gbps(p.free_gbps), p.holders.map((h) => `${h.job_id.slice(0, 8)} ${gbps(h.reserved_gbps)}`).join(", ") || "none",
    ]));
    stamp();
  });
}

// ---- jobs ----------------------------------------------------------------------------------

function stateBadge(state) {
  const cls = { SUCCEEDED: "ok", RUNNING: "ok", FAILED: "bad", CANCELLED: "idle" }[state] || "warn";
  return el("span", { class: `badge ${cls}` }, state);
}

function jobs() {
  const select = $("state");
  const params = new URLSearchParams(location.search);
  select.value = params.get("state") || "";
  select.addEventListener("change", () => {
    const q = select.value ? `?state=${select.value}` : "";
    history.replaceState(null, "", `/ui/jobs${q}`);
    refresh();
  });
  const refresh = async () => {
    const q = select.value ? `&state=${select.value}` : "";
    const [page, names] = await Promise.all([api("GET", `/v1/jobs?limit=200${q}`), tenantNames()]);
    fill($("jobs").tBodies[0], page.items.map((j) => [
      el("a", { href: `/ui/jobs/${j.id}` }, j.name, el("span", { class: "muted" }, ` ${j.id.slice(0, 8)}`)),
      stateBadge(j.state), tenantName(names, j.tenant_id), j.gpus_min === j.gpus_max ? j.gpus_min : `${j.gpus_min}–${j.gpus_max}`,
      j.qos_class, when(j.created_at), j.reason,
    ]));
    $("jobs-empty").hidden = page.items.length > 0;
    stamp();
  };
  every(3000, refresh);
}

function lineChart(node, series, yLabel) {
  // series: [{points: [[x, y]], cls}]; one y scale per chart, x is the step.
  const W = 480, H = 200, L = 52, R = 10, T = 10, B = 26;
  const all = series.flatMap((s) => s.points);
  const keep = node.querySelector("title");
  if (!all.length) {
    node.replaceChildren(keep, svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "muted-text" }, "no progress yet"));
    return;
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  const y0 = Math.min(0, ...ys), y1 = Math.max(...ys, y0 + 1e-9);
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  const parts = [keep,
    svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }),
    svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }),
    svg("text", { x: L - 4, y: T + 8, "text-anchor": "end", class: "tick" }, yLabel(y1)),
    svg("text", { x: L - 4, y: H - B, "text-anchor": "end", class: "tick" }, yLabel(y0)),
    svg("text", { x: L, y: H - 8, class: "tick" }, `step ${x0}`),
    svg("text", { x: W - R, y: H - 8, "text-anchor": "end", class: "tick" }, `step ${x1}`)];
  for (const s of series) {
    if (!s.points.length) continue;
    const d = s.points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    parts.push(svg("polyline", { points: d, class: `series ${s.cls}`, "data-points": s.points.length }));
  }
  node.replaceChildren(...parts);
}

function job() {
  const id = main.dataset.job;
  const progress = new Map(); // step -> event data
  const timeline = [];
  const events = [];
  let current = null;

  let names = new Map();
  tenantNames().then((n) => { names = n; if (current) showJob(current); });
  const showJob = (j) => {
    current = j;
    $("job-name").textContent = j.name;
    $("job-state").replaceChildren(stateBadge(j.state));
    $("cancel").disabled = TERMINAL.has(j.state);
    const waits = j.state === "PENDING" || j.state === "RESCHEDULING";
    $("job-reason").textContent = (waits ? "Why it waits: " : "") + (j.reason || "");
    dl($("summary"), [
      ["Id", j.id], ["Tenant", tenantName(names, j.tenant_id)], ["Task", String(j.spec.task || "")],
      ["Steps", String(j.spec.steps || "")], ["GPUs", j.gpus_min === j.gpus_max ? j.gpus_min : `${j.gpus_min}–${j.gpus_max}`],
      ["Priority / QoS", `${j.priority} / ${j.qos_class}${j.preemptible ? ", preemptible" : ""}`],
      ["Attempts", j.attempts], ["Submitted", when(j.created_at)], ["Started", when(j.started_at)], ["Finished", when(j.finished_at)],
      ["Expected end", j.finished_at ? "—" : when(j.ends_at)],
    ]);
    const plan = j.placement || j.held_price;
    if (!plan) { dl($("placement"), [["Placement", "not placed yet"]]); return; }
    const last = [...progress.values()].pop();
    dl($("placement"), [
      ["Clusters", plan.clusters.map((s) => `${s.cluster}: ${s.gpus}${s.gpu_model ? ` × ${s.gpu_model}` : ""}`).join(", ")],
      ["Compression", last && last.compression ? `${last.compression} (×${num(last.compression_ratio, 1)})` : String(plan.compression)],
      ["Sync", String(plan.sync)],
      ["Estimate", `${secs(plan.estimate.total_time_s)}, ${bytes(plan.estimate.wan_bytes)} over WAN`],
      ["Price (quoted)", plan.price ? money(plan.price.total) : "—"],
      ["Charged so far", $("placement").dataset.cost || "—"],
      ["Why this plan", (plan.explanation || []).join("; ") || "—"],
    ]);
  };

  const draw = () => {
    const pts = [...progress.values()].sort((a, b) => a.step - b.step);
    lineChart($("chart-loss"), [
      { cls: "loss", points: pts.filter((p) => p.loss !== null).map((p) => [p.step, p.loss]) },
      { cls: "accuracy", points: pts.filter((p) => p.accuracy !== null && p.accuracy !== undefined).map((p) => [p.step, p.accuracy]) },
    ], (y) => y.toFixed(2));
    lineChart($("chart-wan"), [{ cls: "wan", points: pts.map((p) => [p.step, p.wan_bytes || 0]) }], bytes);
    const last = pts[pts.length - 1];
    $("loss-last").textContent = last ? `step ${last.step}/${last.steps}: loss ${num(last.loss, 4)}, accuracy ${num(last.accuracy, 3)}` : "";
    $("wan-last").textContent = last ? `${bytes(last.wan_bytes)} sent so far` : "";
    $("timeline").replaceChildren(...timeline.map((e) => el("li", {}, el("time", { datetime: e.at }, when(e.at)), " ", stateBadge(e.to_state), " ", e.message)));
    fill($("events").tBodies[0], events.slice(-100).reverse().map((e) => [when(e.at), e.kind, e.message]));
  };

  const take = (e) => {
    events.push(e);
    if (e.kind === "progress" && e.data) progress.set(e.data.step, e.data);
    if (e.kind === "state" && e.to_state) timeline.push(e);
  };

  const cost = async () => {
    if (!current) return;
    const ledger = await api("GET", `/v1/tenants/${current.tenant_id}/ledger?limit=500`);
    const total = ledger.items.filter((x) => x.job_id === id).reduce((s, x) => s + Number(x.amount), 0);
    $("placement").dataset.cost = `$${total.toFixed(4)}`;
  };

  const refreshJob = async () => { showJob(await api("GET", `/v1/jobs/${id}`)); };

  $("cancel").addEventListener("click", async () => {
    $("cancel-error").textContent = "";
    try {
      showJob(await api("POST", `/v1/jobs/${id}/cancel`, undefined, { "If-Match": `"${current.version}"` }));
    } catch (e) { $("cancel-error").textContent = e.message; }
  });

  (async () => {
    await refreshJob();
    await cost().catch(() => {});
    showJob(current);
    // The event stream: every event so far, then each new one as it is stored.
    const source = new EventSource(`/v1/jobs/${id}/events?stream=true`);
    const poll = async () => {
      const page = await api("GET", `/v1/jobs/${id}/events?limit=500&offset=${events.length}`);
      page.items.forEach(take);
      if (page.items.some((e) => e.kind === "state")) { await refreshJob(); showJob(current); }
      if (page.items.length) draw();
    };
    let pending = null;
    const soon = () => { if (!pending) pending = setTimeout(() => { pending = null; draw(); }, 100); };
    const onEvent = (msg) => {
      take(JSON.parse(msg.data));
      soon();
      if (JSON.parse(msg.data).kind === "state") refreshJob().then(cost).then(() => showJob(current)).catch(() => {});
    };
    for (const kind of ["state", "progress", "info"]) source.addEventListener(kind, onEvent);
    source.addEventListener("end", () => { source.close(); refreshJob().then(cost).then(() => showJob(current)).catch(() => {}); });
    // `error` is a job's error event, or (no `kind`) the problem a stream ends with when the
    // key is revoked; without data it is the browser's own reconnect notice.
    source.addEventListener("error", (msg) => {
      if (!msg.data) {
        // Refused (the key holds its most streams open already): read the events as pages.
        if (source.readyState === EventSource.CLOSED) every(2000, poll);
        return;
      }
      const data = JSON.parse(msg.data);
      if (data.kind) { onEvent(msg); return; }
      source.close();
      alertText(data.detail);
    });
    addEventListener("pagehide", () => source.close());
    draw();
    // The log, page by page after the last line shown, until the job has ended and all is read.
    let after = 0;
    let logDone = false;
    const shown = [];
    every(2000, async () => {
      if (logDone) return;
      const ended = current && TERMINAL.has(current.state);
      const page = await api("GET", `/v1/jobs/${id}/logs?limit=500&after=${after}`);
      for (const l of page.items) shown.push(`${when(l.at)} ${l.source} | ${l.text}`);
      if (page.items.length) after = page.items[page.items.length - 1].id;
      shown.splice(0, Math.max(0, shown.length - 2000));
      $("logs").textContent = shown.join("\n");
      $("logs-note").textContent = shown.length ? `${shown.length} line(s) shown, the newest last.` : "Nothing printed yet.";
      logDone = ended && page.items.length < 500;
    });
    // Cost and the job's own fields change without an event too (metering): look now and then.
    every(5000, async () => { if (current && !TERMINAL.has(current.state)) { await refreshJob(); await cost(); showJob(current); } });
  })().catch((e) => alertText(e.message));
}

// ---- quote ---------------------------------------------------------------------------------

// A number field's value as a JSON number when it is one (0 included), else as typed, so
// the API names the field and the problem.
function asNumber(text) {
  const n = Number(text);
  return text.trim() !== "" && Number.isFinite(n) ? n : text;
}

function partiesText(price) {
  // each provider's part of a quoted price, when a provider's offer is in it
  const parties = price.parties || [];
  if (!parties.some((p) => p.provider)) return "";
  return ` (${parties.map((p) => `${p.provider || "operator"} ${money(p.amount)}`).join(", ")})`;
}

function quote() {
  const form = $("quote-form");
  const spec = () => {
    const body = { name: field(form, "name").value, task: field(form, "task").value, steps: asNumber(field(form, "steps").value) };
    if (field(form, "gpus").value) body.gpus = Number(field(form, "gpus").value);
    if (field(form, "compression").value) body.compression = field(form, "compression").value;
    if (field(form, "sync").value) body.sync = field(form, "sync").value;
    return body;
  };
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    fieldErrors(form, { errors: [] });
    const body = spec();
    try {
      const q = await api("POST", "/v1/quotes", body);
      $("options").replaceChildren(...q.options.map((o, i) => el("article", { class: "card option" },
        el("h3", {}, o.objective || `option ${i + 1}`),
        el("dl", {},
          el("dt", {}, "Clusters"), el("dd", {}, o.clusters.map((s) => `${s.cluster}: ${s.gpus}${s.gpu_model ? ` × ${s.gpu_model}` : ""}`).join(", ")),
          el("dt", {}, "Time"), el("dd", {}, secs(o.estimate.total_time_s)),
          el("dt", {}, "WAN"), el("dd", {}, bytes(o.estimate.wan_bytes)),
          el("dt", {}, "Compression / sync"), el("dd", {}, `${o.compression} / ${o.sync}`),
          el("dt", {}, "Price"), el("dd", {}, o.price ? money(o.price.total) + partiesText(o.price) : "—")),
        el("p", { class: "muted" }, (o.explanation || []).join("; ")),
        el("button", { type: "button", onclick: async (e) => {
          e.target.disabled = true;
          try {
            const j = await api("POST", "/v1/jobs", { ...body, quote_id: q.id, quote_option: o.objective || undefined },
              { "Idempotency-Key": `${q.id}-${i}` });
            location.assign(`/ui/jobs/${j.id}`);
          } catch (err) { e.target.disabled = false; fieldErrors(form, err); }
        } }, `Submit the ${o.objective || `option ${i + 1}`} option`))));
    } catch (e) { fieldErrors(form, e); }
  });
}

// ---- usage and pricing ---------------------------------------------------------------------

function quantityText(r) {
  if (r.kind === "wan_bytes") return bytes(r.quantity);
  if (r.kind === "wan_reserved") return `${num(r.quantity / 3600, 3)} Gbit/s-h`;
  if (r.kind.endsWith("_credit")) return `$${num(r.quantity, 6)} back`;
  return `${num(r.quantity / 3600, 3)} GPU-h`;
}

function usage() {
  const select = $("tenant");
  const show = async (tenant) => {
    if (!tenant) return;
    const [u, ledger] = await Promise.all([
      api("GET", `/v1/tenants/${tenant}/usage`), api("GET", `/v1/tenants/${tenant}/ledger?limit=500`)]);
    dl($("totals"), [
      ["GPU-hours", num(u.gpu_seconds / 3600, 3)], ["WAN traffic", bytes(u.wan_bytes)],
      ["Charged", `$${ledger.total}`], ["Ledger entries", ledger.total_items]]);
    fill($("usage").tBodies[0], u.rows.map((r) => [
      r.kind, r.dst_cluster ? `${r.cluster} → ${r.dst_cluster}` : r.cluster, r.gpu_model || "—", r.qos_class || "—",
      quantityText(r)]));
    fill($("ledger").tBodies[0], ledger.items.map((e) => [
      when(e.created_at), e.job_id ? el("a", { href: `/ui/jobs/${e.job_id}` }, e.job_id.slice(0, 8)) : "—",
      e.description || e.kind, e.quantity, e.unit_price, `$${e.amount}`]));
  };
  if (ROLE === "admin") {
    $("usage-tenant").hidden = false;
    allPages("/v1/tenants").then((ts) => {
      select.replaceChildren(...ts.map((t) => el("option", { value: t.id }, t.name)));
      select.addEventListener("change", () => show(select.value).catch((e) => alertText(e.message)));
      return show(select.value);
    }).catch((e) => alertText(e.message));
  } else {
    every(10000, () => show(TENANT));
  }
}

function pricing() {
  api("GET", "/v1/pricing").then((p) => {
    $("pricing-at").textContent = `Prices in effect at ${when(p.at)}.`;
    fill($("gpu-prices").tBodies[0], p.gpu.map((g) => [g.cluster, g.gpu_model, g.qos_class, `$${num(g.price_per_gpu_hour, 4)}`, when(g.effective_from), g.provider || "operator"]));
    fill($("egress-prices").tBodies[0], p.egress.map((e) => [e.src, e.dst, `$${num(e.price_per_gb, 4)}`, when(e.effective_from), e.provider || "operator"]));
    fill($("bandwidth-prices").tBodies[0], p.bandwidth.map((b) => [b.cluster, `$${num(b.price_per_gbps_hour, 4)}`, when(b.effective_from), b.provider || "operator"]));
  }).catch((e) => alertText(e.message));
}

// ---- admin ---------------------------------------------------------------------------------

function actionButton(label, fn) {
  return el("button", { type: "button", onclick: async (ev) => {
    ev.target.disabled = true;
    try { await fn(); } catch (e) { alertText(e.message); } finally { ev.target.disabled = false; }
  } }, label);
}

function adminClusters() {
  const refresh = async () => {
    const clusters = await allPages("/v1/clusters");
    fill($("admin-clusters").tBodies[0], clusters.map((c) => [
      c.name, c.region, el("span", { class: `badge ${STATE_CLASS[c.state] || "idle"}` }, c.state), gpuText(c.gpus),
      [c.cordoned && "cordoned", c.draining && "draining"].filter(Boolean).join(", ") || "—",
      el("span", { class: "actions" },
        c.cordoned
          ? actionButton(`Uncordon ${c.name}`, async () => { await api("POST", `/v1/clusters/${c.name}/uncordon`); await refresh(); })
          : actionButton(`Cordon ${c.name}`, async () => { await api("POST", `/v1/clusters/${c.name}/cordon`); await refresh(); }),
        c.draining ? "" : actionButton(`Drain ${c.name}`, async () => { await api("POST", `/v1/clusters/${c.name}/drain`); await refresh(); })),
    ]));
  };
  every(5000, refresh);
}

function adminTenants() {
  const form = $("tenant-form");
  let tenants = [];
  const load = (t) => {
    field(form, "gpu_quota").value = t && t.gpu_quota !== null ? t.gpu_quota : "";
    field(form, "budget").value = t && t.budget !== null ? t.budget : "";
    field(form, "priority_ceiling").value = t ? t.priority_ceiling : 0;
  };
  const refresh = async () => {
    tenants = await allPages("/v1/tenants");
    fill($("tenants").tBodies[0], tenants.map((t) => [t.name, t.id, t.gpu_quota ?? "none", t.budget ?? "none", t.priority_ceiling, when(t.created_at)]));
    const keep = field(form, "tenant_id").value;
    field(form, "tenant_id").replaceChildren(...tenants.map((t) => el("option", { value: t.id }, t.name)));
    if (keep) field(form, "tenant_id").value = keep;
    load(tenants.find((t) => t.id === field(form, "tenant_id").value));
  };
  field(form, "tenant_id").addEventListener("change", () => load(tenants.find((t) => t.id === field(form, "tenant_id").value)));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    fieldErrors(form, { errors: [] });
    $("saved").textContent = "";
    const value = (input) => (input.value === "" ? null : Number(input.value));
    try {
      await api("PATCH", `/v1/tenants/${field(form, "tenant_id").value}`, {
        gpu_quota: value(field(form, "gpu_quota")), budget: value(field(form, "budget")), priority_ceiling: value(field(form, "priority_ceiling")) ?? 0 });
      $("saved").textContent = "saved";
      await refresh();
    } catch (e) { fieldErrors(form, e); }
  });
  refresh().catch((e) => alertText(e.message));
}

function adminKeys() {
  const form = $("key-form");
  const refresh = async () => {
    const [keys, names] = await Promise.all([allPages("/v1/api-keys"), tenantNames()]);
    fill($("keys").tBodies[0], keys.map((k) => [
      k.prefix || k.id.slice(0, 8), k.name, k.role, k.role === "tenant" ? tenantName(names, k.scope) : (k.scope || "—"), when(k.created_at), k.revoked_at ? when(k.revoked_at) : "—",
      k.revoked_at ? "" : actionButton(`Revoke ${k.name || k.id.slice(0, 8)}`, async () => { await api("DELETE", `/v1/api-keys/${k.id}`); await refresh(); }),
    ]));
  };
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    fieldErrors(form, { errors: [] });
    $("minted").hidden = true;
    const body = { role: field(form, "role").value, name: field(form, "name").value };
    if (field(form, "scope").value) body.scope = field(form, "scope").value;
    try {
      const made = await api("POST", "/v1/api-keys", body);
      $("minted-token").textContent = made.token;
      $("minted").hidden = false;
      form.reset();
      await refresh();
    } catch (e) { fieldErrors(form, e); }
  });
  refresh().catch((e) => alertText(e.message));
}

function adminAudit() {
  every(5000, async () => {
    const page = await api("GET", "/v1/audit?limit=200");
    fill($("audit").tBodies[0], page.items.map((a) => [when(a.at), a.actor_key_id || "—", a.action, `${a.target_type} ${a.target_id}`, JSON.stringify(a.detail)]));
  });
}

// ---- providers -----------------------------------------------------------------------------

function provider() {
  const select = $("provider");
  const form = $("offer-form");
  let current = ROLE === "provider" ? "me" : null;
  const show = async () => {
    if (!current) return;
    const base = `/v1/providers/${encodeURIComponent(current)}`;
    const [info, clusters, offers, slas, st, payouts] = await Promise.all([
      api("GET", base), api("GET", `${base}/clusters`), api("GET", `${base}/offers`),
      api("GET", `${base}/slas`), api("GET", `${base}/statement`), api("GET", `${base}/payouts?limit=50`)]);
    dl($("earnings"), [
      ["Owed now", `$${st.balance}`], ["Tenants paid", `$${st.gross}`],
      ["Platform fee", `$${st.fee} (${num(info.fee_rate * 100, 1)} %)`], ["Net", `$${st.net}`], ["Paid out", `$${st.paid}`]]);
    fill($("provider-clusters").tBodies[0], clusters.map((c) => [
      c.name, c.region, el("span", { class: `badge ${STATE_CLASS[c.state] || "idle"}` }, c.state),
      c.gpus.map((g) => `${g.allocatable}× ${g.model}`).join(", ") || "—",
      c.utilization === null ? "—" : `${num(c.utilization * 100, 0)} %`]));
    fill($("statement").tBodies[0], st.lines.map((x) => [x.cluster, x.kind, `$${x.gross}`, `$${x.fee}`, `$${x.net}`]));
    fill($("offers").tBodies[0], offers.gpu.map((g) => [
      g.cluster, g.gpu_model, g.qos_class, `$${num(g.price_per_gpu_hour, 4)}`, when(g.effective_from), g.provider || "operator"]));
    fill($("slas").tBodies[0], slas.map((x) => [
      x.cluster, x.uptime === null ? "—" : `${num(x.uptime * 100, 2)} %`, x.uplink_gbps === null ? "—" : num(x.uplink_gbps, 3),
      `${num(x.credit_rate * 100, 0)} % of the run's charges`, when(x.effective_from)]));
    fill($("payouts").tBodies[0], payouts.items.map((p) => [when(p.at), `$${p.amount}`, p.reference || "—"]));
    if (ROLE === "provider") {
      const keep = field(form, "cluster").value;
      field(form, "cluster").replaceChildren(...clusters.map((c) => el("option", { value: c.name }, c.name)));
      if (keep) field(form, "cluster").value = keep;
    }
  };
  if (ROLE === "provider") {
    form.hidden = false;
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      fieldErrors(form, { errors: [] });
      $("offered").textContent = "";
      try {
        await api("POST", "/v1/pricing/gpu", {
          cluster: field(form, "cluster").value, gpu_model: field(form, "gpu_model").value,
          qos_class: field(form, "qos_class").value, price_per_gpu_hour: asNumber(field(form, "price_per_gpu_hour").value) });
        $("offered").textContent = "offered";
        await show();
      } catch (e) { fieldErrors(form, e); }
    });
    every(10000, show);
  } else {
    $("provider-pick").hidden = false;
    allPages("/v1/providers").then((ps) => {
      select.replaceChildren(...ps.map((p) => el("option", { value: p.id }, p.name)));
      const wanted = new URLSearchParams(location.search).get("p");
      if (wanted) select.value = (ps.find((p) => p.name === wanted || p.id === wanted) || {}).id || select.value;
      current = select.value;
      select.addEventListener("change", () => { current = select.value; show().catch((e) => alertText(e.message)); });
      return show();
    }).catch((e) => alertText(e.message));
  }
}

function adminProviders() {
  const form = $("payout-form");
  const refresh = async () => {
    const providers = await allPages("/v1/providers");
    fill($("providers").tBodies[0], providers.map((p) => [
      el("a", { href: `/ui/provider?p=${encodeURIComponent(p.name)}` }, p.name), `${num(p.fee_rate * 100, 1)} %`,
      p.clusters.join(", ") || "—", `$${p.balance}`, when(p.created_at)]));
    const keep = field(form, "provider_id").value;
    field(form, "provider_id").replaceChildren(...providers.map((p) => el("option", { value: p.id }, p.name)));
    if (keep) field(form, "provider_id").value = keep;
  };
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    fieldErrors(form, { errors: [] });
    $("paid").textContent = "";
    try {
      const made = await api("POST", `/v1/providers/${field(form, "provider_id").value}/payouts`, {
        amount: field(form, "amount").value.trim(), reference: field(form, "reference").value });
      $("paid").textContent = `paid $${made.amount}`;
      form.reset();
      await refresh();
    } catch (e) { fieldErrors(form, e); }
  });
  every(10000, refresh);
}

const PAGES = {
  login, network, jobs, job, quote, usage, pricing, provider,
  providers: adminProviders, clusters: adminClusters, tenants: adminTenants, keys: adminKeys, audit: adminAudit,
};
const start = PAGES[main.dataset.page];
if (start) start();
