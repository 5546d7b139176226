"""The Prometheus configuration, the rules and the Grafana dashboard of deploy/monitoring (chapter 15)
use only what the course server really exports: every metric name, label and bucket bound in their
PromQL is checked against the /metrics page of a running server (continuous engine, one request
served and one refused), and the files hold together (rules the dashboard uses exist, panels do not
overlap, percentiles come from summed buckets, never from averaged percentiles). Where promtool is
installed, Prometheus itself checks the configuration and the rules and runs the rules' unit tests
(course_server_rules_test.yml)."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from labsupport.serve import ServerProcess

HERE = Path(__file__).resolve().parents[1] / "deploy" / "monitoring"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("", "_sum", "_count", "_created"), "unknown": ("",)}
# names PromQL itself provides: the scrape's health
BUILTIN = {"up"}


@pytest.fixture(scope="module")
def exported():
    """{sample name: set of label names} and {histogram: bucket bounds} from a running server that has
    served a request, refused one (429, one slot taken) and lost one (the client closed its stream), so
    that every labelled counter has a sample and shows its label names."""
    # the slot-holding stream lasts 64 steps of 0.25 s, so the next request finds the slot taken however
    # late a loaded machine sends it
    server = ServerProcess(["--engine", "continuous", "--context", "128", "--max-tokens-limit", "64",
                            "--max-requests", "1", "--step-delay", "0.25"], threads=1).start()
    body = {"model": "course-tiny", "prompt": "hello", "max_tokens": 2}
    try:
        seen = []  # what each try saw, for the message if no try was refused
        # at a load average of 20 on 2 cores the request beyond the slot was answered 200 in about one run
        # in four, within a second of the stream's first token (cause not found): up to three tries
        for _ in range(3):
            with httpx.stream("POST", server.base_url + "/completions",
                              json={**body, "stream": True, "max_tokens": 64, "ignore_eos": True}, timeout=60) as s:
                lines = s.iter_lines()
                next(lines)  # admitted and streaming for about 16 s more: the one slot is taken
                health = server.health()
                second = httpx.post(server.base_url + "/completions", json=body, timeout=60)
                if second.status_code == 429:
                    break
                seen.append((health, second.status_code, second.text[:300], [x[:200] for x in lines][-3:]))
        assert len(seen) < 3, f"a request beyond --max-requests 1 was never refused: {seen}"
        # the stream was closed mid-way: an abort. Then the slot frees and a request is served.
        deadline = time.monotonic() + 30
        while (r := httpx.post(server.base_url + "/completions", json=body, timeout=60)).status_code == 429:
            assert time.monotonic() < deadline, "the slot was never freed after the client went away"
            time.sleep(0.1)
        r.raise_for_status()
        text = httpx.get(server.url + "/metrics", timeout=60).text
    finally:
        server.stop()
    names: dict[str, set[str]] = {}
    buckets: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES[family.type]:
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
            if sample.name.endswith("_bucket"):
                buckets.setdefault(sample.name, set()).add(sample.labels["le"])
    return names, buckets


def _rules():
    return yaml.safe_load((HERE / "course_server_rules.yml").read_text())


def _dashboard():
    return json.loads((HERE / "grafana_course_server.json").read_text())


def _expressions():
    """(where, PromQL) of every expression in the rules and the dashboard."""
    out = [(f"rule {r.get('record') or r.get('alert')}", r["expr"]) for g in _rules()["groups"] for r in g["rules"]]
    out += [(f"panel {p['title']!r}", t["expr"]) for p in _dashboard()["panels"] for t in p["targets"]]
    return out


def _without_strings(expr: str) -> str:
    return re.sub(r'"[^"]*"', '""', expr)


SELECTOR = re.compile(r"(?<![\w:$])([a-zA-Z_:][\w:]*)\s*(\{[^}]*\})?")
KEYWORDS = {"sum", "by", "without", "rate", "irate", "increase", "histogram_quantile", "and", "or", "unless", "max",
            "min", "avg", "count", "on", "ignoring", "group_left", "group_right", "humanizePercentage", "bool"}


def _metrics_in(expr: str) -> list[tuple[str, list[str]]]:
    """(metric name, label names matched in its selector) for every series the expression selects."""
    out = []
    code = re.sub(r"\[[^\]]*\]", "", _without_strings(expr))  # range durations like [5m] and [$__rate_interval]
    # grouping clauses name labels, not series: sum by (job, le) (...), on (job), group_left (reason)
    code = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", code)
    for match in SELECTOR.finditer(code):
        name, selector = match.group(1), match.group(2)
        if name in KEYWORDS or re.fullmatch(r"[\d.e]+", name):
            continue
        after = code[match.end():].lstrip()
        if after.startswith("(") and selector is None:  # a function call
            continue
        labels = re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector) if selector else []  # strings blanked, names kept
        out.append((name, labels))
    return out


def test_every_series_the_files_select_is_one_the_server_exports(exported):
    names, _ = exported
    recorded = {r["record"] for g in _rules()["groups"] for r in g["rules"] if "record" in r}
    unknown = []
    for where, expr in _expressions():
        for name, labels in _metrics_in(expr):
            if name in recorded or name in BUILTIN:
                continue
            if name not in names:
                unknown.append((where, name))
                continue
            missing = [label for label in labels if label not in names[name] | {"job", "instance", "model"}]
            assert not missing, f"{where}: {name} has no label {missing}; it has {sorted(names[name])}"
    assert not unknown, f"series the server does not export: {unknown}; it exports {sorted(names)}"
    for where, expr in _expressions():  # sum by (le), by (finished_reason): labels the selected series carry
        have = {"job", "instance", "model"}.union(*(names.get(n, set()) for n, _ in _metrics_in(expr)))
        grouped = {label.strip() for clause in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", _without_strings(expr))
                   for label in clause.split(",")}
        assert grouped <= have, f"{where} groups by {sorted(grouped - have)}, which its series do not carry"
    used = {name for _, expr in _expressions() for name, _ in _metrics_in(expr)}
    assert {"course:time_to_first_token_seconds_bucket", "course:num_requests_waiting", "course:kv_cache_usage_perc",
            "course:request_rejected_total", "up"} <= used  # the dashboard covers state, latency and refusals


def test_the_slo_targets_are_bucket_bounds_the_server_has(exported):
    _, buckets = exported
    for where, expr in _expressions():
        for name, bound in re.findall(r'([\w:]+_bucket)\{le="([^"]+)"\}', expr):
            assert bound in buckets[name], f"{where}: {name} has no bucket le={bound!r}: {sorted(buckets[name], key=float)}"


def test_percentiles_come_from_summed_buckets_never_from_averaged_percentiles():
    for where, expr in _expressions():
        flat = " ".join(expr.split())
        for inner in re.findall(r"histogram_quantile\(\s*[\d.]+\s*,\s*(.*)\)", flat):
            assert re.match(r"sum by \((?:job, )?le\) \(rate\([\w:]+_bucket\[", inner), (where, inner)
        assert not re.search(r"\b(avg|sum|max)\b[^(]*\(\s*histogram_quantile", flat), f"{where} aggregates percentiles"


def test_the_rules_hold_together():
    rules = _rules()
    groups = [g["name"] for g in rules["groups"]]
    assert len(groups) == len(set(groups))
    recorded = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert ("record" in rule) != ("alert" in rule), rule
            assert rule["expr"].strip(), rule
            if "record" in rule:
                assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]  # level:metric:ops
                recorded.add(rule["record"])
            else:
                assert rule["labels"]["severity"] in {"page", "ticket"} and rule["annotations"]["summary"]
                assert re.fullmatch(r"\d+[smh]", rule["for"])
    used = {name for _, expr in _expressions() for name, _ in _metrics_in(expr) if name.startswith("job:")}
    assert used <= recorded, used - recorded
    config = yaml.safe_load((HERE / "prometheus.yml").read_text())
    assert all((HERE / f).exists() for f in config["rule_files"])
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert all(f'job="{j}"' not in expr or j in jobs for _, expr in _expressions() for j in re.findall(r'job="([^"]+)"', expr))


def test_the_burn_rate_thresholds_spend_the_budget_the_workbook_says():
    """14.4 for 1 h and 6 for 6 h, of a 30-day window, spend 2% and 5% of the error budget."""
    alerts = {r["alert"]: " ".join(r["expr"].split()) for g in _rules()["groups"] for r in g["rules"] if "alert" in r}
    for name, (rate, window_h, spent) in {"CourseTTFTBudgetBurningFast": (14.4, 1, 0.02),
                                          "CourseTTFTBudgetBurningSlowly": (6, 6, 0.05)}.items():
        assert f"> {rate:g} * (1 - 0.99)" in alerts[name]
        assert math.isclose(rate * window_h / (30 * 24), spent)
        long, short = re.findall(r"ratio_rate(\d+[mh])", alerts[name])
        seconds = {"m": 60, "h": 3600}
        assert int(long[:-1]) * seconds[long[-1]] == 12 * int(short[:-1]) * seconds[short[-1]]  # short window: 1/12


def test_the_dashboard_is_a_grafana_dashboard_with_no_overlapping_panels():
    d = _dashboard()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["__inputs"][0]["pluginId"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        assert p["type"] in {"timeseries", "stat", "gauge"} and p["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert [t["refId"] for t in p["targets"]] == [chr(65 + i) for i in range(len(p["targets"]))]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another at {(x, y)}"
                cells.add((x, y))
        for t in p["targets"]:
            assert "[$__rate_interval]" in t["expr"] or "rate(" not in t["expr"], t["expr"]


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
@pytest.mark.parametrize("args", [("check", "config", "prometheus.yml"), ("check", "rules", "course_server_rules.yml"),
                                  ("test", "rules", "course_server_rules_test.yml")])
def test_prometheus_itself_accepts_the_files_and_the_alerts_fire_when_they_should(args):
    """Prometheus's own tool: the configuration and the rules parse as Prometheus parses them, and the rules'
    unit tests (synthetic scrapes: a burn rate of 20 pages, 0.5 does not, a burst that is over stops paging,
    refusals page, a failed scrape pages) pass."""
    done = subprocess.run([PROMTOOL, *args], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
