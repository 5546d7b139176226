"""The capacity planner's static page: its JavaScript agrees with labsupport.planning, on the built
book page and over a sweep of settings (edge cases included: a TPOT target no batch meets, a KV
cache that does not fit, tensor parallelism, fp8 and int4 weights, no price) and over sixty
settings drawn at random with a fixed seed.

The browser tests (marked ``book``) drive the system Chromium through the fixtures in conftest.py.
Screenshots go to _build/screenshots/ for a person to look at."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from labsupport import planner_widget as pw
from labsupport.hardware import GPUS

ROOT = Path(__file__).resolve().parents[2]
PAGE = "book/14_planner"
WIDGET = "#c14p-planner"
SCREENSHOTS = ROOT / "_build" / "screenshots"

READ = (
    "root => root.querySelector('.pl-results').hidden ? null : Object.fromEntries("
    "Array.from(root.querySelectorAll('[data-out]')).map(e => [e.dataset.out, e.textContent]))"
)
# Set every control as a reader would (a select's change, a number field's input), then read back.
SET = """(root, settings) => {
  for (const [key, value] of Object.entries(settings)) {
    const el = root.querySelector('[data-control="' + key + '"]');
    el.value = String(value);
    el.dispatchEvent(new Event(el.tagName === 'SELECT' ? 'change' : 'input', {bubbles: true}));
  }
}"""


def shown(page):
    """Every ``data-out`` text the planner displays, by key (None while it shows an input error)."""
    return page.locator(WIDGET).evaluate(READ)


def expected(**settings) -> dict[str, str]:
    return pw.compute(**settings)[1]


def in_toc(source: str) -> bool:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return f"file: {source}" in yaml.safe_dump(toc)


# Each row a setting of the controls (the rest at pw.DEFAULTS) and what makes it worth testing.
SWEEP = [
    ({}, "the starting point"),
    ({"tp": 1}, "70B bf16 weights do not fit one H200: no plan"),
    ({"tpot_ms": 5}, "a TPOT target no batch meets"),
    ({"tp": 8, "rate": 50}, "tensor parallel 8"),
    ({"tp": 4, "gpu": "A100 80GB", "ttft_ms": 100}, "TTFT target missed"),
    ({"model": "llama-3.1-8b", "tp": 1, "rate": 100}, "8B on one GPU, prefill share large"),
    (
        {"model": "llama-3.1-8b", "tp": 1, "rate": 0.2, "output": 1},
        "one output token, below one request in flight",
    ),
    (
        {"model": "llama-3.1-405b", "gpu": "H100 SXM", "tp": 8, "precision": "fp8 weights and cache"},
        "405B in fp8",
    ),
    ({"model": "llama-3.1-405b", "gpu": "H100 SXM", "tp": 8}, "405B bf16 does not fit 8 H100s"),
    ({"precision": "int4 weights (group 128), bf16 cache", "tp": 1}, "int4 weights with scales"),
    ({"precision": "fp8 weights, bf16 cache", "tp": 1, "prompt": 32000, "output": 2000}, "long prompts"),
    ({"model": "qwen3-0.6b", "gpu": "T4", "tp": 1, "rate": 40}, "a small model on a T4"),
    ({"model": "mistral-7b-v0.1", "gpu": "L4", "tp": 2, "price": 0}, "no price"),
    ({"model": "qwen3-0.6b", "tp": 1, "rate": 3000, "output": 5000, "tpot_ms": 200}, "concurrency above 1e5"),
    ({"bandwidth_pct": 35.5, "compute_pct": 100, "overhead_ms": 0, "price": 2.35}, "other efficiencies"),
    (
        {
            "model": "qwen2-7b",
            "gpu": "A100 40GB",
            "tp": 1,
            "prompt": 3000,
            "output": 1000,
            "tpot_ms": 30,
            "rate": 4.5,
        },
        "memory binds before TPOT",
    ),
]


@pytest.mark.book
def test_javascript_agrees_with_python_over_a_sweep(page):
    """The snippet on a blank page (no book needed): every setting in SWEEP shows Python's strings."""
    page.set_content(f"<html><body>{pw.static_html(element_id='c14p-planner')}</body></html>")
    page.wait_for_selector(f"{WIDGET}[data-ready='1']")
    root = page.locator(WIDGET)
    assert shown(page) == expected()
    for settings, why in SWEEP:
        full = {**pw.DEFAULTS, **settings}
        root.evaluate(SET, full)
        assert shown(page) == expected(**full), f"JavaScript and Python disagree at {settings} ({why})"
    assert not page.js_errors, f"JavaScript errors: {page.js_errors}"


@pytest.mark.book
def test_built_page_matches_python_and_follows_the_inputs(page, book_url):
    if not in_toc(PAGE):
        pytest.skip(f"{PAGE} is not listed in _toc.yml yet, so the book does not build it")
    built = ROOT / "_build" / "html" / f"{PAGE}.html"
    assert built.exists(), f"{PAGE} is in the table of contents but not built: run `make book`"
    page.route("**/favicon.ico", lambda route: route.fulfill(status=204, body=""))  # as the explainer's test
    page.set_viewport_size({"width": 1280, "height": 1500})
    response = page.goto(f"{book_url}/{PAGE}.html", wait_until="load")
    assert response is not None and response.ok
    page.wait_for_selector(f"{WIDGET}[data-ready='1']", timeout=10_000)

    default = shown(page)
    assert default == expected(), "the page's numbers differ from labsupport.planning's"
    p, _ = pw.compute()
    assert default["replicas"] == str(p.replicas) and default["batch"] == str(p.batch)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator(WIDGET).screenshot(path=str(SCREENSHOTS / "14_planner_widget.png"))

    # A reader picks tensor parallel 8 from the select, then types a new arrival rate.
    page.locator(f"{WIDGET} [data-control='tp']").select_option("8")
    assert shown(page) == expected(tp=8)
    rate = page.locator(f"{WIDGET} [data-control='rate']")
    rate.fill("35")
    assert shown(page) == expected(tp=8, rate=35)

    # Weights that do not fit one GPU: no plan, and the page says why.
    page.locator(f"{WIDGET} [data-control='tp']").select_option("1")
    none = shown(page)
    assert none == expected(tp=1, rate=35)
    assert none["replicas"] == "none" and "do not fit" in none["memory"]
    assert "pl-bad" in page.locator(f"{WIDGET} [data-out='verdict']").get_attribute("class")

    # A TPOT target no batch meets, typed by hand.
    page.locator(f"{WIDGET} [data-control='tp']").select_option("2")
    page.locator(f"{WIDGET} [data-control='tpot_ms']").fill("5")
    assert shown(page) == expected(tp=2, rate=35, tpot_ms=5)

    # Bad input: an empty field shows a message instead of numbers, and fixing it brings them back.
    page.locator(f"{WIDGET} [data-control='tpot_ms']").fill("")
    assert shown(page) is None
    assert (
        page.locator(f"{WIDGET} [data-error]").inner_text()
        == "The TPOT target must be a number greater than 0."
    )
    page.locator(f"{WIDGET} [data-control='tpot_ms']").fill("60")
    assert shown(page) == expected(tp=2, rate=35, tpot_ms=60)

    page.locator(WIDGET).screenshot(path=str(SCREENSHOTS / "14_planner_widget_moved.png"))
    page.screenshot(path=str(SCREENSHOTS / "14_planner.png"), full_page=True)
    assert not page.js_errors, f"JavaScript errors: {page.js_errors}"


def random_settings(rng) -> dict:
    """A valid setting drawn at random: every select, and numbers across the ranges a reader types."""
    return {
        "model": rng.choice(pw.MODELS),
        "gpu": rng.choice(sorted(GPUS)),
        "precision": rng.choice(list(pw.PRECISIONS)),
        "tp": rng.choice(pw.TENSOR_PARALLEL),
        "rate": round(10 ** rng.uniform(-1.5, 3), rng.choice([0, 1, 2])) or 0.5,
        "prompt": rng.choice([1, 17, 128, 500, 1000, 2048, 4000, 16384, 100_000]),
        "output": rng.choice([1, 2, 64, 250, 1000, 8192]),
        "ttft_ms": rng.choice([50, 200, 500, 1000, 2500, 10_000]),
        "tpot_ms": rng.choice([5, 10, 20, 33.3, 50, 100, 250]),
        "bandwidth_pct": rng.choice([20, 50, 60.5, 72, 90, 100]),
        "compute_pct": rng.choice([10, 35, 58, 80, 100]),
        "overhead_ms": rng.choice([0, 0.5, 2.74, 10]),
        "price": rng.choice([0, 0.99, 2, 4, 12.5]),
    }


@pytest.mark.book
def test_javascript_agrees_with_python_on_random_settings(page):
    """Sixty settings drawn with a fixed seed, beyond the hand-picked sweep."""
    rng = random.Random(14)
    page.set_content(f"<html><body>{pw.static_html(element_id='c14p-planner')}</body></html>")
    page.wait_for_selector(f"{WIDGET}[data-ready='1']")
    root = page.locator(WIDGET)
    kinds = set()
    for _ in range(60):
        settings = random_settings(rng)
        root.evaluate(SET, settings)
        want = expected(**settings)
        assert shown(page) == want, f"JavaScript and Python disagree at {settings}"
        kinds.add(want["verdict"] if want["replicas"] == "none" else "feasible")
    assert len(kinds) == 3, f"the draw should reach a plan and both kinds of no plan, reached {kinds}"
    assert not page.js_errors, f"JavaScript errors: {page.js_errors}"
