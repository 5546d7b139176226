"""The capstone's checks pass a right report on a real run and reject planted wrong runs and reports.

The run is ``capstone_run.json`` beside this file: a real run of the solutions' stack and the
course's on the lab's CPU trace (what it says under ``"recorded"``); the planted runs change a copy of
it. Each planted report makes one mistake the checks name."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from labsupport.checks import CheckFailed, check_capstone_figures, check_capstone_greedy, check_capstone_run

RUN = json.loads((Path(__file__).parent / "capstone_run.json").read_text(encoding="utf-8"))
CHECKS = (check_capstone_run, check_capstone_greedy, check_capstone_figures)


def served(r):
    return not r.get("error") and bool(r["token_times_s"]) and r.get("finish_reason") in ("stop", "length")


def rank(values, p):
    data = sorted(values)
    return data[max(1, math.ceil(p * len(data) / 100)) - 1] if data else None


def agree(ref, mine, errors="both", first_only=True, as_int=lambda k: int(k)):
    if (errors == "both" and ref.get("error")) or (errors != "none" and mine.get("error")):
        return False
    if ref["text"] == mine["text"]:
        return True
    for i, (a, b) in enumerate(zip(ref["token_ids"], mine["token_ids"])):
        if a != b:
            top = ref.get("top_logprobs") or []
            if not (i < len(top) and b in {as_int(k) for k in top[i]}):
                return False
            if first_only:
                return True
    return not first_only and ref["token_ids"] != mine["token_ids"]


def figures(stack, tokens=lambda r: len(r["token_ids"]), pct=rank, tpot=None, totals=False, counted=served,
            min_chunks=2, zero_rate=False, ids_of_all=False, wall_of_all=False):
    done = [r for r in stack["records"] if counted(r)]
    ttft = [r["token_times_s"][0] - r["sent_s"] for r in done]
    tpot = tpot or (lambda r: (r["token_times_s"][-1] - r["token_times_s"][0]) / max(1, len(r["token_times_s"]) - 1))
    tpots = [tpot(r) for r in done if len(r["token_times_s"]) >= min_chunks]
    ends = [r["token_times_s"][-1] for r in (stack["records"] if wall_of_all else done) if r["token_times_s"]]
    wall = max(ends) - min(r["sent_s"] for r in stack["records"]) if done else 0
    caches = [stack[h].get("stack_profile", {}).get("prefix_cache", {}) for h in ("health_before", "health_after")]
    base = {} if totals else caches[0]
    queries = caches[1].get("prefix_cache_queries", 0) - base.get("prefix_cache_queries", 0)
    hits = caches[1].get("prefix_cache_hits", 0) - base.get("prefix_cache_hits", 0)
    return {"served": len(done), "ttft_s": {p: pct(ttft, p) for p in (50, 90, 99)},
            "tpot_s": {p: pct(tpots, p) for p in (50, 90, 99)},
            "output_tokens_per_s": sum(tokens(r) for r in (stack["records"] if ids_of_all else done)) / wall
            if wall else None,
            "prefix_cache_hit_rate": hits / queries if queries else (0.0 if zero_rate else None)}


def ref_report(run, agreeing=agree, **options):
    return {"requests": run["trace"]["requests"],
            "agree": [agreeing(a, b) for a, b in zip(run["course"]["records"], run["yours"]["records"])],
            "yours": figures(run["yours"], **options), "course": figures(run["course"], **options)}


def fails(check, fn, run=RUN, match=""):
    with pytest.raises(CheckFailed, match="(?s)" + match):
        check(fn, run=run)


def test_a_right_report_on_the_real_run_passes_every_check(capsys):
    for check in CHECKS:
        check(ref_report, run=RUN)
    out = capsys.readouterr().out
    assert all(f"PASSED {c.__name__}" in out for c in CHECKS)


def test_the_stub_is_not_done():
    def stub(run):
        raise NotImplementedError("write capstone_report")
    for check in CHECKS:
        with pytest.raises(CheckFailed) as failed:
            check(stub, run=RUN)
        assert failed.value.reason == "not done"


# --- planted wrong runs ----------------------------------------------------------------------------


def changed(change):
    run = copy.deepcopy(RUN)
    change(run)
    return run


def test_a_run_with_a_request_your_stack_failed_fails():
    def fail_3(run):
        run["yours"]["records"][3].update(error="PartFailed: your sampler part raised", token_times_s=[],
                                          finish_reason=None)
    fails(check_capstone_run, ref_report, changed(fail_3), "your stack did not serve request 3.*sampler part")


def test_a_run_missing_a_request_fails_every_check():
    short = changed(lambda run: run["yours"]["records"].pop())
    for check in CHECKS:
        fails(check, ref_report, short, "holds 9 records.*for a trace of 10 requests")


def test_a_run_not_served_through_the_stack_fails():
    no_profile = changed(lambda run: run["yours"]["health_after"].pop("stack_profile"))
    fails(check_capstone_run, ref_report, no_profile, "not started with --stack")
    idle = changed(lambda run: run["yours"]["health_after"]["stack_profile"]["slots"].pop("sampler"))
    fails(check_capstone_run, ref_report, idle, "sampler part.*never called")


def test_a_run_whose_greedy_text_differs_fails_and_a_divergence_in_the_top_5_passes():
    def other_text(run):
        mine = run["yours"]["records"][2]
        mine["text"] = mine["text"][:-3] + "xyz"
        mine["token_ids"] = mine["token_ids"][:-1] + [7]
    fails(check_capstone_greedy, ref_report, changed(other_text), "request 2's greedy answer differs.*position")

    def detok(run):
        run["yours"]["records"][0]["text"] += "!"
    fails(check_capstone_greedy, ref_report, changed(detok), "never differ.*detokenizer or stop filter")

    def within_top(run):
        ref, mine = run["course"]["records"][2], run["yours"]["records"][2]
        ref["top_logprobs"] = [{t: -0.1} for t in ref["token_ids"]]
        ref["top_logprobs"][-1][7] = -1.0
        mine["text"] = mine["text"] + " (a kernel's rounding)"
        mine["token_ids"] = ref["token_ids"][:-1] + [7]
    check_capstone_greedy(ref_report, run=changed(within_top))


# --- planted wrong reports -------------------------------------------------------------------------


def test_a_report_that_does_not_count_failed_requests_fails():
    def every_record(run):
        out = ref_report(run)
        out["yours"]["served"] = len(run["yours"]["records"])
        return out
    fails(check_capstone_run, every_record, match="served.*every record is counted")


def test_a_report_that_compares_texts_only_or_ids_only_fails():
    def texts(run):
        out = ref_report(run)
        out["agree"] = [a["text"] == b["text"] for a, b in zip(run["course"]["records"], run["yours"]["records"])]
        return out

    def ids(run):
        out = ref_report(run)
        out["agree"] = [a["token_ids"] == b["token_ids"] for a, b in zip(run["course"]["records"], run["yours"]["records"])]
        return out
    fails(check_capstone_greedy, texts, match="comparing texts only")
    fails(check_capstone_greedy, ids, match="comparing token ids")
    fails(check_capstone_greedy, lambda run: {**ref_report(run), "agree": [True] * run["trace"]["requests"]},
          match="report\\['agree'\\]")


def interpolated(values, p):
    data = sorted(values)
    if not data:
        return None
    pos = p / 100 * (len(data) - 1)
    low = math.floor(pos)
    return data[low] + (data[min(low + 1, len(data) - 1)] - data[low]) * (pos - low)


@pytest.mark.parametrize("options, said", [
    (dict(pct=interpolated), "interpolates between ranks"),
    (dict(tokens=lambda r: len(r["token_times_s"])), "content chunks"),
    (dict(tpot=lambda r: (r["token_times_s"][-1] - r["sent_s"]) / len(r["token_times_s"])), "first token's wait"),
    (dict(totals=True), "totals since it started"),
])
def test_a_report_with_a_wrong_figure_fails_and_names_the_mistake(options, said):
    fails(check_capstone_figures, lambda run: ref_report(run, **options), match=said)


def test_a_report_of_fixed_numbers_fails_on_the_planted_runs():
    fixed = ref_report(RUN)
    fails(check_capstone_figures, lambda run: copy.deepcopy(fixed), match="every time doubled")
    fails(check_capstone_run, lambda run: copy.deepcopy(fixed), match="request 0 failed")


# --- the red team's survivors (notes/redteam-lab16.md): each now fails on the plant made for it -----


@pytest.mark.parametrize("counted, said", [
    (lambda r: bool(r["token_times_s"]) and r.get("finish_reason") in ("stop", "length"),
     "request 0 streamed in full, then failed.*a record with an error counts"),
    (lambda r: not r.get("error") and bool(r["token_times_s"]),
     "ended with no finish_reason and no error.*a record without a finish_reason counts"),
])
def test_a_report_that_counts_an_errored_or_unfinished_record_as_served_fails(counted, said):
    fails(check_capstone_run, lambda run: ref_report(run, counted=counted), match=said)


@pytest.mark.parametrize("agreeing, case, said", [
    (lambda a, b: agree(a, b, errors="none"), "failed on both sides", "an error is not looked at"),
    (lambda a, b: agree(a, b, errors="yours"), "failed on the course's side", "only your record's error"),
    (lambda a, b: agree(a, b, first_only=False), "diverges mid-answer.*every token after it differs",
     "every position after the first difference"),
    (lambda a, b: agree(a, b, as_int=lambda k: k), "keyed by strings as in a run saved to JSON",
     "keys are compared as they are"),
])
def test_an_agree_rule_with_a_slip_fails_and_names_it(agreeing, case, said):
    fails(check_capstone_greedy, lambda run: ref_report(run, agreeing=agreeing), match=f"case=[^]]*{case}.*{said}")


def test_an_agree_list_that_leaves_out_a_failed_request_fails():
    def served_only(run):
        out = ref_report(run)
        out["agree"] = [a for a, mine in zip(out["agree"], run["yours"]["records"]) if not mine.get("error")]
        return out
    fails(check_capstone_greedy, served_only, match="failed on your side.*has 9 entries for 10 requests")


@pytest.mark.parametrize("options, case, said", [
    (dict(min_chunks=1), "answered in one chunk", "one-chunk request counts with a TPOT of 0"),
    (dict(ids_of_all=True), "the last to finish, ended with no finish_reason", "not served are counted too"),
    (dict(wall_of_all=True), "the last to finish, ended with no finish_reason", "last chunk of any record"),
    (dict(zero_rate=True), "no prompt token looked up", "is 0.0, expected None.*no query there is no rate"),
])
def test_a_figure_from_unserved_records_or_of_nothing_fails_and_names_the_mistake(options, case, said):
    fails(check_capstone_figures, lambda run: ref_report(run, **options), match=f"case=[^]]*{case}.*{said}")
