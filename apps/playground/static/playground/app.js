// The ignis Playground: Chat (several conversations side by side, each
// streaming at its own rate), Monitor (the engine's live state, the numbers
// /metrics has), Decide, and the model switcher. It talks to the same public
// API as any client; chat and decide requests name no model, so the loaded
// one answers and nothing switches unless asked.
"use strict";

(function () {
  const $ = (sel, root) => (root || document).querySelector(sel);
  const md = window.IgnisMarkdown;
  const KEY_STORE = "ignis.apiKey";

  // -- API ------------------------------------------------------------------

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const key = localStorage.getItem(KEY_STORE);
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  async function apiJson(method, path, body) {
    const resp = await fetch(path, { method, headers: headers(body !== undefined), body: body === undefined ? undefined : JSON.stringify(body) });
    let data = null;
    try { data = await resp.json(); } catch (e) { /* not JSON */ }
    if (!resp.ok) {
      const msg = (data && data.error && data.error.message) || resp.statusText;
      const err = new Error("HTTP " + resp.status + ": " + msg);
      err.status = resp.status; err.data = data;
      throw err;
    }
    return data;
  }

  // Server-sent events from a fetch body: calls onEvent(parsed JSON) per data line.
  async function readSSE(resp, onEvent) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
        const raw = buf.slice(0, cut);
        buf = buf.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = raw.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (!data || data === "[DONE]") continue;
        onEvent(JSON.parse(data));
      }
    }
  }

  // -- tabs -----------------------------------------------------------------

  function showTab(name) {
    document.querySelectorAll(".tab-btn").forEach((b) => b.classList.toggle("active", b.dataset.tab === name));
    document.querySelectorAll(".tab-panel").forEach((p) => { p.hidden = p.id !== "tab-" + name; });
    if (name === "monitor") monitor.draw();
  }

  // -- chat -----------------------------------------------------------------

  let convCount = 0;
  const convs = [];

  function num(el) { const v = el.value.trim(); return v === "" ? undefined : Number(v); }

  class Conversation {
    constructor() {
      this.n = ++convCount;
      this.messages = [];
      this.busy = false;
      this.el = $("#conv-template").content.firstElementChild.cloneNode(true);
      this.el.dataset.conv = String(this.n);
      $(".conv-title", this.el).textContent = "Conversation " + this.n;
      $(".composer", this.el).addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
      $(".input", this.el).addEventListener("keydown", (e) => {
        if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); this.send(); }
      });
      $(".stop", this.el).addEventListener("click", () => this.controller && this.controller.abort());
      $(".conv-clear", this.el).addEventListener("click", () => { if (!this.busy) { this.messages = []; $(".messages", this.el).innerHTML = ""; } });
      $(".conv-close", this.el).addEventListener("click", () => this.close());
      $("#convs").appendChild(this.el);
    }

    close() {
      if (this.controller) this.controller.abort();
      this.el.remove();
      convs.splice(convs.indexOf(this), 1);
    }

    body() {
      const system = $(".system", this.el).value.trim();
      const messages = (system ? [{ role: "system", content: system }] : []).concat(this.messages);
      const body = { messages, stream: true, stream_options: { include_usage: true } };
      for (const k of ["temperature", "top_p", "max_tokens", "seed"]) {
        const v = num($("." + k, this.el));
        if (v !== undefined && !Number.isNaN(v)) body[k] = v;
      }
      return body;
    }

    addMessage(role, text) {
      const el = document.createElement("div");
      el.className = "msg " + role;
      if (role === "user") {
        el.textContent = text;
      } else {
        el.innerHTML = '<details class="reasoning" hidden><summary>Reasoning</summary><div class="reasoning-body"></div></details>' +
          '<div class="content md"></div><div class="tool-calls"></div><div class="timings"></div>';
      }
      $(".messages", this.el).appendChild(el);
      return el;
    }

    async send() {
      const input = $(".input", this.el);
      const text = input.value.trim();
      if (!text || this.busy) return;
      input.value = "";
      this.messages.push({ role: "user", content: text });
      this.addMessage("user", text);
      const out = this.addMessage("assistant");
      const reply = { content: "", reasoning: "", tools: [] };
      const t0 = performance.now();
      let tFirst = null, tLast = null, usage = null, chunks = 0, finish = null, scheduled = false;
      const paint = () => {
        scheduled = false;
        $(".content", out).innerHTML = md.render(reply.content);
        const r = $(".reasoning", out);
        if (reply.reasoning) { r.hidden = false; $(".reasoning-body", r).innerHTML = md.render(reply.reasoning); }
        $(".tool-calls", out).innerHTML = reply.tools.map((t) =>
          '<div class="tool-call"><span class="tool-name">' + md.escapeHtml(t.name || "?") + "</span>(<code>" +
          md.escapeHtml(t.args || "") + "</code>)</div>").join("");
        this.scroll();
      };
      const schedule = () => { if (!scheduled) { scheduled = true; requestAnimationFrame(paint); } };
      this.setBusy(true);
      this.controller = new AbortController();
      out.classList.add("streaming");
      try {
        const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(true), body: JSON.stringify(this.body()), signal: this.controller.signal });
        if (!resp.ok) {
          let msg = resp.statusText;
          try { const d = await resp.json(); msg = (d.error && d.error.message) || msg; } catch (e) { /* not JSON */ }
          throw new Error("HTTP " + resp.status + ": " + msg);
        }
        await readSSE(resp, (ev) => {
          if (ev.error) throw new Error(ev.error.message || "stream error");
          if (ev.usage) usage = ev.usage;
          const choice = ev.choices && ev.choices[0];
          if (!choice) return;
          if (choice.finish_reason) finish = choice.finish_reason;
          const d = choice.delta || {};
          const piece = (d.content || "") + (d.reasoning_content || d.reasoning || "");
          if (d.content) reply.content += d.content;
          if (d.reasoning_content || d.reasoning) reply.reasoning += d.reasoning_content || d.reasoning;
          for (const tc of d.tool_calls || []) {
            const slot = reply.tools[tc.index || 0] || (reply.tools[tc.index || 0] = { name: "", args: "" });
            if (tc.function && tc.function.name) slot.name += tc.function.name;
            if (tc.function && tc.function.arguments) slot.args += tc.function.arguments;
          }
          if (piece || (d.tool_calls && d.tool_calls.length)) {
            chunks += 1;
            tLast = performance.now();
            if (tFirst === null) tFirst = tLast;
            schedule();
          }
        });
        const msg = { role: "assistant", content: reply.content };
        this.messages.push(msg);
      } catch (err) {
        if (err.name !== "AbortError") {
          const e = document.createElement("div");
          e.className = "error";
          e.textContent = err.message;
          out.appendChild(e);
        } else {
          finish = "stopped";
        }
      } finally {
        paint();
        out.classList.remove("streaming");
        out.classList.add("done");
        $(".timings", out).textContent = this.timings(t0, tFirst, tLast, usage, chunks, finish);
        this.controller = null;
        this.setBusy(false);
      }
    }

    timings(t0, tFirst, tLast, usage, chunks, finish) {
      const parts = [];
      if (tFirst !== null) parts.push("TTFT " + ((tFirst - t0) / 1000).toFixed(2) + " s");
      const tokens = usage ? usage.completion_tokens : chunks;
      if (tFirst !== null && tLast > tFirst && tokens > 1) {
        parts.push(((tokens - 1) / ((tLast - tFirst) / 1000)).toFixed(1) + " tok/s");
      }
      parts.push(tokens + " tokens");
      const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
      if (usage) parts.push("cached " + (cached || 0) + " of " + usage.prompt_tokens);
      if (finish) parts.push(finish);
      return parts.join(" · ");
    }

    setBusy(busy) {
      this.busy = busy;
      this.el.classList.toggle("busy", busy);
      $(".send", this.el).disabled = busy;
      $(".stop", this.el).hidden = !busy;
    }

    scroll() { const m = $(".messages", this.el); m.scrollTop = m.scrollHeight; }
  }

  function addConversation() { const c = new Conversation(); convs.push(c); return c; }

  // -- monitor --------------------------------------------------------------

  const monitor = {
    history: [], // [seconds, decoded tokens total]
    rates: [], // aggregate tokens/s per poll
    last: null,

    async poll() {
      let data;
      try { data = await apiJson("GET", "/ui/api/monitor"); } catch (e) { $("#monitor-model").textContent = e.message; return; }
      this.last = data;
      const m = data.metrics || {};
      const decoded = m["ignis_decoded_tokens_total"] || 0;
      const prev = this.history[this.history.length - 1];
      if (prev && data.ts > prev[0]) this.rates.push(Math.max(0, (decoded - prev[1]) / (data.ts - prev[0])));
      this.history.push([data.ts, decoded]);
      if (this.history.length > 2) this.history.shift();
      if (this.rates.length > 120) this.rates.shift();
      this.render(data, m);
    },

    render(data, m) {
      const g = (k) => m[k] || 0;
      $("#monitor-model").textContent = (data.model || "?") + " · " + data.status;
      $("#monitor-lanes-busy").textContent = g("ignis_lanes_busy") + " / " + g("ignis_lanes_total");
      const rate = this.rates.length ? this.rates[this.rates.length - 1] : 0;
      $("#monitor-throughput").textContent = rate.toFixed(1) + " tok/s";
      $("#monitor-decoded").textContent = String(g("ignis_decoded_tokens_total"));
      $("#monitor-requests").textContent = g("ignis_requests_admitted_total") + " in · " + g("ignis_requests_finished_total") + " done";
      $("#monitor-reuse").textContent = g("ignis_prefix_cache_hits_total") + " hits · " + g("ignis_prefix_cached_tokens_total") + " tok";

      const lanesEl = $("#monitor-lanes");
      const total = g("ignis_lanes_total");
      let html = "";
      for (let i = 0; i < total; i++) {
        const lane = data.lanes[i];
        const r = m['ignis_lane_tokens_per_second{lane="' + i + '"}'] || 0;
        if (!lane) {
          html += '<div class="lane idle"><span class="lane-id">' + i + '</span><span class="lane-state">idle</span></div>';
          continue;
        }
        const pct = lane.max_tokens ? Math.min(100, (100 * lane.output_tokens) / lane.max_tokens) : 0;
        html += '<div class="lane busy" data-state="' + lane.state + '"><span class="lane-id">' + i + "</span>" +
          '<span class="lane-state">' + lane.state + " · " + lane["class"] + "</span>" +
          '<span class="lane-bar"><span style="width:' + pct.toFixed(1) + '%"></span></span>' +
          '<span class="lane-tokens">' + lane.output_tokens + "/" + lane.max_tokens + "</span>" +
          '<span class="lane-rate">' + r.toFixed(1) + " tok/s</span></div>";
      }
      lanesEl.innerHTML = html;

      const pd = g('ignis_prefill_tokens{part="done"}'), pt = g('ignis_prefill_tokens{part="total"}');
      $("#monitor-prefill-bar").style.width = pt ? ((100 * pd) / pt).toFixed(1) + "%" : "0%";
      $("#monitor-prefill").textContent = pt ? pd + " / " + pt + " prompt tokens" : "idle";

      const pool = g("ignis_kv_pool_pages");
      const used = g('ignis_kv_pages{state="used"}'), kept = g('ignis_kv_pages{state="retained"}');
      $("#kv-used").style.width = pool ? ((100 * used) / pool).toFixed(2) + "%" : "0%";
      $("#kv-retained").style.width = pool ? ((100 * kept) / pool).toFixed(2) + "%" : "0%";
      $("#monitor-kv").textContent = used + " used · " + kept + " retained · " + g('ignis_kv_pages{state="free"}') +
        " free of " + pool + " pages (" + g("ignis_kv_page_tokens") + " tokens each) · " + g("ignis_kv_pages_on_host") +
        " on host of " + g("ignis_kv_host_pool_pages");
      const mib = (b) => (b / 1048576).toFixed(0) + " MiB";
      $("#monitor-plan").textContent = ["weights", "kv", "workspace", "host_kv"]
        .map((p) => p + " " + mib(g('ignis_memory_plan_bytes{part="' + p + '"}'))).join(" · ");
      if (!$("#tab-monitor").hidden) this.draw();
    },

    draw() {
      const c = $("#monitor-chart");
      const ctx = c.getContext("2d");
      const w = c.width, h = c.height, pad = 30;
      ctx.clearRect(0, 0, w, h);
      const max = Math.max(1, ...this.rates) * 1.1;
      ctx.strokeStyle = "#3a4150"; ctx.fillStyle = "#8b93a7"; ctx.font = "11px sans-serif";
      for (let i = 0; i <= 4; i++) {
        const y = h - pad / 2 - ((h - pad) * i) / 4;
        ctx.beginPath(); ctx.moveTo(pad, y); ctx.lineTo(w, y); ctx.stroke();
        ctx.fillText(((max * i) / 4).toFixed(max < 10 ? 1 : 0), 2, y + 4);
      }
      if (this.rates.length < 2) return;
      ctx.strokeStyle = "#ff8a3d"; ctx.lineWidth = 2; ctx.beginPath();
      this.rates.forEach((r, i) => {
        const x = pad + ((w - pad) * i) / 119, y = h - pad / 2 - ((h - pad) * r) / max;
        if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      });
      ctx.stroke(); ctx.lineWidth = 1;
    },
  };

  // -- models ---------------------------------------------------------------

  async function pollModels() {
    try {
      const data = await apiJson("GET", "/v1/models");
      const entries = data.data || [];
      const live = entries.find((e) => e.status && e.status !== "unloaded") || entries[0];
      const pill = $("#model-status");
      pill.textContent = live ? live.id + " · " + (live.status || "?") : "no model";
      pill.dataset.status = live ? live.status || "" : "";
      if (live && live.switching) pill.textContent += " (" + live.switching.from + " → " + live.switching.to + ")";
      $("#model-options").innerHTML = entries.map((e) => '<option value="' + md.escapeHtml(e.id) + '">').join("");
    } catch (e) {
      $("#model-status").textContent = e.message;
    }
  }

  async function switchModel() {
    const target = $("#model-target").value.trim();
    const note = $("#model-switch-result");
    if (!target) { note.textContent = "name a model"; return; }
    note.textContent = "switching…";
    try {
      const data = await apiJson("POST", "/v1/models/switch", { model: target });
      note.textContent = (data && (data.status || data.result)) || "done";
    } catch (e) {
      note.textContent = e.message;
    }
    pollModels();
  }

  // -- decide ---------------------------------------------------------------

  async function decide() {
    const labels = $("#decide-labels").value.split(",").map((s) => s.trim()).filter(Boolean);
    const err = $("#decide-error"), chart = $("#decide-chart"), label = $("#decide-label");
    err.hidden = true; chart.innerHTML = ""; label.textContent = "…";
    try {
      const data = await apiJson("POST", "/v1/decide", {
        evidence: $("#decide-evidence").value, question: $("#decide-question").value, labels,
      });
      label.textContent = data.label !== undefined ? "→ " + data.label : "";
      let dist = data.distribution || {};
      if (Array.isArray(dist)) dist = Object.fromEntries(dist.map((d) => [d.label, d.probability !== undefined ? d.probability : d.p]));
      chart.innerHTML = Object.entries(dist).sort((a, b) => b[1] - a[1]).map(([k, p]) =>
        '<div class="bar-row"><span class="bar-label">' + md.escapeHtml(k) + '</span><span class="bar"><span class="bar-fill decide" style="width:' +
        (100 * p).toFixed(1) + '%"></span></span><span class="bar-value">' + (100 * p).toFixed(1) + "%</span></div>").join("");
    } catch (e) {
      label.textContent = "";
      err.textContent = e.message;
      err.hidden = false;
    }
  }

  // -- start ----------------------------------------------------------------

  function start() {
    document.querySelectorAll(".tab-btn").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
    const key = $("#api-key");
    key.value = localStorage.getItem(KEY_STORE) || "";
    key.addEventListener("change", () => {
      if (key.value.trim()) localStorage.setItem(KEY_STORE, key.value.trim()); else localStorage.removeItem(KEY_STORE);
      pollModels();
    });
    $("#add-conv").addEventListener("click", addConversation);
    $("#send-all").addEventListener("click", () => convs.forEach((c) => c.send()));
    $("#model-switch").addEventListener("click", switchModel);
    $("#decide-run").addEventListener("click", decide);
    addConversation();
    pollModels();
    setInterval(pollModels, 5000);
    monitor.poll();
    setInterval(() => { if (!document.hidden) monitor.poll(); }, 500);
  }

  window.IgnisPlayground = { addConversation, showTab, monitor, convs };
  start();
})();
