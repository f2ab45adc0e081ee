// A small markdown renderer for streamed replies: fenced code (an unclosed
// fence renders as code while it streams), headings, lists, quotes, rules,
// paragraphs; inline code, bold, italic and http(s) links. Everything is
// HTML-escaped first, so model output can never inject markup.
"use strict";

(function (global) {
  function escapeHtml(s) {
    return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
  }

  function inline(s) {
    // s is already escaped. Code spans first, kept away from the other rules.
    const codes = [];
    s = s.replace(/`([^`]+)`/g, (_, c) => { codes.push(c); return "\u0000" + (codes.length - 1) + "\u0000"; });
    s = s.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>");
    s = s.replace(/__([^_]+)__/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>");
    s = s.replace(/(^|[^\w])_([^_\s][^_]*)_(?!\w)/g, "$1<em>$2</em>");
    s = s.replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g,
      '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => "<code>" + codes[+i] + "</code>");
  }

  function blocks(text) {
    const out = [];
    let para = [], list = null;
    const flushPara = () => { if (para.length) { out.push("<p>" + inline(para.join("<br>")) + "</p>"); para = []; } };
    const flushList = () => {
      if (list) { out.push("<" + list.tag + ">" + list.items.map((i) => "<li>" + inline(i) + "</li>").join("") + "</" + list.tag + ">"); list = null; }
    };
    for (const line of text.split("\n")) {
      let m;
      if (!line.trim()) { flushPara(); flushList(); continue; }
      if ((m = line.match(/^(#{1,6})\s+(.*)$/))) {
        flushPara(); flushList();
        out.push("<h" + m[1].length + ">" + inline(m[2]) + "</h" + m[1].length + ">");
      } else if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
        flushPara(); flushList(); out.push("<hr>");
      } else if ((m = line.match(/^\s*[-*+]\s+(.*)$/)) || (m = line.match(/^\s*\d+[.)]\s+(.*)$/))) {
        flushPara();
        const tag = /^\s*\d/.test(line) ? "ol" : "ul";
        if (!list || list.tag !== tag) { flushList(); list = { tag, items: [] }; }
        list.items.push(m[1]);
      } else if ((m = line.match(/^&gt;\s?(.*)$/))) {
        flushPara(); flushList(); out.push("<blockquote>" + inline(m[1]) + "</blockquote>");
      } else if (list && /^\s{2,}\S/.test(line)) {
        list.items[list.items.length - 1] += " " + line.trim();
      } else {
        flushList(); para.push(line);
      }
    }
    flushPara(); flushList();
    return out.join("");
  }

  function render(src) {
    const text = escapeHtml(src || "");
    const parts = text.split(/^```/m);
    let html = "";
    parts.forEach((part, i) => {
      if (i % 2 === 0) { html += blocks(part); return; }
      const nl = part.indexOf("\n");
      const lang = nl < 0 ? part.trim() : part.slice(0, nl).trim();
      const code = nl < 0 ? "" : part.slice(nl + 1).replace(/\n$/, "");
      html += '<pre><code' + (lang ? ' data-lang="' + lang.replace(/[^\w+-]/g, "") + '"' : "") + ">" + code + "</code></pre>";
    });
    return html;
  }

  global.IgnisMarkdown = { render, escapeHtml };
})(window);
