"""The Prometheus configuration, the rules and the Grafana dashboard of deploy/monitoring (chapter 15)
use only what the course server really exports: every metric name, label and bucket bound in their
PromQL is checked against the /metrics page of a running server (continuous engine, one request
served and one refused), and the files hold together (rules the dashboard uses exist, panels do not
overlap, percentiles come from summed buckets, never from averaged percentiles)."""

from __future__ import annotations

import json
import math
import re
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
    """{sample name: set of label names} and {histogram: bucket bounds} from a running server."""
    server = ServerProcess(["--engine", "continuous", "--context", "64", "--max-tokens-limit", "4"], threads=1).start()
    try:
        httpx.post(server.base_url + "/completions", json={"model": "course-tiny", "prompt": "hello", "max_tokens": 2},
                   timeout=60).raise_for_status()
        bad = httpx.post(server.base_url + "/completions", json={"model": "course-tiny", "max_tokens": "two"}, timeout=60)
        assert bad.status_code == 400
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
    for match in SELECTOR.finditer(code):
        name, selector = match.group(1), match.group(2)
        if name in KEYWORDS or re.fullmatch(r"[\d.e]+", name):
            continue
        after = code[match.end():].lstrip()
        if after.startswith("(") and selector is None:  # a function call
            continue
        labels = re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", _without_strings(expr)[match.start():match.end()]) \
            if selector else []
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
