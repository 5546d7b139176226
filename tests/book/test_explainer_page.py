"""The two-phase explainer: its JavaScript agrees with labsupport.serving, on the built book page
and over a sweep of settings, and the ipywidgets version builds and updates without a browser.

The browser tests (marked ``book``) drive the system Chromium through the fixtures in conftest.py.
Screenshots go to _build/screenshots/ for a person to look at."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from labsupport import costs, explainer, serving
from labsupport.hardware import GPUS
from labsupport.models import get_model
from labsupport.serving import Conventions

ROOT = Path(__file__).resolve().parents[2]
PAGE = "book/05_explainer"
WIDGET = "#c05x-explainer"
SCREENSHOTS = ROOT / "_build" / "screenshots"

# --- helpers for the browser tests ---------------------------------------------------------------

READ = "root => Object.fromEntries(Array.from(root.querySelectorAll('[data-out]')).map(e => [e.dataset.out, e.textContent]))"
SET = """(root, settings) => {
  for (const [key, value] of Object.entries(settings)) {
    const el = root.querySelector('[data-control="' + key + '"]');
    if (el.type === 'range') {
      const values = {prompt: DATA_PROMPTS, output: DATA_OUTPUTS, batch: DATA_BATCHES}[key];
      el.value = String(values.indexOf(value));
      el.dispatchEvent(new Event('input', {bubbles: true}));
    } else {
      el.value = String(value);
      el.dispatchEvent(new Event('change', {bubbles: true}));
    }
  }
}"""
SET = (
    SET.replace("DATA_PROMPTS", json.dumps(explainer.PROMPTS))
    .replace("DATA_OUTPUTS", json.dumps(explainer.OUTPUTS))
    .replace("DATA_BATCHES", json.dumps(explainer.BATCHES))
)


def shown(page) -> dict[str, str]:
    """Every ``data-out`` text the widget displays, by key."""
    return page.locator(WIDGET).evaluate(READ)


def expected(**settings) -> dict[str, str]:
    """What Python says the widget should display for these control settings."""
    conv = {k: settings.pop(k) for k in list(settings) if k in Conventions.choices()}
    keys = {"prompt": "prompt_tokens", "output": "output_tokens"}
    kwargs = {keys.get(k, k): v for k, v in settings.items()}
    return explainer.compute(**kwargs, conventions=Conventions(**conv))[1]


def in_toc(source: str) -> bool:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return f"file: {source}" in yaml.safe_dump(toc)


# --- the built book page -------------------------------------------------------------------------


@pytest.mark.book
def test_built_page_matches_python_and_follows_the_sliders(page, book_url):
    if not in_toc(PAGE):
        pytest.skip(f"{PAGE} is not listed in _toc.yml yet, so the book does not build it")
    built = ROOT / "_build" / "html" / f"{PAGE}.html"
    assert built.exists(), f"{PAGE} is in the table of contents but not built: run `make book`"
    # The book ships no favicon.ico; Chromium asks for one after the load event, and the 404 would
    # reach page.js_errors as a console error that has nothing to do with the page's JavaScript.
    page.route("**/favicon.ico", lambda route: route.fulfill(status=204, body=""))
    page.set_viewport_size({"width": 1280, "height": 1400})  # the whole widget fits its screenshot
    response = page.goto(f"{book_url}/{PAGE}.html", wait_until="load")
    assert response is not None and response.ok
    page.wait_for_selector(f"{WIDGET}[data-ready='1']", timeout=10_000)

    # The source's setting, exactly as Python formats it, each kernel on its own roofline.
    default = shown(page)
    assert default == expected(), "the page's numbers differ from labsupport.serving's"
    assert default["ttft"] == "116.0 ms" and default["itl"] == "22.6 ms"
    assert default["latency"] == "3.00 s" and default["throughput"] == "44 tok/s"
    assert default["prefill-split"] == "prefill = weight matmuls 114.9 ms (compute-bound) + attention 1.1 ms (compute-bound)"
    # just under the GQA group size: the new token's queries and output add to the cache read
    assert default["decode-attention-point"] == "7.9 FLOP/B, 4.0% of peak"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator(WIDGET).screenshot(path=str(SCREENSHOTS / "05_explainer_widget.png"))

    # Move the batch slider six steps right (1 -> 64 requests) as a reader would, with the keyboard.
    batch = page.locator(f"{WIDGET} [data-control='batch']")
    batch.focus()
    for _ in range(6):
        page.keyboard.press("ArrowRight")
    assert batch.input_value() == "6"
    after = shown(page)
    assert after == expected(batch=64)
    assert after["throughput"] != default["throughput"] and after["itl"] != default["itl"]

    # Then the prompt slider one step left (1K -> 512 tokens).
    prompt = page.locator(f"{WIDGET} [data-control='prompt']")
    prompt.focus()
    page.keyboard.press("ArrowLeft")
    assert shown(page) == expected(batch=64, prompt=512)
    assert page.locator(f"{WIDGET} output[data-for='prompt']").inner_text() == "512 tokens"

    # Past the ridge batch the decode matmuls turn compute-bound while attention stays memory-bound.
    for _ in range(2):
        batch.focus()
        page.keyboard.press("ArrowRight")
    past = shown(page)
    assert past == expected(batch=256, prompt=512)
    assert past["itl-note"] == "one decode step: matmuls compute-bound, attention memory-bound"

    # And a select in the conventions panel: the source's single merged point per phase.
    page.locator(f"{WIDGET} details summary").click()
    page.locator(f"{WIDGET} [data-control='roofline']").select_option("merged")
    merged = shown(page)
    assert merged == expected(batch=256, prompt=512, roofline="merged")
    assert "decode-split" not in merged and "decode-attention-point" not in merged
    assert merged["itl-note"] == "one decode step, memory-bound"  # the merged point hides the matmuls' bound

    page.locator(WIDGET).screenshot(path=str(SCREENSHOTS / "05_explainer_widget_moved.png"))
    page.screenshot(path=str(SCREENSHOTS / "05_explainer.png"), full_page=True)
    assert not page.js_errors, f"JavaScript errors: {page.js_errors}"


# --- the snippet alone, over many settings ---------------------------------------------------------

SWEEP = [
    {},
    {"batch": 1024},
    {"prompt": 64, "output": 1},
    {"prompt": 131072, "batch": 8},
    {"output": 8192, "batch": 256},
    {"model": "llama-3.1-8b", "card": "H100 SXM", "count": 1},
    {"model": "llama-3.1-8b", "card": "H200", "count": 8, "batch": 1024, "prompt": 64},
    {"model": "llama-3.1-405b", "card": "A100 80GB", "count": 8, "prompt": 4096},
    {"model": "llama-3.1-405b", "card": "T4", "count": 1},  # the weights do not fit
    {"card": "L4", "count": 2, "prompt": 32768, "output": 512},
    {"roofline": "merged"},
    {"roofline": "merged", "attention": "none"},
    {"attention": "none"},
    {"attention": "none", "batch": 512},
    {"roofline": "merged", "batch": 1024, "prompt": 4096},
    {"params": "counted"},
    {"decode_context": "start"},
    {"decode_context": "end", "output": 4096},
    {"decode_steps": "output-1", "output": 1},
    {"decode_steps": "output-1", "throughput": "request"},
    {"throughput": "request", "batch": 32},
    {"attention": "causal", "prompt": 32768},
    {"attention": "full", "prompt": 131072, "batch": 4, "output": 2048},
    {
        "params": "counted",
        "roofline": "merged",
        "attention": "causal",
        "decode_context": "end",
        "batch": 16,
    },
]


@pytest.mark.book
def test_javascript_agrees_with_python_over_a_sweep(page):
    """The snippet on a blank page (no book needed): every control setting in SWEEP shows Python's strings."""
    page.set_content(f"<html><body>{explainer.static_html(element_id='c05x-explainer')}</body></html>")
    page.wait_for_selector(f"{WIDGET}[data-ready='1']")
    root = page.locator(WIDGET)
    for settings in SWEEP:
        full = {
            "prompt": 1024,
            "output": 128,
            "batch": 1,
            "model": "llama-3.1-70b",
            "card": "A100 40GB",
            "count": 4,
            **{k: getattr(serving.DEFAULT, k) for k in Conventions.choices()},
        }
        full.update(settings)
        root.evaluate(SET, full)
        assert shown(page) == expected(**full), f"JavaScript and Python disagree at {settings}"
    assert not page.js_errors, f"JavaScript errors: {page.js_errors}"


# --- the snippet, without a browser ----------------------------------------------------------------


def test_static_snippet_is_self_contained():
    snippet = explainer.static_html(element_id="c05x-test")
    assert "http" not in snippet and "<script src" not in snippet and "<link" not in snippet
    assert snippet.count("<script>") == 1 and 'id="c05x-test"' in snippet
    # The starting numbers are in the HTML itself, before any script runs.
    for text in ("116.0 ms", "22.6 ms", "3.00 s", "44 tok/s"):
        assert text in snippet


def test_script_and_styles_are_package_files_inlined():
    from importlib import resources

    static = resources.files("labsupport").joinpath("explainer_static")
    js, css = (static.joinpath(name).read_text() for name in ("explainer.js", "explainer.css"))
    assert "function labsupportExplainer(root)" in js and ".c05x-explainer" in css
    snippet = explainer.static_html(element_id="c05x-test")
    assert js in snippet and css in snippet
    assert not hasattr(explainer, "_JS") and not hasattr(explainer, "_CSS")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "explainer_static/*.js" in pyproject and "explainer_static/*.css" in pyproject


def test_embedded_tables_come_from_labsupport():
    snippet = explainer.static_html()
    block = re.search(r'<script type="application/json" data-xp="data">(.*?)</script>', snippet).group(1)
    data = json.loads(block)
    assert data == json.loads(json.dumps(explainer.explainer_data()))
    assert set(data["cards"]) == set(GPUS)
    for name, gpu in GPUS.items():
        assert data["cards"][name]["peak_flops"] == gpu.peak_flops
        assert data["cards"][name]["bandwidth"] == gpu.hbm_bandwidth
    m = data["models"]["llama-3.1-70b"]
    cfg = get_model("llama-3.1-70b")
    assert m["counted_params"] == costs.param_count(cfg) and m["nominal_params"] == 70e9
    assert m["kv_values_per_token"] * 2 == costs.kv_bytes_per_token(cfg)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"prompt_tokens": 1000}, "prompt_tokens"),
        ({"batch": 3}, "batch"),
        ({"count": 3}, "count"),
        ({"card": "B200"}, "card"),
        ({"model": "tiny-2m"}, "model"),
        ({"batch": 1000}, "batch"),
        ({"conventions": "source"}, "conventions"),
        ({"conventions": Conventions(weight_bytes=1)}, "weight_bytes"),
        ({"element_id": "a b<"}, "element_id"),
    ],
)
def test_static_snippet_checks_its_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        explainer.static_html(**kwargs)


def test_formatting_rounds_like_javascript():
    # toFixed rounds an exact tie away from zero; Python's format() would give '0.2' and '42'
    assert explainer._fixed(0.25, 1) == "0.3"
    assert explainer.format_rate(42.5) == "43 tok/s"
    assert explainer.format_seconds(0.1148717) == "114.9 ms"
    assert explainer.format_seconds(3.1091) == "3.11 s"
    assert explainer.format_seconds(600) == "10.0 min"
    assert explainer.format_intensity(303560.2) == "303,560 FLOP/B"
    assert explainer.format_rate_si(1.248e15, "FLOP/s") == "1.25 PFLOP/s"
    assert explainer.format_rate_si(6e12, "B/s") == "6 TB/s"
    assert explainer.token_label(1024) == "1K" and explainer.token_label(512) == "512"


# --- the live ipywidgets version ---------------------------------------------------------------------


def test_live_widget_builds_and_updates():
    app = explainer.LiveExplainer()
    assert app.values == expected()
    assert "116.0 ms" in app.metrics.value and "44 tok/s" in app.metrics.value
    assert app.values["decode-split"] in app.metrics.value
    assert app.figure.value[:8] == b"\x89PNG\r\n\x1a\n"
    first_png = app.figure.value

    app.batch.value = 64  # a control change updates by itself
    assert app.values == expected(batch=64)
    assert app.report.batch == 64 and app.figure.value != first_png

    app.prompt.value = 4096
    app.conventions["roofline"].value = "merged"
    app.conventions["decode_steps"].value = "output-1"
    report = app.update()  # and update() can be called directly
    assert report == serving.phases(
        "llama-3.1-70b",
        serving.serving_gpu(),
        4096,
        128,
        64,
        Conventions(roofline="merged", decode_steps="output-1"),
    )
    assert app.values == expected(batch=64, prompt=4096, roofline="merged", decode_steps="output-1")
    assert app.values["latency"] in app.metrics.value


def test_show_displays_the_widget(capsys):
    explainer.show(model="llama-3.1-8b", card="H100 SXM", count=1)
    assert "VBox" in capsys.readouterr().out


def test_a_setting_that_cannot_run_shows_none_not_a_time():
    """As the planner does: no latency or throughput for weights or a cache that do not fit."""
    _, weights = explainer.compute(model="llama-3.1-405b", card="T4", count=1)
    assert weights["ttft"] == weights["throughput"] == "none" and weights["ttft-note"] == "the weights do not fit"
    report, cache = explainer.compute(model="llama-3.1-8b", card="L4", count=1, prompt_tokens=131072, batch=256)
    assert not report.fits and cache["itl"] != "none" and "does not fit" in cache["memory"]  # it says so there
    _, fits = explainer.compute()
    assert fits["ttft"] != "none" and fits["ttft"].endswith("ms")
