"""The explorer page in a real browser: headless Chromium (Debian's package) driven by Playwright.

It types a prompt, clicks a suggested token, and checks that the prompt grew and that new
suggestions, the surprisal colouring and an attention heatmap appeared; then saves a screenshot.
`make test` installs Chromium (apt-get) when it is missing.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from gptlab.serve.app import create_app
from gptlab.tokenizer import get_tokenizer
from test_serve import NAME, running, serve_model

CHROMIUM = os.environ.get("GPTLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip


def explore(page, url: str, prompt: str, screenshot: str | None = None) -> dict:
    """Drive the explorer: enter `prompt`, click the top suggestion; returns what the page showed."""
    page.goto(url)
    page.wait_for_selector(".candidate")
    page.fill("#prompt", prompt)
    page.click("#go")
    n = len(prompt.encode())  # byte-level model in the tests; the page reports the count it used
    page.wait_for_function("n => document.querySelectorAll('#tokens span').length === n", arg=n)
    candidates = "els => els.map(e => [e.dataset.text, e.title])"  # the title holds the probability
    before = page.eval_on_selector_all(".candidate", candidates)
    chosen = before[0][0]
    page.click(".candidate >> nth=0")
    page.wait_for_function("p => document.querySelector('#prompt').value === p", arg=prompt + chosen)
    page.wait_for_function(
        "n => document.querySelectorAll('#tokens span').length > n && document.querySelector('#heatmap').dataset.tokens > n",
        arg=n,
    )
    page.wait_for_function("document.querySelectorAll('.candidate').length === 10")
    # settled: no refresh in flight (a later one, from the prompt's own input event, shows "…")
    page.wait_for_function("document.querySelector('#status').textContent.endsWith('tokens')")
    shown = dict(
        chosen=chosen,
        prompt=page.input_value("#prompt"),
        before=before,
        after=page.eval_on_selector_all(".candidate", candidates),
        tokens=page.eval_on_selector_all("#tokens span", "els => els.map(e => e.textContent)"),
        heatmap_tokens=int(page.get_attribute("#heatmap", "data-tokens")),
        heatmap_inked=page.evaluate(
            """() => { const c = document.querySelector('#heatmap');
                       const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                       let blue = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 2] > d[i] + 40) blue++;
                       return blue; }"""
        ),
        history=page.eval_on_selector_all("#history li", "els => els.length"),
        status=page.text_content("#status"),
    )
    if screenshot:
        page.screenshot(path=screenshot, full_page=True)
    return shown


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        apt = shutil.which("apt-get")
        pytest.skip(
            f"Chromium is not installed at {CHROMIUM} and could not be installed"
            + (
                " (run `make browser` as root: apt-get install chromium chromium-driver)"
                if apt
                else " (no apt-get here)"
            )
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def test_explorer_in_chromium(browser, tmp_path):
    torch.set_num_threads(1)
    app = create_app(serve_model(), get_tokenizer("byte"), name=NAME)
    with running(app) as url:
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
        outside, predictions = [], []
        page.on("request", lambda r: None if r.url.startswith(url) else outside.append(r.url))
        page.on("request", lambda r: predictions.append(r.url) if r.url.endswith("/api/next") else None)
        shot = tmp_path / "explorer.png"
        shown = explore(page, url, "Hello wor", screenshot=str(shot))
        page.wait_for_timeout(400)  # past the typing pause (300 ms) that fill's input event started
    assert shown["prompt"] == "Hello wor" + shown["chosen"]
    # one refresh each for the page's example, Go and the chosen token: Go's supersedes the one
    # typing scheduled (which, left pending, refreshed again later and showed "…" mid-test)
    assert len(predictions) == 3, predictions
    assert len(shown["tokens"]) == len(shown["prompt"].encode())
    assert len(shown["after"]) == 10 and shown["after"] != shown["before"]
    assert shown["heatmap_tokens"] == len(shown["tokens"]) and shown["heatmap_inked"] > 100
    assert shown["history"] == 3  # the page's example prompt, the typed one, the chosen token
    assert shown["status"].endswith("tokens")
    assert errors == [] and outside == [], (errors, outside)
    assert shot.stat().st_size > 10_000


def test_logit_lens_and_patching_panels_in_chromium(browser, tmp_path):
    """The lens table shows the API's top tokens; the patching grid appears, and a click on a
    cell lists that cell's patched next tokens as the API gives them."""
    import httpx

    torch.set_num_threads(1)
    model = serve_model()
    app = create_app(model, get_tokenizer("byte"), name=NAME)
    clean, corrupt = "Hello world", "Hello worle"
    with running(app) as url:
        page = browser.new_page(viewport={"width": 1100, "height": 1400})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        page.wait_for_selector(".candidate")
        page.fill("#prompt", clean)
        page.click("#go")
        rows = model.config.n_layer + 2  # a header row, the embeddings, each block
        page.wait_for_function("([r, n]) => document.querySelectorAll('#lens tr').length === r && "
                               "document.querySelectorAll('#lens tr:last-child td').length === n", arg=[rows, len(clean)])  # fmt: skip
        shown = page.eval_on_selector_all("#lens tr:last-child td", "els => els.map(e => e.dataset.prob)")
        lens = httpx.post(f"{url}/api/lens", json={"prompt": clean}).json()
        assert [float(p) for p in shown] == pytest.approx([pos[0]["prob"] for pos in lens["top"][-1]], abs=1e-6)
        page.fill("#corrupt", corrupt)
        page.fill("#right", "d")
        page.fill("#wrong", "e")
        page.click("#patch-go")
        page.wait_for_function("n => document.querySelector('#patchmap').dataset.cols === String(n)", arg=len(clean))
        size = page.evaluate("""() => { const c = document.querySelector('#patchmap');
            return [c.width / c.getBoundingClientRect().width, +c.dataset.left, +c.dataset.top, +c.dataset.cell]; }""")
        scale, left, top, cell = size
        layer, unit = 1, 10  # the position that differs, after block 0
        page.click(
            "#patchmap", position={"x": (left + (unit + 0.5) * cell) / scale, "y": (top + (layer + 0.5) * cell) / scale}
        )
        page.wait_for_function("document.querySelectorAll('#patch-cell .candidate').length === 10")
        assert page.get_attribute("#patchmap", "data-selected") == f"{layer},{unit}"
        listed = page.eval_on_selector_all("#patch-cell .candidate", "els => els.map(e => e.dataset.text)")
        body = {"clean": clean, "corrupt": corrupt, "right": "d", "wrong": "e", "layer": layer, "unit": unit, "top": 10}
        expected = httpx.post(f"{url}/api/patch/cell", json=body).json()["patched"]
        page.screenshot(path=str(tmp_path / "panels.png"), full_page=True)
        # a cell opens with the request that drew the grid, whatever the form holds now: it
        # was read with the current prompts and axes, under the old grid's title and value
        page.fill("#corrupt", "Hello")
        page.select_option("#over", "layer-head")
        page.focus("#patchmap")
        with page.expect_request("**/api/patch/cell") as opened:
            page.keyboard.press("Enter")  # the keyboard opens the top left cell, then moves
        assert {k: opened.value.post_data_json[k] for k in ("corrupt", "over", "layer", "unit")} == {
            "corrupt": corrupt, "over": "layer-pos", "layer": 0, "unit": 0}  # fmt: skip
        with page.expect_request("**/api/patch/cell") as opened:
            page.keyboard.press("ArrowRight")
        assert (opened.value.post_data_json["layer"], opened.value.post_data_json["unit"]) == (0, 1)
        page.wait_for_function("document.querySelector('#patchmap').dataset.selected === '0,1'")
        title = page.text_content("#patch-cell-title")
        plain = page.eval_on_selector_all("#patch-cell .candidate", "els => els.map(e => e.tagName)")
        # the layers x heads grid's columns read "head 0", not "head⌣0" (spaces made visible as in tokens)
        page.evaluate("""() => { const fill = CanvasRenderingContext2D.prototype.fillText; window.patchText = [];
            CanvasRenderingContext2D.prototype.fillText = function (text, ...rest) {
                if (this.canvas.id === 'patchmap') window.patchText.push(text);
                return fill.call(this, text, ...rest); }; }""")
        page.fill("#corrupt", corrupt)
        page.click("#patch-go")
        page.wait_for_function(
            "n => document.querySelector('#patchmap').dataset.cols === String(n)", arg=model.config.n_head
        )
        heads = page.evaluate("window.patchText.filter(t => t.startsWith('head'))")
    assert heads == [f"head {h}" for h in range(model.config.n_head)], heads
    assert listed == [c["text"] for c in expected]
    assert title.startswith("layer 0, position 1 (") and set(plain) == {"DIV"}  # no buttons that do nothing
    assert errors == [], errors


def _leaning_model(token: int):
    """The serving model with its final norm's bias along `token`'s embedding: `token` is the
    top next token after any prompt."""
    model = serve_model()
    with torch.no_grad():
        row = model.transformer.wte.weight[token]
        model.transformer.ln_f.bias.copy_(50 * row / row.norm())
    return model


def test_a_picked_token_is_continued_by_its_id_in_chromium(browser):
    """Picking a token the page cannot write as text (a byte of a split character, shown as
    U+FFFD) continues from that token: it was the text appended, which re-encoded as other tokens.
    The history's chips are buttons (the keyboard reaches them), and Predict on the same prompt
    again is not a new step."""
    torch.set_num_threads(1)
    lead = 0xC3  # the first byte of a two-byte character
    app = create_app(_leaning_model(lead), get_tokenizer("byte"), name=NAME)
    with running(app) as url:
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        errors, sent = [], []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/api/next") else None)
        page.goto(url)
        page.wait_for_selector(".candidate")
        page.fill("#prompt", "caf")
        page.click("#go")
        spans = "n => document.querySelectorAll('#tokens span').length === n"
        page.wait_for_function(spans, arg=3)
        page.wait_for_function("document.querySelector('#status').textContent === '3 tokens'")
        assert page.get_attribute(".candidate >> nth=0", "data-id") == str(lead)
        for n in (4, 5):
            page.click(".candidate >> nth=0")
            page.wait_for_function(spans, arg=n)
            page.wait_for_function("n => document.querySelector('#status').textContent === `${n} tokens`", arg=n)
        assert sent[-1]["prompt"] == [ord("c"), ord("a"), ord("f"), lead, lead]  # was "caf\ufffd\ufffd": 9 tokens
        assert page.input_value("#prompt") == "caf\ufffd\ufffd"
        assert page.eval_on_selector_all("#tokens span", "els => els.map(e => e.textContent)")[-1] == "\\xc3"
        chips = "document.querySelectorAll('#history li button').length"
        assert page.evaluate(chips) == 4  # the example, "caf", two picked tokens
        page.click("#go")
        page.wait_for_function("document.querySelector('#status').textContent === '5 tokens'")
        assert page.evaluate(chips) == 4
        page.focus("#history li:nth-child(2) button")
        page.keyboard.press("Enter")
        page.wait_for_function(spans, arg=3)
        assert page.input_value("#prompt") == "caf"
        # a pick after an empty prompt continues <|endoftext|>, shown as such; Go on it is no new step
        page.fill("#prompt", "")
        page.click("#go")
        page.wait_for_function("document.querySelector('#status').textContent === '1 tokens'")
        page.click(".candidate >> nth=0")
        page.wait_for_function("document.querySelector('#status').textContent === '2 tokens'")
        assert page.input_value("#prompt") == "<|endoftext|>\ufffd" and sent[-1]["prompt"] == [256, lead]
        steps = page.evaluate(chips)
        page.click("#go")
        page.wait_for_function("document.querySelector('#status').textContent === '2 tokens'")
        assert page.evaluate(chips) == steps  # the step's text was "\ufffd", the box's its decoding
        # an edited prompt's chip ends with its last characters, an emoji whole (was half of one, U+FFFD)
        page.fill("#prompt", "\U0001f44b" + "x" * 15)
        page.click("#go")
        page.wait_for_function("document.querySelector('#status').textContent === '19 tokens'")
        assert page.text_content("#history li:last-child button") == "\u270e \u2026\U0001f44b" + "x" * 15
        # a typed backslash-n is not a newline: labels and chips double a literal backslash
        page.fill("#prompt", "a\\nb\n")
        page.click("#go")
        page.wait_for_function("document.querySelector('#status').textContent === '5 tokens'")
        assert page.text_content("#history li:last-child button") == "\u270e \u2026a\\\\nb\\n"
        assert page.eval_on_selector_all("#tokens span", "els => els.map(e => e.textContent)") == [
            "a", "\\\\", "n", "b", "\\n"]  # fmt: skip
    assert errors == [], errors


def test_attention_shows_the_last_layer_picked_in_chromium(browser):
    """A layer picked while a refresh is in flight stays shown: the refresh's older answer for
    layer 0 came last and drew over it."""
    import json

    torch.set_num_threads(1)
    app = create_app(serve_model(), get_tokenizer("byte"), name=NAME)
    with running(app) as url:
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        page.goto(url)
        page.wait_for_selector(".candidate")
        page.wait_for_function("document.querySelector('#status').textContent.endsWith('tokens')")
        held = []

        def hold_layer_0(route):
            if json.loads(route.request.post_data)["layer"] == 0:
                held.append(route)
            else:
                route.continue_()

        page.route("**/api/attention", hold_layer_0)
        page.fill("#prompt", "Hello")
        page.click("#go")
        page.wait_for_function("document.querySelector('#status').textContent === '\u2026'")
        page.select_option("#layer", "1")
        page.wait_for_function("document.querySelector('#heatmap').dataset.layer === '1'")
        assert len(held) == 1
        held[0].continue_()
        page.wait_for_function("document.querySelector('#status').textContent === '5 tokens'")
        page.wait_for_timeout(200)
        assert page.get_attribute("#heatmap", "data-layer") == "1"  # was '0'
        assert page.get_attribute("#heatmap", "data-tokens") == "5"


STALE = "ids => ids.map(id => getComputedStyle(document.getElementById(id)).opacity)"


def test_every_panel_of_an_earlier_prompt_is_dimmed_in_chromium(browser):
    """A prompt the server refuses leaves the panels showing the previous prompt: all four were
    to be dimmed as the next-token list was (the tokens, attention and lens looked current)."""
    torch.set_num_threads(1)
    panels = ["candidates", "tokens", "heatmap", "lens"]
    app = create_app(serve_model(), get_tokenizer("byte"), name=NAME)
    with running(app) as url:
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        page.wait_for_function("document.querySelector('#status').textContent.endsWith('tokens')")
        assert page.evaluate(STALE, panels) == ["1"] * 4
        page.fill("#prompt", "x" * 600)  # past the context of 512
        page.click("#go")
        page.wait_for_function("document.querySelector('#status').textContent.startsWith('error: ')")
        assert "600 tokens" in page.text_content("#status")
        assert page.evaluate(STALE, panels) == ["0.5"] * 4
        page.fill("#prompt", "Hello")
        page.click("#go")
        page.wait_for_function("document.querySelector('#status').textContent === '5 tokens'")
        assert page.evaluate(STALE, panels) == ["1"] * 4
        # the heatmap of a layer picked before the prompt changed, coming after, is not drawn (it
        # was: the old prompt's, undimmed, under the new prompt's error)
        held = []
        page.route("**/api/attention", lambda route: held.append(route) if not held else route.continue_())
        page.select_option("#layer", "1")
        while not held:
            page.wait_for_timeout(20)
        page.fill("#prompt", "x" * 600)  # the refresh waits for typing to pause (300 ms)
        held[0].continue_()  # meanwhile the old prompt's heatmap comes
        page.wait_for_function("document.querySelector('#status').textContent.startsWith('error: ')")
        assert page.evaluate(STALE, panels) == ["0.5"] * 4 and page.get_attribute("#heatmap", "data-layer") == "0"
        page.unroute("**/api/attention")
        page.fill("#prompt", "Hello")
        page.click("#go")
        page.wait_for_function("document.querySelector('#status').textContent === '5 tokens'")
        # a layer the server cannot draw leaves the heatmap of the one before: dimmed too
        page.route("**/api/attention", lambda route: route.fulfill(status=500, json={"error": {"message": "down"}}))
        page.select_option("#layer", "0")
        page.wait_for_function("document.querySelector('#status').textContent === 'error: down'")
        assert page.evaluate(STALE, panels) == ["1", "1", "0.5", "1"]
    assert errors == [], errors


def test_the_page_says_when_the_server_does_not_answer_and_tries_again_in_chromium(browser):
    """/api/info failing as the page opened was an unhandled rejection: no message, and the
    buttons were never wired, so Predict did nothing even once the server answered."""
    torch.set_num_threads(1)
    model = serve_model()
    app = create_app(model, get_tokenizer("byte"), name=NAME)
    with running(app) as url:
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_default_timeout(10_000)  # the page answers in well under a second; a miss fails soon
        page.route("**/api/info", lambda route: route.abort())
        page.goto(url)
        page.wait_for_function("document.querySelector('#status').textContent.startsWith('error: ')")
        assert "cannot read the model's details from the server" in page.text_content("#status")
        page.unroute("**/api/info")
        # a proxy's HTML error page: its status, not a JSON parse error
        page.route("**/api/info", lambda route: route.fulfill(status=502, body="<html>Bad Gateway</html>"))
        page.click("#go")
        page.wait_for_function("document.querySelector('#status').textContent.includes('(502 ')")
        page.unroute("**/api/info")
        page.fill("#prompt", "Hello")
        page.click("#go")
        page.wait_for_function("document.querySelector('#status').textContent === '5 tokens'")
        assert page.eval_on_selector_all(".candidate", "els => els.length") == 10
        assert page.eval_on_selector_all("#layer option", "els => els.length") == model.config.n_layer
        assert page.text_content("#model-name").startswith(NAME)
    assert errors == [], errors
