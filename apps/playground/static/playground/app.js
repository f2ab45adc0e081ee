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
  const CONV_STORE = "ignis.conversations";

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
  //
  // A conversation is a list of turns: {role: "user", content, images} and
  // {role: "assistant", content, reasoning, tools, timings, error}. A turn that
  // failed (an HTTP error, a stream error, a Stop before any token) is marked
  // failed, shown as such and left out of what the next request sends. Finished
  // turns, the system prompt, the sampling fields and the draft are kept in
  // localStorage, so a reload brings every conversation back. A user turn's
  // images (data: URLs, attached with the Image button or dropped on the
  // conversation) are sent as image_url parts and shown as thumbnails.

  let convCount = 0;
  const convs = [];
  const SAMPLING = ["temperature", "top_p", "max_tokens", "seed"];

  function num(el) { const v = el.value.trim(); return v === "" ? undefined : Number(v); }

  const store = {
    timer: null,
    load() {
      try {
        const data = JSON.parse(localStorage.getItem(CONV_STORE) || "null");
        return data && Array.isArray(data.convs) ? data.convs : [];
      } catch (e) { return []; }
    },
    save() {
      clearTimeout(this.timer);
      this.timer = null;
      const states = convs.map((c) => c.state());
      try {
        localStorage.setItem(CONV_STORE, JSON.stringify({ version: 1, convs: states }));
      } catch (e) {
        try { // images are what fills the storage: keep the text at least
          for (const st of states) st.turns = st.turns.map((t) => (t.images ? Object.assign({}, t, { images: undefined }) : t));
          localStorage.setItem(CONV_STORE, JSON.stringify({ version: 1, convs: states }));
        } catch (e2) { /* storage full or refused: the page still works, it just forgets */ }
      }
    },
    soon() { if (this.timer === null) this.timer = setTimeout(() => this.save(), 300); },
  };
  window.addEventListener("pagehide", () => store.save());

  class Conversation {
    constructor(saved) {
      this.n = ++convCount;
      this.turns = [];
      this.busy = false;
      this.attachments = []; // data: URLs of the images the next message sends
      this.el = $("#conv-template").content.firstElementChild.cloneNode(true);
      this.el.dataset.conv = String(this.n);
      $(".conv-title", this.el).textContent = "Conversation " + this.n;
      $(".composer", this.el).addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
      $(".input", this.el).addEventListener("keydown", (e) => {
        if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); this.send(); }
      });
      $(".stop", this.el).addEventListener("click", () => this.controller && this.controller.abort());
      $(".conv-clear", this.el).addEventListener("click", () => this.clear());
      $(".conv-close", this.el).addEventListener("click", () => this.close());
      $(".attach", this.el).addEventListener("click", () => $(".file", this.el).click());
      $(".file", this.el).addEventListener("change", (e) => { this.attach(e.target.files); e.target.value = ""; });
      this.el.addEventListener("dragover", (e) => {
        if (!e.dataTransfer || !Array.from(e.dataTransfer.types || []).includes("Files")) return;
        e.preventDefault();
        this.el.classList.add("dragging");
      });
      this.el.addEventListener("dragleave", (e) => { if (!this.el.contains(e.relatedTarget)) this.el.classList.remove("dragging"); });
      this.el.addEventListener("drop", (e) => {
        this.el.classList.remove("dragging");
        if (!e.dataTransfer || !e.dataTransfer.files.length) return;
        e.preventDefault();
        this.attach(e.dataTransfer.files);
      });
      this.el.addEventListener("input", () => store.soon());
      this.el.addEventListener("change", () => store.soon());
      $("#convs").appendChild(this.el);
      if (saved) this.restore(saved);
      this.showModelNotice();
    }

    // What localStorage keeps: finished turns only (one still streaming is not kept).
    state() {
      const s = { system: $(".system", this.el).value, draft: $(".input", this.el).value, turns: this.turns.filter((t) => !t.pending) };
      for (const k of SAMPLING) s[k] = $("." + k, this.el).value;
      return s;
    }

    restore(saved) {
      $(".system", this.el).value = saved.system || "";
      $(".input", this.el).value = saved.draft || "";
      for (const k of SAMPLING) if (typeof saved[k] === "string") $("." + k, this.el).value = saved[k];
      for (const t of saved.turns || []) {
        if (!t || (t.role !== "user" && t.role !== "assistant")) continue;
        this.append(t);
      }
    }

    // Add a turn and its bubble (restoring, or a reply given by the page's own JS).
    append(turn) {
      const t = Object.assign({ content: "" }, turn);
      this.turns.push(t);
      t.el = this.addMessage(t.role, t.content, t.images);
      if (t.role === "assistant") { this.paint(t); t.el.classList.add("done"); }
      if (t.failed) this.markFailed(t);
      this.scroll();
      return t;
    }

    clear() {
      if (this.busy) return;
      this.turns = [];
      $(".messages", this.el).innerHTML = "";
      store.save();
    }

    close() {
      if (this.controller) this.controller.abort();
      this.el.remove();
      convs.splice(convs.indexOf(this), 1);
      store.save();
    }

    // The messages a request sends: every turn that did not fail, in order.
    history() {
      return this.turns.filter((t) => !t.failed && !t.pending).map((t) => message(t.role, t.content, t.images));
    }

    // Image files (picked or dropped) as data: URLs, shown above the composer until sent.
    async attach(files) {
      for (const file of Array.from(files || [])) {
        if (!file.type.startsWith("image/")) continue;
        try { this.attachments.push(await imageDataUrl(file)); } catch (e) { /* unreadable: skipped */ }
      }
      this.showAttachments();
    }

    showAttachments() {
      const box = $(".attachments", this.el);
      box.innerHTML = "";
      box.hidden = !this.attachments.length;
      this.attachments.forEach((url, i) => {
        const item = document.createElement("div");
        item.className = "attachment";
        item.appendChild(thumb(url));
        const remove = document.createElement("button");
        remove.type = "button";
        remove.className = "remove";
        remove.title = "Remove this image";
        remove.textContent = "×";
        remove.addEventListener("click", () => { this.attachments.splice(i, 1); this.showAttachments(); });
        item.appendChild(remove);
        box.appendChild(item);
      });
    }

    body(messages) {
      const system = $(".system", this.el).value.trim();
      const body = { messages: (system ? [{ role: "system", content: system }] : []).concat(messages), stream: true, stream_options: { include_usage: true } };
      for (const k of SAMPLING) {
        const v = num($("." + k, this.el));
        if (v !== undefined && !Number.isNaN(v)) body[k] = v;
      }
      return body;
    }

    addMessage(role, text, images) {
      const el = document.createElement("div");
      el.className = "msg " + role;
      if (role === "user") {
        if (images && images.length) {
          const row = document.createElement("div");
          row.className = "msg-images";
          for (const url of images) row.appendChild(thumb(url));
          el.appendChild(row);
        }
        el.appendChild(document.createTextNode(text));
      } else {
        el.innerHTML = '<div class="waiting note" hidden></div>' +
          '<details class="reasoning" hidden><summary>Reasoning</summary><div class="reasoning-body"></div></details>' +
          '<div class="content md"></div><div class="tool-calls"></div><div class="timings"></div>';
      }
      $(".messages", this.el).appendChild(el);
      return el;
    }

    paint(t) {
      const out = t.el;
      $(".content", out).innerHTML = md.render(t.content);
      const r = $(".reasoning", out);
      if (t.reasoning) { r.hidden = false; $(".reasoning-body", r).innerHTML = md.render(t.reasoning); }
      $(".tool-calls", out).innerHTML = (t.tools || []).map((tc) =>
        '<div class="tool-call"><span class="tool-name">' + md.escapeHtml(tc.name || "?") + "</span>(<code>" +
        md.escapeHtml(tc.args || "") + "</code>)</div>").join("");
      $(".timings", out).textContent = t.timings || "";
      let e = $(".error", out);
      if (t.error && !e) { e = document.createElement("div"); e.className = "error"; out.appendChild(e); }
      if (e) e.textContent = t.error || "";
      this.showWaiting(t);
    }

    // Failed turns stay on screen, dimmed, with a way to send the text again.
    markFailed(t) {
      t.el.classList.add("failed");
      if (t.role !== "assistant" || $(".failed-note", t.el)) return;
      const note = document.createElement("div");
      note.className = "failed-note note";
      note.textContent = "Left out of the conversation: the next message does not resend it. ";
      const user = this.turns[this.turns.indexOf(t) - 1];
      if (user && user.role === "user") {
        const retry = document.createElement("button");
        retry.type = "button";
        retry.className = "retry";
        retry.textContent = "Retry";
        retry.addEventListener("click", () => {
          if (this.busy) return;
          $(".input", this.el).value = user.content;
          this.attachments = (user.images || []).slice();
          this.send();
        });
        note.appendChild(retry);
      }
      t.el.appendChild(note);
    }

    // While a turn waits for its first token: a notice, and what the engine is doing.
    showWaiting(t) {
      const w = $(".waiting", t.el);
      if (!w) return;
      const waiting = t.pending && !t.content && !t.reasoning && !(t.tools && t.tools.length);
      w.hidden = !waiting;
      if (waiting) w.textContent = modelState.loading ? loadingText() + " The reply starts once it serves." : "Waiting for the first token…";
    }

    showModelNotice() {
      const n = $(".model-notice", this.el);
      n.hidden = !modelState.loading;
      n.textContent = modelState.loading ? loadingText() : "";
      for (const t of this.turns) if (t.pending) this.showWaiting(t);
    }

    async send() {
      const input = $(".input", this.el);
      const text = input.value.trim();
      if ((!text && !this.attachments.length) || this.busy) return;
      input.value = "";
      const images = this.attachments.length ? this.attachments.splice(0) : undefined;
      this.showAttachments();
      const messages = this.history().concat([message("user", text, images)]);
      const user = this.append({ role: "user", content: text, images, pending: true });
      const reply = this.append({ role: "assistant", content: "", reasoning: "", tools: [], pending: true });
      const out = reply.el;
      out.classList.remove("done");
      const t0 = performance.now();
      let tFirst = null, tLast = null, usage = null, chunks = 0, finish = null, scheduled = false, failed = false;
      const paint = () => { scheduled = false; this.paint(reply); this.scroll(); };
      const schedule = () => { if (!scheduled) { scheduled = true; requestAnimationFrame(paint); } };
      this.setBusy(true);
      this.controller = new AbortController();
      out.classList.add("streaming");
      this.showWaiting(reply);
      pollModelsSoon();
      try {
        const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(true), body: JSON.stringify(this.body(messages)), signal: this.controller.signal });
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
          if (d.taken_back) { // the loop guard or the thinking budget closed the reasoning here (docs/API.md)
            const why = d.taken_back.reason === "budget" ? "thinking budget reached" : "loop taken back";
            reply.reasoning += "\n\n*— " + why + (d.taken_back.tokens ? " (" + d.taken_back.tokens + " tokens)" : "") + " —*\n\n";
            schedule();
          }
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
      } catch (err) {
        if (err.name === "AbortError") {
          finish = "stopped";
          failed = !reply.content && !reply.reasoning && !reply.tools.length; // a partial reply is kept
        } else {
          failed = true;
          reply.error = err.message;
        }
      } finally {
        user.pending = false;
        reply.pending = false;
        reply.timings = failed && tFirst === null ? (finish || "") : this.timings(t0, tFirst, tLast, usage, chunks, finish);
        this.paint(reply);
        if (failed) { user.failed = true; reply.failed = true; this.markFailed(user); this.markFailed(reply); }
        out.classList.remove("streaming");
        out.classList.add("done");
        this.controller = null;
        this.setBusy(false);
        this.scroll();
        store.save();
      }
    }

    timings(t0, tFirst, tLast, usage, chunks, finish) {
      const parts = [];
      if (tFirst !== null) parts.push("TTFT " + ((tFirst - t0) / 1000).toFixed(2) + " s");
      const tokens = usage ? usage.completion_tokens : chunks;
      if (tFirst !== null && tLast > tFirst && tokens > 1) {
        parts.push(((tokens - 1) / ((tLast - tFirst) / 1000)).toFixed(1) + " tok/s");
      }
      parts.push(tokens + (tokens === 1 ? " token" : " tokens"));
      const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
      if (usage) parts.push("cached " + (cached || 0) + " of " + usage.prompt_tokens);
      if (usage && usage.speculation && usage.speculation.drafted) { // speculative rounds' drafts kept
        parts.push("drafts " + usage.speculation.accepted + "/" + usage.speculation.drafted + " accepted");
      }
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

  // A turn as the API takes it: text alone as a string, with images as parts (images first).
  function message(role, text, images) {
    if (!images || !images.length) return { role, content: text || "" };
    const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
    if (text) parts.push({ type: "text", text });
    return { role, content: parts };
  }

  function thumb(url) {
    const img = document.createElement("img");
    img.className = "thumb";
    img.alt = "attached image";
    img.src = url;
    return img;
  }

  // A file as a data: URL. One past MAX_IMAGE_BYTES (a phone photo) is drawn
  // smaller (at most MAX_IMAGE_SIDE px) and sent as JPEG, so the request stays
  // under the server's body limit (server.body_limit, 4 MiB by default).
  const MAX_IMAGE_BYTES = 2 << 20, MAX_IMAGE_SIDE = 2048;
  function readDataUrl(blob) {
    return new Promise((resolve, reject) => {
      const r = new FileReader();
      r.onload = () => resolve(r.result);
      r.onerror = () => reject(r.error);
      r.readAsDataURL(blob);
    });
  }
  async function imageDataUrl(file) {
    const url = await readDataUrl(file);
    if (file.size <= MAX_IMAGE_BYTES) return url;
    const img = await new Promise((resolve, reject) => {
      const im = new Image();
      im.onload = () => resolve(im);
      im.onerror = reject;
      im.src = url;
    });
    const scale = Math.min(1, MAX_IMAGE_SIDE / Math.max(img.naturalWidth, img.naturalHeight));
    const canvas = document.createElement("canvas");
    canvas.width = Math.max(1, Math.round(img.naturalWidth * scale));
    canvas.height = Math.max(1, Math.round(img.naturalHeight * scale));
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff"; // transparency over white, as the model's processor does
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.drawImage(img, 0, 0, canvas.width, canvas.height);
    return canvas.toDataURL("image/jpeg", 0.9);
  }

  function addConversation(saved) {
    const c = new Conversation(saved && saved.turns ? saved : undefined);
    convs.push(c);
    store.soon();
    return c;
  }

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
      // Speculative rounds (docs/SPECULATION.md): drafts kept / proposed by drafter, tokens a decode round.
      const draftedOf = (d) => g('ignis_spec_drafted_tokens_total{drafter="' + d + '"}');
      const keptOf = (d) => g('ignis_spec_accepted_tokens_total{drafter="' + d + '"}');
      const drafters = Object.keys(m).filter((k) => k.startsWith("ignis_spec_drafted_tokens_total{"))
        .map((k) => k.slice(k.indexOf('"') + 1, k.lastIndexOf('"'))).filter((d) => draftedOf(d) > 0);
      const rounds = g("ignis_decode_rounds_total");
      $("#monitor-spec").textContent = (drafters.length ? drafters.map((d) => d + " " + keptOf(d) + "/" + draftedOf(d) +
        " kept (" + ((100 * keptOf(d)) / draftedOf(d)).toFixed(0) + "%)").join(" · ") : "no drafts yet") +
        (rounds ? " · " + (g("ignis_decoded_tokens_total") / rounds).toFixed(2) + " tokens a round" : "");
      const mib = (b) => (b / 1048576).toFixed(0) + " MiB";
      $("#monitor-plan").textContent = ["weights", "kv", "workspace", "host_kv"]
        .map((p) => p + " " + mib(g('ignis_memory_plan_bytes{part="' + p + '"}'))).join(" · ");
      // A fleet (docs/FLEET.md): one line per engine worker, from the front end's routing table.
      const workers = data.workers || [];
      $("#monitor-workers").textContent = workers.length ? workers.map((w) => w.id + " (" + w.model + ") " + w.status +
        " · " + w.lanes_busy + "/" + w.lanes_total + " lanes · " + w.kv_pages_free + " pages free").join(" | ") : "–";
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

  // What GET /v1/models last said about the model that serves (or loads).
  const modelState = { id: null, status: null, loading: false, progress: null };

  function loadingText() {
    const p = modelState.progress;
    const pct = p && p.total ? " " + Math.floor((100 * p.done) / p.total) + "%" : "";
    const verb = modelState.status === "switching" ? "Switching model" : "Loading model";
    return verb + " " + (modelState.id || "") + pct + "…";
  }

  let modelsTimer = null;

  async function pollModels() {
    clearTimeout(modelsTimer);
    try {
      const data = await apiJson("GET", "/v1/models");
      const entries = data.data || [];
      const live = entries.find((e) => e.status && e.status !== "unloaded") || entries[0];
      const pill = $("#model-status");
      pill.textContent = live ? live.id + " · " + (live.status || "?") : "no model";
      pill.title = "GET /v1/models: " + pill.textContent;
      pill.dataset.status = live ? live.status || "" : "";
      if (live && live.switching) pill.textContent += " (" + live.switching.from + " → " + live.switching.to + ")";
      $("#model-options").innerHTML = entries.map((e) => '<option value="' + md.escapeHtml(e.id) + '">').join("");
      const to = data.switching && data.switching.to;
      modelState.status = live ? live.status : null;
      modelState.loading = modelState.status === "loading" || modelState.status === "switching";
      modelState.id = (modelState.status === "switching" && to) || (live && live.id) || null;
      modelState.progress = (live && live.load_progress) || null;
    } catch (e) {
      $("#model-status").textContent = e.message;
    }
    convs.forEach((c) => c.showModelNotice());
    // Every 5 s; every second while the model loads or a turn waits for its first token.
    const waiting = convs.some((c) => c.turns.some((t) => t.pending && !t.content));
    modelsTimer = setTimeout(pollModels, modelState.loading || waiting ? 1000 : 5000);
  }

  function pollModelsSoon() { clearTimeout(modelsTimer); modelsTimer = setTimeout(pollModels, 300); }

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
    $("#add-conv").addEventListener("click", () => addConversation());
    $("#send-all").addEventListener("click", () => convs.forEach((c) => c.send()));
    $("#model-switch").addEventListener("click", switchModel);
    $("#decide-run").addEventListener("click", decide);
    const saved = store.load();
    if (saved.length) saved.forEach((s) => addConversation(s)); else addConversation();
    pollModels();
    monitor.poll();
    setInterval(() => { if (!document.hidden) monitor.poll(); }, 500);
  }

  window.IgnisPlayground = { addConversation, showTab, monitor, convs, pollModels, modelState, store };
  start();
})();
