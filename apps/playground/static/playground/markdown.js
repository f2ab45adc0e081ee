// Markdown for replies: marked (GitHub flavour: tables, fenced code, lists,
// single newlines kept as line breaks) with code highlighted by highlight.js
// and a Copy button on each block. Model output is never trusted as markup:
// raw HTML in a reply is shown as text, and the result goes through DOMPurify
// (which also drops javascript: links) before it reaches the page. All three
// libraries are vendored under vendor/ with their licenses; nothing is fetched.
"use strict";

(function (global) {
  const { marked } = global;
  const hljs = global.hljs;
  const DOMPurify = global.DOMPurify;

  function escapeHtml(s) {
    return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
  }

  // Highlight when the fence names a language highlight.js knows; otherwise
  // plain (guessing a language would run over the whole block on every frame
  // of a stream).
  function highlight(code, lang) {
    if (lang && hljs && hljs.getLanguage(lang)) {
      try { return hljs.highlight(code, { language: lang, ignoreIllegals: true }).value; } catch (e) { /* plain */ }
    }
    return escapeHtml(code);
  }

  const renderer = {
    // Raw HTML from the model is text, never markup.
    html(token) {
      const text = escapeHtml(token.text);
      return token.block ? "<p>" + text + "</p>" : text;
    },
    code(token) {
      const lang = ((token.lang || "").match(/^[\w+#.-]+/) || [""])[0].toLowerCase();
      return '<div class="code-block"><div class="code-head"><span class="code-lang">' + escapeHtml(lang || "text") +
        '</span><button type="button" class="copy-code" title="Copy the code">Copy</button></div>' +
        '<pre><code class="hljs' + (lang ? " language-" + escapeHtml(lang) : "") + '">' +
        highlight(token.text, lang) + "</code></pre></div>";
    },
    // Task lists: a mark, not a form control.
    checkbox(token) {
      return token.checked ? "\u2611 " : "\u2610 ";
    },
    // Wide tables scroll inside the reply instead of widening the page.
    table(token) {
      return '<div class="table-wrap">' + marked.Renderer.prototype.table.call(this, token) + "</div>";
    },
  };

  marked.use({ gfm: true, breaks: true, renderer });

  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A" && node.getAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });

  const PURIFY = { FORBID_TAGS: ["style", "form", "input", "textarea", "select"], FORBID_ATTR: ["style"] };

  function render(src) {
    if (!src) return "";
    return DOMPurify.sanitize(marked.parse(String(src)), PURIFY);
  }

  // Clipboard: the async API where the page may use it, else a hidden textarea.
  async function copyText(text) {
    if (navigator.clipboard && global.isSecureContext) {
      try { await navigator.clipboard.writeText(text); return true; } catch (e) { /* fall back */ }
    }
    const ta = document.createElement("textarea");
    ta.value = text;
    ta.setAttribute("readonly", "");
    ta.style.position = "fixed";
    ta.style.opacity = "0";
    document.body.appendChild(ta);
    ta.select();
    let ok = false;
    try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
    ta.remove();
    return ok;
  }

  // One listener for every Copy button, present and future (replies re-render while they stream).
  document.addEventListener("click", async (e) => {
    const btn = e.target.closest && e.target.closest(".copy-code");
    if (!btn) return;
    const code = btn.closest(".code-block").querySelector("pre code");
    const ok = await copyText(code ? code.textContent : "");
    btn.textContent = ok ? "Copied" : "Copy failed";
    btn.classList.toggle("copied", ok);
    setTimeout(() => { btn.textContent = "Copy"; btn.classList.remove("copied"); }, 2000);
  });

  global.IgnisMarkdown = { render, escapeHtml, copyText };
})(window);
