"""The Playground in headless Chromium: load /ui/, stream a chat, three chats
at once on three lanes of the Monitor, the tabs; a phone-sized window;
markdown tables and highlighted code with a copy button; conversations kept
across reloads; a failed turn left out of the next request; the "loading
model" notice. Screenshots go to test-artifacts/playground/.

Where a test needs the server to answer something it will not on demand (a
fixed markdown reply, a 503, a model still loading), it wraps the page's
``fetch`` (FETCH_STUB): the page's own code then streams, renders and stores
as it does for the real server, and every other request goes through."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.e2e.browser import browser_available, start_chromium, viewport
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "playground"


@pytest.fixture(scope="module")
def browser():
    why = browser_available()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(why)  # .ci/run installs them: a skip there would hide a broken install
        pytest.skip(why)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver, profile = start_chromium()
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(browser, live_server_url):
    # Every test starts from no saved conversations. Cleared once the last page is
    # left: the Playground saves its conversations as it goes.
    browser.get("about:blank")
    browser.execute_cdp_cmd("Storage.clearDataForOrigin", {"origin": live_server_url, "storageTypes": "local_storage"})
    browser.get_log("browser")  # the console from here on is this test's
    browser.get(live_server_url + "/ui/")
    wait_for(lambda: "serving" in css(browser, "#model-status").text, 30, 0.1, "the model pill says serving")
    return browser


def css(driver, selector, root=None):
    return (root or driver).find_element("css selector", selector)


def css_all(driver, selector, root=None):
    return (root or driver).find_elements("css selector", selector)


def shot(driver, name: str) -> None:
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def set_field(driver, conv, selector: str, value: str) -> None:
    el = css(driver, selector, conv)
    el.clear()
    el.send_keys(value)


def sampling(driver, conv, max_tokens: int) -> None:
    if not css(driver, ".conv-settings", conv).get_attribute("open"):
        css(driver, ".conv-settings summary", conv).click()
    set_field(driver, conv, ".max_tokens", str(max_tokens))
    set_field(driver, conv, ".temperature", "0")


def prepare(driver, conv, text: str, max_tokens: int) -> None:
    sampling(driver, conv, max_tokens)
    css(driver, ".input", conv).send_keys(text)


def severe_console_errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "/v1/decide" not in e["message"]]


def test_page_loads_with_its_own_assets(page):
    assert "ignis" in page.title
    assert [b.text for b in css_all(page, ".tab-btn")] == ["Chat", "Monitor", "Decide"]
    assert len(css_all(page, ".conv")) == 1
    assert not css(page, "#tab-chat").get_attribute("hidden")
    for src in [s.get_attribute("src") for s in css_all(page, "script")]:
        assert "/ui/static/" in src  # nothing from a CDN
    shot(page, "01-loaded")
    assert severe_console_errors(page) == []


def test_a_chat_streams_in_with_timings(page):
    conv = css(page, ".conv")
    prepare(page, conv, "Write a short poem about the sea.", 24)
    css(page, ".send", conv).click()
    seen: list[str] = []

    def finished():
        text = css(page, ".msg.assistant .content", conv).text
        if text and (not seen or seen[-1] != text):
            seen.append(text)
        return css_all(page, ".msg.assistant.done", conv)

    wait_for(finished, 120, 0.05, "the reply to finish")
    final = css(page, ".msg.assistant .content", conv).text
    assert final.strip(), "a reply was rendered"
    partial = [s for s in seen if s != final]
    assert partial, f"the text streamed in piece by piece, saw only {seen!r}"
    timings = css(page, ".msg.assistant .timings", conv).text
    assert "TTFT" in timings and "tok/s" in timings and "cached" in timings, timings
    assert css(page, ".msg.user", conv).text == "Write a short poem about the sea."
    shot(page, "02-chat-streamed")


def test_three_chats_at_once_fill_three_lanes(page):
    css(page, "#add-conv").click()
    css(page, "#add-conv").click()
    convs = css_all(page, ".conv")
    assert len(convs) == 3
    topics = ("the ocean", "a mountain", "the city")
    for conv, topic in zip(convs, topics):
        prepare(page, conv, f"Write a long story about {topic}.", 40)
    css(page, "#send-all").click()
    wait_for(lambda: len(css_all(page, ".conv.busy")) == 3, 10, 0.1, "three conversations busy")
    shot(page, "03-three-chats-streaming")
    css(page, "#tab-btn-monitor").click()
    assert css(page, "#tab-chat").get_attribute("hidden") and not css(page, "#tab-monitor").get_attribute("hidden")
    wait_for(
        lambda: css(page, "#monitor-lanes-busy").text.startswith("3 /"), 60, 0.1, "the Monitor to show 3 busy lanes"
    )
    wait_for(lambda: len(css_all(page, ".lane.busy")) == 3, 10, 0.1, "three lane rows busy")
    wait_for(lambda: len(css_all(page, '.lane.busy[data-state="decoding"]')) >= 2, 90, 0.1, "lanes decoding")
    shot(page, "04-monitor-three-lanes")
    css(page, "#tab-btn-chat").click()
    wait_for(lambda: len(css_all(page, ".msg.assistant.done")) == 3, 240, 0.1, "all three replies to finish")
    for conv in convs:
        assert css(page, ".msg.assistant .content", conv).text.strip()
        assert "tok/s" in css(page, ".msg.assistant .timings", conv).text
    shot(page, "05-three-chats-done")
    css(page, "#tab-btn-monitor").click()
    wait_for(lambda: css(page, "#monitor-lanes-busy").text.startswith("0 /"), 30, 0.1, "the lanes to free")
    assert int(css(page, "#monitor-decoded").text) > 0
    assert "tokens a round" in css(page, "#monitor-spec").text  # the Speculation line: drafters, tokens a round
    shot(page, "06-monitor-idle")


def test_tabs_decide_and_switcher(page):
    css(page, "#tab-btn-decide").click()
    assert not css(page, "#tab-decide").get_attribute("hidden")
    assert css(page, "#tab-chat").get_attribute("hidden") and css(page, "#tab-monitor").get_attribute("hidden")
    css(page, "#decide-evidence").send_keys("The film was wonderful, I loved every minute.")
    css(page, "#decide-question").send_keys("Is the review positive?")
    css(page, "#decide-run").click()
    # /v1/decide is its own issue: a bar chart when it answers, its error shown when it does not.
    wait_for(
        lambda: css_all(page, "#decide-chart .bar-row") or css(page, "#decide-error").is_displayed(),
        120,
        0.1,
        "a distribution or an error",
    )
    if css_all(page, "#decide-chart .bar-row"):
        assert len(css_all(page, "#decide-chart .bar-row")) == 2
    else:
        assert css(page, "#decide-error").text.startswith("HTTP ")
    shot(page, "07-decide")
    # The switcher reports what the switch route said; an unknown model is refused.
    css(page, "#model-target").send_keys("no-such-model")
    css(page, "#model-switch").click()
    wait_for(lambda: css(page, "#model-switch-result").text.startswith("HTTP 4"), 30, 0.1, "the switch refusal")
    assert "serving" in css(page, "#model-status").text
    css(page, "#tab-btn-chat").click()
    assert not css(page, "#tab-chat").get_attribute("hidden")


def test_api_key_is_kept_in_local_storage(page, live_server_url):
    key = css(page, "#api-key")
    key.send_keys("sk-test-123")
    css(page, "#tab-btn-monitor").click()  # blur fires change
    assert page.execute_script("return localStorage.getItem('ignis.apiKey')") == "sk-test-123"
    page.get(live_server_url + "/ui/")
    assert css(page, "#api-key").get_attribute("value") == "sk-test-123"
    page.execute_script("localStorage.removeItem('ignis.apiKey')")


# -- fetch stub ---------------------------------------------------------------

# Wraps window.fetch. Chat requests are recorded (window.__bodies) and answered
# per window.__chat: "pass" (the real server), "fail" (one 503, then "pass"),
# "hold" (wait for window.__release(), then a fixed reply; Stop aborts it),
# "error:TEXT" (TEXT streamed, then an error event), "slow:TEXT" (TEXT
# streamed slowly; Stop aborts it) or any other string
# (streamed back as the reply, a few characters per SSE event). GET /v1/models
# answers window.__models when that is set.
FETCH_STUB = """
if (!window.__realFetch) {
  window.__realFetch = window.fetch.bind(window);
  window.__bodies = [];
  window.__chat = "pass";
  window.__models = null;
  const enc = new TextEncoder();
  const event = (obj) => enc.encode("data: " + JSON.stringify(obj) + "\\n\\n");
  window.__sse = (text, error, signal, delay) => new Response(new ReadableStream({
    async start(c) {
      for (const piece of text.match(/[\\s\\S]{1,9}/g) || []) {
        if (signal && signal.aborted) { c.error(new DOMException("aborted", "AbortError")); return; }
        c.enqueue(event({ choices: [{ index: 0, delta: { content: piece }, finish_reason: null }] }));
        await new Promise((r) => setTimeout(r, delay || 2));
      }
      if (error) { c.enqueue(event({ error })); c.close(); return; }
      c.enqueue(event({ choices: [{ index: 0, delta: {}, finish_reason: "stop" }] }));
      c.enqueue(enc.encode("data: [DONE]\\n\\n"));
      c.close();
    },
  }), { status: 200, headers: { "Content-Type": "text/event-stream" } });
  window.fetch = async (url, opts) => {
    const path = String(url);
    if (path.includes("/v1/chat/completions")) {
      window.__bodies.push(JSON.parse(opts.body));
      const mode = window.__chat;
      if (mode === "fail") {
        window.__chat = "pass";
        return new Response(JSON.stringify({ error: { message: "the engine is unavailable", type: "server_error",
          param: null, code: "engine_unavailable" } }), { status: 503, headers: { "Content-Type": "application/json" } });
      }
      if (mode === "hold") {
        await new Promise((resolve, reject) => {
          window.__release = resolve;
          if (opts.signal) opts.signal.addEventListener("abort", () => reject(new DOMException("aborted", "AbortError")));
        });
        return window.__sse("Ready.");
      }
      if (mode.startsWith("slow:")) return window.__sse(mode.slice(5), null, opts.signal, 40);
      if (mode.startsWith("error:")) return window.__sse(mode.slice(6), { message: "the engine stopped", type: "server_error" });
      if (mode !== "pass") return window.__sse(mode);
    }
    if (path.endsWith("/v1/models") && window.__models) {
      return new Response(JSON.stringify(window.__models), { status: 200, headers: { "Content-Type": "application/json" } });
    }
    return window.__realFetch(url, opts);
  };
}
"""


def stub(driver, chat: str = "pass") -> None:
    driver.execute_script(FETCH_STUB + "window.__chat = arguments[0];", chat)


def bodies(driver) -> list[dict]:
    return driver.execute_script("return window.__bodies")


def say(driver, conv, text: str) -> int:
    """Type and send a message; returns how many assistant bubbles are done once this one is."""
    done = len(css_all(driver, ".msg.assistant.done", conv)) + 1
    css(driver, ".input", conv).send_keys(text)
    css(driver, ".send", conv).click()
    return done


def wait_replied(driver, conv, done: int, timeout: float = 120) -> None:
    wait_for(
        lambda: len(css_all(driver, ".msg.assistant.done", conv)) >= done, timeout, 0.05, f"reply {done} to finish"
    )


MARKDOWN_REPLY = """Here is a table:

| Model | Params | Speed |
|-------|-------:|-------|
| tiny  | 0.5B   | fast  |
| big   | 70B    | slow  |

- [x] a table
- [ ] code

And code:

```python
def greet(name):
    return f"hello {name}"  # a greeting
```

Raw <img src=x onerror="window.__pwned=1"> and <script>window.__pwned=2</script>,
[a bad link](javascript:window.__pwned=3) and [a good one](https://example.com/).
"""

WIDE_REPLY = (
    "| "
    + " | ".join(f"column {i}" for i in range(12))
    + " |\n|"
    + "---|" * 12
    + "\n| "
    + " | ".join("x" * 12)
    + " |\n\n"
    "```js\nconst aVeryLongLine = [" + ", ".join(str(i) for i in range(60)) + "];\n```\n"
    "and a long word: " + "a" * 120 + "\n"
)


# -- a phone-sized window -------------------------------------------------------

LAYOUT = """
const vw = document.documentElement.clientWidth;
const header = document.querySelector(".topbar").getBoundingClientRect();
const sw = document.querySelector("#model-switch").getBoundingClientRect();
const hit = document.elementFromPoint(sw.left + sw.width / 2, sw.top + sw.height / 2);
const wide = [...document.querySelectorAll("body *")].filter((el) => {
  const r = el.getBoundingClientRect();
  return r.width > 0 && r.right > vw + 0.5 && !el.closest(".table-wrap, pre");
}).slice(0, 5).map((el) => el.tagName + "." + el.className + " right=" + el.getBoundingClientRect().right);
return {vw, scroll: Math.max(document.documentElement.scrollWidth, document.body.scrollWidth),
        header: header.height, switch: [sw.left, sw.top, sw.right, sw.bottom], switchHit: hit === document.querySelector("#model-switch"),
        wide};
"""


BUSY_LANES = """
const mon = window.IgnisPlayground.monitor;
mon.poll = async () => {};
const data = JSON.parse(JSON.stringify(mon.last));
data.lanes = [
  {state: "decoding", class: "interactive", output_tokens: 1234, max_tokens: 4096},
  {state: "prefilling", class: "batch", output_tokens: 0, max_tokens: 32768},
];
// and speculation at work with both drafters (the Speculation line at its longest)
data.metrics['ignis_spec_drafted_tokens_total{drafter="prompt_lookup"}'] = 300;
data.metrics['ignis_spec_accepted_tokens_total{drafter="prompt_lookup"}'] = 120;
data.metrics['ignis_spec_drafted_tokens_total{drafter="prediction"}'] = 123456;
data.metrics['ignis_spec_accepted_tokens_total{drafter="prediction"}'] = 120000;
mon.render(data, data.metrics);
"""


def layout(driver) -> dict:
    return driver.execute_script(LAYOUT)


def assert_fits(driver, where: str) -> dict:
    got = layout(driver)
    assert got["vw"] == 375, got
    assert got["scroll"] <= got["vw"], f"{where}: the page scrolls sideways: {got}"
    assert got["wide"] == [], f"{where}: elements past the right edge: {got['wide']}"
    return got


def test_a_375px_window_fits(page, live_server_url):
    with viewport(page, 375, 812):
        page.get(live_server_url + "/ui/")
        wait_for(lambda: "serving" in css(page, "#model-status").text, 30, 0.1, "the model pill says serving")
        got = assert_fits(page, "chat")
        assert got["header"] <= 110, f"the header is {got['header']} px tall at 375 px"
        left, top, right, bottom = got["switch"]
        assert left >= 0 and right <= 375 and top >= 0 and bottom <= got["header"], f"Switch is clipped: {got}"
        assert got["switchHit"], "the Switch button is covered by something"
        assert css(page, "#model-target").size["width"] >= 60
        assert css(page, "#api-key").is_displayed()
        shot(page, "10-375-chat")
        # A switch refusal under the switcher wraps inside the header, within the width.
        css(page, "#model-target").send_keys("no-such-model")
        css(page, "#model-switch").click()
        wait_for(lambda: css(page, "#model-switch-result").text.startswith("HTTP 4"), 30, 0.1, "the switch refusal")
        assert_fits(page, "chat with a switch error")
        shot(page, "11-375-switch-error")
        # Wide replies scroll inside their table or code block, not the page.
        stub(page, WIDE_REPLY)
        conv = css(page, ".conv")
        wait_replied(page, conv, say(page, conv, "Show me something wide."))
        assert css_all(page, ".msg.assistant .table-wrap table", conv) and css_all(page, ".msg.assistant pre", conv)
        assert_fits(page, "chat with a wide reply")
        shot(page, "12-375-wide-reply")
        css(page, "#tab-btn-monitor").click()
        wait_for(lambda: css_all(page, ".lane"), 10, 0.1, "the lane rows")
        assert_fits(page, "monitor")
        # Busy lanes have the most to show: the last status with two lanes at work, polling held.
        page.execute_script(BUSY_LANES)
        assert len(css_all(page, ".lane.busy")) == 2
        spec = css(page, "#monitor-spec").text
        assert "prompt_lookup 120/300 kept (40%)" in spec and "prediction 120000/123456 kept (97%)" in spec, spec
        assert_fits(page, "monitor with busy lanes")
        shot(page, "13-375-monitor")
        css(page, "#tab-btn-decide").click()
        assert_fits(page, "decide")
        shot(page, "14-375-decide")


# -- markdown -------------------------------------------------------------------


def test_markdown_tables_and_highlighted_code_with_copy(page, live_server_url):
    stub(page, MARKDOWN_REPLY)
    conv = css(page, ".conv")
    wait_replied(page, conv, say(page, conv, "Show me a table and some code."))
    content = css(page, ".msg.assistant .content", conv)
    assert [th.text for th in css_all(page, "table thead th", content)] == ["Model", "Params", "Speed"]
    rows = css_all(page, "table tbody tr", content)
    assert [[td.text for td in css_all(page, "td", r)] for r in rows] == [
        ["tiny", "0.5B", "fast"],
        ["big", "70B", "slow"],
    ]
    assert [li.text for li in css_all(page, "ul li", content)] == ["\u2611 a table", "\u2610 code"]
    code = css(page, "pre code.hljs.language-python", content)
    assert "def" in [k.text for k in css_all(page, ".hljs-keyword", code)]
    assert css_all(page, ".hljs-string", code) and css_all(page, ".hljs-comment", code)
    assert css(page, ".code-lang", content).text == "python"
    # Model output is not markup: the raw HTML is shown as text and nothing ran.
    assert not css_all(page, "img, script, iframe", content)
    assert '<img src=x onerror="window.__pwned=1">' in content.text
    assert "<script>window.__pwned=2</script>" in content.text
    links = css_all(page, "a", content)
    assert [a.get_attribute("href") for a in links if a.text == "a good one"] == ["https://example.com/"]
    assert all(not (a.get_attribute("href") or "").startswith("javascript:") for a in links)
    assert css(page, "a[href='https://example.com/']", content).get_attribute("rel") == "noopener noreferrer"
    assert page.execute_script("return window.__pwned") is None
    # Copy puts the code, exactly, on the clipboard.
    page.execute_cdp_cmd(
        "Browser.setPermission",
        {"permission": {"name": "clipboard-read"}, "setting": "granted", "origin": live_server_url},
    )
    page.execute_cdp_cmd(
        "Browser.setPermission",
        {"permission": {"name": "clipboard-write"}, "setting": "granted", "origin": live_server_url},
    )
    css(page, ".copy-code", content).click()
    wait_for(lambda: css(page, ".copy-code", content).text == "Copied", 5, 0.05, "the Copy button to say Copied")
    copied = page.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "navigator.clipboard.readText().then(done, (e) => done('error: ' + e));"
    )
    assert copied == 'def greet(name):\n    return f"hello {name}"  # a greeting', copied
    shot(page, "15-markdown-table-code")
    assert severe_console_errors(page) == []


# -- conversations across reloads, failed turns -----------------------------------


def test_a_failed_turn_is_not_resent(page):
    stub(page, "Hello there.")
    conv = css(page, ".conv")
    wait_replied(page, conv, say(page, conv, "first"))
    page.execute_script("window.__chat = 'fail'")
    done = say(page, conv, "this one fails")
    wait_replied(page, conv, done)
    failed = css_all(page, ".msg.assistant", conv)[-1]
    assert "HTTP 503: the engine is unavailable" in css(page, ".error", failed).text
    assert "failed" in failed.get_attribute("class")
    assert "failed" in css_all(page, ".msg.user", conv)[-1].get_attribute("class")
    assert "does not resend it" in css(page, ".failed-note", failed).text
    shot(page, "16-failed-turn")
    # The next message goes to the real server without the failed turn.
    sampling(page, conv, 8)
    wait_replied(page, conv, say(page, conv, "third"))
    sent = bodies(page)
    assert len(sent) == 3
    assert sent[1]["messages"] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "this one fails"},
    ]
    assert sent[2]["messages"] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "third"},
    ]
    last = css_all(page, ".msg.assistant", conv)[-1]
    assert css(page, ".content", last).text.strip() and not css_all(page, ".error", last)
    shot(page, "17-after-failed-turn")


def test_a_stream_error_or_an_early_stop_is_not_resent(page):
    stub(page, "error:Half a rep")
    conv = css(page, ".conv")
    wait_replied(page, conv, say(page, conv, "one"))
    broken = css_all(page, ".msg.assistant", conv)[-1]
    assert css(page, ".content", broken).text == "Half a rep"
    assert css(page, ".error", broken).text == "the engine stopped"
    assert "failed" in broken.get_attribute("class")
    # Stop before any token: nothing to keep, the turn is left out too.
    page.execute_script("window.__chat = 'hold'")
    done = say(page, conv, "two")
    wait_for(lambda: css(page, ".stop", conv).is_displayed(), 5, 0.05, "the Stop button")
    css(page, ".stop", conv).click()
    wait_replied(page, conv, done)
    stopped = css_all(page, ".msg.assistant", conv)[-1]
    assert "failed" in stopped.get_attribute("class") and "stopped" in css(page, ".timings", stopped).text
    # Stop after some tokens keeps the partial reply.
    page.execute_script("window.__chat = arguments[0]", "slow:" + "word " * 100)
    done = say(page, conv, "three")
    wait_for(lambda: css(page, ".msg.assistant.streaming .content", conv).text.strip(), 10, 0.02, "tokens")
    css(page, ".stop", conv).click()
    wait_replied(page, conv, done)
    kept = css_all(page, ".msg.assistant", conv)[-1]
    assert "failed" not in kept.get_attribute("class") and "stopped" in css(page, ".timings", kept).text
    page.execute_script("window.__chat = 'Fine.'")
    wait_replied(page, conv, say(page, conv, "four"))
    sent = bodies(page)[-1]["messages"]
    assert [m["content"] for m in sent if m["role"] == "user"] == ["three", "four"]
    assert sent[1]["role"] == "assistant" and sent[1]["content"].startswith("word ")
    shot(page, "22-stream-error-and-stops")


def test_conversations_survive_a_reload(page, live_server_url):
    conv = css(page, ".conv")
    sampling(page, conv, 8)
    wait_replied(page, conv, say(page, conv, "Say hello."))  # the real model
    real_reply = css(page, ".msg.assistant .content", conv).text
    assert real_reply.strip()
    css(page, "#add-conv").click()
    second = css_all(page, ".conv")[1]
    css(page, ".conv-settings summary", second).click()
    set_field(page, second, ".system", "You answer in tables.")
    stub(page, MARKDOWN_REPLY)
    wait_replied(page, second, say(page, second, "A table, please."))
    page.execute_script("window.__chat = 'fail'")
    wait_replied(page, second, say(page, second, "This one fails."))
    css(page, ".input", second).send_keys("an unsent draft")
    before = [[m.text for m in css_all(page, ".msg", c)] for c in css_all(page, ".conv")]
    shot(page, "18-before-reload")

    page.get(live_server_url + "/ui/")
    wait_for(lambda: len(css_all(page, ".conv")) == 2, 10, 0.1, "both conversations back")
    convs = css_all(page, ".conv")
    assert [[m.text for m in css_all(page, ".msg", c)] for c in convs] == before
    first, second = convs
    assert css(page, ".max_tokens", first).get_attribute("value") == "8"
    assert " token" in css(page, ".msg.assistant .timings", first).text
    assert css(page, ".system", second).get_attribute("value") == "You answer in tables."
    assert css(page, ".input", second).get_attribute("value") == "an unsent draft"
    assert css_all(page, ".msg.assistant table", second) and css_all(page, ".msg.assistant .hljs-keyword", second)
    assert "failed" in css_all(page, ".msg.assistant", second)[-1].get_attribute("class")
    shot(page, "19-after-reload")
    # The restored history is what the next request sends, the failed turn still left out.
    stub(page, "Noted.")
    css(page, ".input", second).clear()
    wait_replied(page, second, say(page, second, "And now?"))
    assert bodies(page)[-1]["messages"] == [
        {"role": "system", "content": "You answer in tables."},
        {"role": "user", "content": "A table, please."},
        {"role": "assistant", "content": MARKDOWN_REPLY},
        {"role": "user", "content": "And now?"},
    ]
    # Clear and close are kept too.
    css(page, ".conv-close", second).click()
    css(page, ".conv-clear", first).click()
    page.get(live_server_url + "/ui/")
    wait_for(lambda: len(css_all(page, ".conv")) == 1, 10, 0.1, "one conversation")
    assert css_all(page, ".msg") == []


# -- the model loading --------------------------------------------------------------

LOADING = {
    "object": "list",
    "data": [
        {
            "id": "test-model",
            "object": "model",
            "created": 0,
            "owned_by": "ignis",
            "status": "loading",
            "load_progress": {"done": 3, "total": 10, "unit": "tensors"},
        }
    ],
    "switching": None,
}


def test_loading_model_notice(page):
    stub(page, "hold")
    conv = css(page, ".conv")
    notice = css(page, ".model-notice", conv)
    assert not notice.is_displayed()
    page.execute_script("window.__models = arguments[0]; return window.IgnisPlayground.pollModels()", LOADING)
    wait_for(notice.is_displayed, 5, 0.05, "the loading notice")
    assert notice.text == "Loading model test-model 30%…"
    assert "loading" in css(page, "#model-status").text
    # A message sent now says it waits for the load, until the first token comes.
    say(page, conv, "Are you there?")
    waiting = css(page, ".msg.assistant .waiting", conv)
    wait_for(waiting.is_displayed, 5, 0.05, "the waiting note in the reply")
    assert waiting.text.startswith("Loading model test-model 30%…")
    shot(page, "20-loading-model")
    page.execute_script("window.__models = null; return window.IgnisPlayground.pollModels()")
    wait_for(lambda: not notice.is_displayed(), 10, 0.05, "the notice to go once the model serves")
    page.execute_script("window.__release()")
    wait_replied(page, conv, 1)
    assert css(page, ".msg.assistant .content", conv).text == "Ready."
    assert not waiting.is_displayed()
    shot(page, "21-loaded")


# -- images -----------------------------------------------------------------------


# A 3x2 PNG (red, green, blue / white, black, grey), written by the test.
def small_png(path: Path) -> bytes:
    import struct
    import zlib

    rows = [(255, 0, 0, 0, 255, 0, 0, 0, 255), (255, 255, 255, 0, 0, 0, 128, 128, 128)]
    raw = b"".join(b"\0" + bytes(r) for r in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 3, 2, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    path.write_bytes(png)
    return png


DROP_IMAGE = """
const [conv, b64] = arguments;
const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
const dt = new DataTransfer();
dt.items.add(new File([bytes], "dropped.png", { type: "image/png" }));
conv.dispatchEvent(new DragEvent("dragover", { dataTransfer: dt, bubbles: true, cancelable: true }));
conv.dispatchEvent(new DragEvent("drop", { dataTransfer: dt, bubbles: true, cancelable: true }));
"""


def test_an_attached_image_is_shown_and_sent(page, tmp_path):
    import base64

    png = small_png(tmp_path / "square.png")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    stub(page, "A small grid of colours.")
    conv = css(page, ".conv")
    css(page, ".file", conv).send_keys(str(tmp_path / "square.png"))  # the Image button's file picker
    wait_for(lambda: css_all(page, ".attachments .thumb", conv), 10, 0.05, "the attachment's thumbnail")
    assert css(page, ".attachments", conv).is_displayed()
    done = say(page, conv, "What is in this picture?")
    wait_replied(page, conv, done)
    sent = bodies(page)[-1]["messages"]
    assert sent == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in this picture?"},
            ],
        }
    ]
    bubble = css_all(page, ".msg.user", conv)[-1]
    shown = css(page, ".msg-images img.thumb", bubble)
    assert shown.get_attribute("src") == url and "What is in this picture?" in bubble.text
    assert page.execute_script("return arguments[0].complete && arguments[0].naturalWidth", shown) == 3
    assert not css(page, ".attachments", conv).is_displayed()  # sent: the composer is empty again
    shot(page, "22-image-sent")
    # Dropped on the conversation, an image alone (no text) is a message too; the history resends the first.
    page.execute_script(DROP_IMAGE, conv, base64.b64encode(png).decode())
    wait_for(lambda: css_all(page, ".attachments .thumb", conv), 10, 0.05, "the dropped image's thumbnail")
    done = len(css_all(page, ".msg.assistant.done", conv)) + 1
    css(page, ".send", conv).click()
    wait_replied(page, conv, done)
    sent = bodies(page)[-1]["messages"]
    assert sent[0]["content"][0] == {"type": "image_url", "image_url": {"url": url}}
    assert sent[-1] == {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
    assert len(css_all(page, ".msg.user .msg-images img", conv)) == 2
    assert severe_console_errors(page) == []
    # The text-only default model refuses an image with a clear 400, shown on the turn.
    page.execute_script("window.__chat = 'pass'")
    css(page, ".file", conv).send_keys(str(tmp_path / "square.png"))
    wait_for(lambda: css_all(page, ".attachments .thumb", conv), 10, 0.05, "the attachment's thumbnail")
    wait_replied(page, conv, say(page, conv, "And this?"))
    failed = css_all(page, ".msg.assistant", conv)[-1]
    assert "HTTP 400" in css(page, ".error", failed).text and "reads text only" in css(page, ".error", failed).text
    shot(page, "23-image-refused")
