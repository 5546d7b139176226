"""Checks for the capstone (lab 16): your stack served the whole trace, every request's greedy answer
equals the course stack's (vLLM's rule where a part is not bit-exact), and your report's figures come
from the run's raw records.

Each check takes your ``capstone_report(run)`` and the run itself. It judges the run (the servers'
records and profiles, recomputed here from the raw records), then calls your report on the run and
on planted copies of it (a request failed, an answer changed, the clock stretched), so a report that
does not compute from the records it is given cannot pass.
"""

from __future__ import annotations

import math

from ..capstone import (
    CALLED_BY_THE_TRACE,
    PERCENTILES,
    STACKS,
    greedy_agreement,
    nearest_rank,
    planted,
    report,
    slot_costs,
    stack_figures,
)
from .framework import Case, graded

SERVED_RULE = (
    "a request was served when it has no error, at least one content chunk and a finish_reason of 'stop' or "
    "'length'; report['yours']['served'] and report['course']['served'] count those records of each stack."
)
AGREE_RULE = (
    "report['agree'][i] is True when your record's text equals the course's; otherwise walk both token_ids "
    "lists to the first position where they differ: True only if your token there is a key of the course "
    "record's top_logprobs at that position (nothing after it is compared); same ids but different text, "
    "an error on either side, or no divergence with different texts: False."
)
FIGURES_RULE = (
    "over the served records of one stack: TTFT = first chunk time - sent_s; TPOT = (last chunk - first "
    "chunk) / (chunks - 1) for requests with two chunks or more; percentiles 50, 90, 99 by nearest rank "
    "(ceil(p n / 100)-th smallest), keyed by the int p; output_tokens_per_s = the served records' "
    "len(token_ids) summed, over (last chunk of any served record - first sent_s of all records); "
    "prefix_cache_hit_rate = the change of prefix_cache_hits over the change of prefix_cache_queries between "
    "health_before and health_after (their stack_profile's prefix_cache), None when no query was made."
)


def _require_run(checker, run, case: Case) -> None:
    """The run has both stacks' records, one per request of the trace."""
    if not isinstance(run, dict) or not {"trace", *STACKS} <= set(run):
        checker.fail(case, f"the run must be the dict capstone.new_run returns (keys trace, yours, course), got "
                           f"{type(run).__name__} with keys {sorted(run) if isinstance(run, dict) else '-'}.",
                     "run the lab's cells that start both servers and run the trace, then this check again.")
    n = run["trace"]["requests"]
    for name in STACKS:
        records = run[name].get("records", [])
        if len(records) != n or [r.get("i") for r in records] != list(range(n)):
            checker.fail(case, f"the {name} stack's run holds {len(records)} records, numbered "
                               f"{[r.get('i') for r in records][:12]}, for a trace of {n} requests.",
                         "run the trace again with capstone.run_stack: every request of the trace gets a record.")


def _served(record: dict) -> bool:
    return not record.get("error") and bool(record["token_times_s"]) and record.get("finish_reason") in ("stop", "length")


def _report(checker, fn, run, case: Case) -> dict:
    got = checker.call(fn, planted(run, lambda r: None), case=case)  # a copy: your report cannot change the run
    if not isinstance(got, dict) or not {"requests", "agree", *STACKS} <= set(got):
        checker.fail(case, f"your report must be a dict with keys requests, agree, yours and course; got "
                           f"{got!r:.200}.", "return the same shape as the exercise describes.")
    return got


def _fail_request(run: dict, i: int, why: str) -> dict:
    def change(r):
        r["yours"]["records"][i].update(error=why, token_times_s=[], text="", finish_reason=None, token_ids=[])
    return planted(run, change)


def _error_after_stream(run: dict, i: int, side: str = "yours") -> dict:
    """Request ``i`` streamed in full (text, chunks and finish_reason kept), then reading its timeline
    raised: ``capstone.run_stack`` records the error and no token ids."""
    return planted(run, lambda r: r[side]["records"][i].update(error="HTTPError: planted, reading the timeline",
                                                              token_ids=[]))


def _last_to_finish(stack: dict) -> int:
    """The request whose last chunk came last (0 when no record has a chunk)."""
    timed = [r for r in stack["records"] if r["token_times_s"]]
    return max(timed, key=lambda r: r["token_times_s"][-1])["i"] if timed else 0


def _unfinished(run: dict) -> tuple[int, dict]:
    """Your request that finished last ends with no finish_reason and no error (a stream cut short):
    its chunks and token ids are kept, as ``capstone.run_stack`` keeps them."""
    i = _last_to_finish(run["yours"])
    return i, planted(run, lambda r: r["yours"]["records"][i].update(finish_reason=None, error=None))


@graded(points=4, bans=(report, stack_figures, greedy_agreement))
def check_capstone_run(fn, checker, run=None):
    """Your stack served the whole trace, through the parts it says it served; your report counts it."""
    case = Case(case="your run")
    _require_run(checker, run, case)
    n = run["trace"]["requests"]
    for name, whose in (("yours", "your stack"), ("course", "the course's stack")):
        for r in run[name]["records"]:
            if not _served(r):
                checker.fail(case, f"{whose} did not serve request {r['i']} of the trace: "
                                   f"{r.get('error') or 'finish_reason ' + repr(r.get('finish_reason'))}.",
                             "a failing part names its slot and your line in the error: fix that part (its "
                             "check passed, so the case that broke it is one the check does not make), "
                             "assemble again and rerun." if name == "yours" else
                             "the course's server failed: is the machine out of memory? Rerun the run's cells.")
    profile = run["yours"].get("health_after", {}).get("stack_profile")
    if profile is None:
        checker.fail(case, "your server kept no profile by slot (/health has no stack_profile): it was not "
                           "started with --stack, so the run did not serve through your parts.",
                     "start your server as the lab does: --stack with the folder capstone.serving_folder made.")
    costs = slot_costs(run["yours"])
    idle = [slot for slot in run["yours"].get("serving", []) if slot in CALLED_BY_THE_TRACE and not costs.get(slot)]
    if idle:
        checker.fail(case, f"your server says your {', '.join(idle)} part(s) serve, yet the run never called "
                           f"them (no time in /health's stack_profile).",
                     "start your server with --stack from the same assembly as the run (capstone.serving_folder).")
    last, unfinished = _unfinished(run)
    for label, this, mistake in (
            ("your run", run, "every record is counted, failed ones too"),
            ("your run, request 0 failed (planted)", _fail_request(run, 0, "RuntimeError: planted"),
             "every record is counted, failed ones too"),
            ("request 0 streamed in full, then failed: an error with chunks and a finish_reason (planted)",
             _error_after_stream(run, 0), "a record with an error counts when it has chunks and a finish_reason "
                                          "(served needs no error as well)"),
            (f"request {last} ended with no finish_reason and no error, chunks kept (planted)", unfinished,
             "a record without a finish_reason counts when it has chunks and no error (served needs "
             "finish_reason 'stop' or 'length' as well)")):
        c = Case(case=label)
        got = _report(checker, fn, this, c)
        checker.expect_number(got["yours"].get("served") if isinstance(got["yours"], dict) else None,
                              sum(_served(r) for r in this["yours"]["records"]),
                              case=c, what="report['yours']['served']", hint=SERVED_RULE,
                              mistakes={mistake: n})
        checker.expect_number(got["requests"], n, case=c, what="report['requests']",
                              hint="the trace's number of requests: run['trace']['requests'].")


def _agree_cases(run: dict) -> list[tuple[str, dict]]:
    """Planted copies of ``run``: request 0's answer changed (a divergence at the last token or in the
    middle, the course's top_logprobs keyed by ints or by strings as in a run saved to JSON, the same
    ids with another text) or failed on one side or both."""
    def diverge(token_in_top: bool, same_ids: bool, middle: bool = False, str_keys: bool = False):
        def change(r):
            ref, mine = r["course"]["records"][0], r["yours"]["records"][0]
            ids = list(ref["token_ids"]) or [0]
            ids += [ids[-1]] * (3 - len(ids)) if middle else []  # a middle with tokens after it
            key = str if str_keys else int
            top = [{key(t): -0.01} for t in ids]
            k = len(ids) // 2 if middle else len(ids) - 1  # where the ids first differ
            other = max(ids) + 1
            if token_in_top:
                top[k][key(other)] = -2.0
            ref["token_ids"], ref["top_logprobs"] = ids, top
            # after the divergence every token differs, and none is in the course's top 5 there
            mine["token_ids"] = ids if same_ids else ids[:k] + [other] + [other + 1 + j for j in range(len(ids) - k - 1)]
            mine["text"] = ref["text"] + " (planted)"
            mine["error"], mine["finish_reason"] = None, "length"
            mine["token_times_s"] = mine["token_times_s"] or [mine["sent_s"] + 0.1]
        return planted(run, change)

    def fail(*sides: str):
        def change(r):
            for name in sides:
                r[name]["records"][0].update(error="RuntimeError: planted", token_times_s=[], text="",
                                             finish_reason=None, token_ids=[])
        return planted(run, change)

    return [("your run", run),
            ("request 0 diverges to a token outside the course's top 5 (planted)", diverge(False, False)),
            ("request 0 diverges to a token in the course's top 5 (planted)", diverge(True, False)),
            ("request 0: same token ids, another text (planted)", diverge(False, True)),
            ("request 0 diverges mid-answer to a token in the course's top 5, and every token after it differs "
             "(planted)", diverge(True, False, middle=True)),
            ("request 0 diverges mid-answer to a token in the course's top 5, top_logprobs keyed by strings as in "
             "a run saved to JSON (planted)", diverge(True, False, middle=True, str_keys=True)),
            ("request 0 failed on your side (planted)", fail("yours")),
            ("request 0 failed on both sides (planted)", fail("yours", "course")),
            ("request 0 failed on the course's side after streaming the same text (planted)",
             _error_after_stream(run, 0, "course"))]


def _agree_with(ref: dict, mine: dict, *, errors: str = "both", first_only: bool = True, int_keys: bool = True) -> bool:
    """``greedy_agreement``'s answer, or (other arguments) a common mistake's: ``errors`` 'both',
    'yours' or 'none' (which sides' errors are looked at), every differing position compared rather
    than the first, top_logprobs keys compared as they are."""
    if (errors == "both" and ref.get("error")) or (errors != "none" and mine.get("error")):
        return False
    if ref["text"] == mine["text"]:
        return True
    top = ref.get("top_logprobs") or []
    differ = [i for i, (a, b) in enumerate(zip(ref["token_ids"], mine["token_ids"])) if a != b]
    return bool(differ) and all(i < len(top) and mine["token_ids"][i] in ({int(k) for k in top[i]} if int_keys
                                                                          else set(top[i]))
                                for i in (differ[:1] if first_only else differ))


def _agree_mistakes(run: dict, got) -> list[str]:
    """The common mistakes whose ``agree`` list on ``run`` is ``got``: the rule's own slips first (the
    error check, the keys' type, the first difference); comparing texts or ids only where none fits."""
    pairs = list(zip(run["course"]["records"], run["yours"]["records"]))
    slips = (
        ("only your record's error is looked at (an error on the course's side makes the request False too)",
         dict(errors="yours")),
        ("an error is not looked at (an error on either side makes the request False, even with equal texts)",
         dict(errors="none")),
        ("top_logprobs keys are compared as they are (a run saved as JSON has string keys: compare int(key))",
         dict(int_keys=False)),
        ("every position after the first difference is compared too (only the first counts: after it the "
         "two answers continue from different text)", dict(first_only=False)))
    slips = [what for what, options in slips if got == [_agree_with(r, m, **options) for r, m in pairs]]
    texts = [r["text"] == m["text"] for r, m in pairs]
    ids = [r["token_ids"] == m["token_ids"] for r, m in pairs]
    return slips or [what for what, lists in (
        ("comparing texts only (a divergence to one of the course's top 5 tokens agrees)", [texts]),
        ("comparing token ids (same ids with another text do not agree)", [ids, [a or b for a, b in zip(ids, texts)]]))
        if got in lists]


@graded(points=4, bans=(report, stack_figures, greedy_agreement))
def check_capstone_greedy(fn, checker, run=None):
    """Every request's greedy answer from your stack equals the course stack's (vLLM's rule), and your
    report's ``agree`` says so request by request."""
    case = Case(case="your run")
    _require_run(checker, run, case)
    for ref, mine in zip(run["course"]["records"], run["yours"]["records"]):
        ok, at = greedy_agreement(ref, mine)
        if not ok:
            where = f"; the token ids first differ at position {at}" if at is not None else \
                "; the token ids never differ, so the text went wrong after sampling (your detokenizer or stop filter)"
            checker.fail(case, f"request {mine['i']}'s greedy answer differs from the course stack's:\n"
                               f"  yours:    {mine['text']!r}\n  course's: {ref['text']!r}{where}.",
                         f"your serving parts were {', '.join(run['yours'].get('serving', [])) or 'none'}; a "
                         f"sampler that is not the argmax at temperature 0, a scheduler or step assembly that "
                         f"mixes up positions, or a detokenizer that drops bytes changes the text. Run that "
                         f"request alone against both servers to see which.")
    for label, this in _agree_cases(run):
        c = Case(case=label)
        got = _report(checker, fn, this, c)["agree"]
        want = [greedy_agreement(ref, mine)[0] for ref, mine in zip(this["course"]["records"], this["yours"]["records"])]
        if isinstance(got, list) and len(got) != len(want):
            checker.fail(c, f"report['agree'] has {len(got)} entries for {len(want)} requests: {got!r:.300}.",
                         "one entry per request of the trace, in order, a failed request included (False: an "
                         "error on either side never agrees). " + AGREE_RULE)
        if not isinstance(got, list) or [bool(x) for x in got] != want or not all(isinstance(x, bool) for x in got):
            said = _agree_mistakes(this, got)
            said = f" Your list matches {'; or '.join(said)}." if said else ""
            checker.fail(c, f"report['agree'] is {got!r:.300}, expected {want}.{said}", AGREE_RULE)


def _figure_cases(run: dict) -> list[tuple[str, dict]]:
    def stretch(r):  # every time twice as long: TTFT and TPOT double, throughput halves
        for name in STACKS:
            for rec in r[name]["records"]:
                rec["sent_s"] *= 2
                rec["token_times_s"] = [2 * t for t in rec["token_times_s"]]

    def late_last(r):  # the last chunk of request 0 a second later
        rec = r["yours"]["records"][0]
        if rec["token_times_s"]:
            rec["token_times_s"][-1] += 1.0

    def cache(r):  # the server had served before the run (500 looked up, 100 found), and found more during it
        for health, queries, hits in (("health_before", 500, 100), ("health_after", 1500, 800)):
            counts = r["yours"][health].setdefault("stack_profile", {}).setdefault("prefix_cache", {})
            counts["prefix_cache_queries"] = counts.get("prefix_cache_queries", 0) + queries
            counts["prefix_cache_hits"] = counts.get("prefix_cache_hits", 0) + hits

    def one_chunk(r):  # request 0 answered in one chunk: served, but no TPOT
        rec = r["yours"]["records"][0]
        rec.update(token_times_s=rec["token_times_s"][:1], token_ids=rec["token_ids"][:1], finish_reason="length")

    def no_query(r):  # the prefix cache was not asked during the run: its counts did not change
        stack = r["yours"]
        after = stack["health_after"].setdefault("stack_profile", {}).setdefault("prefix_cache", {})
        before = stack["health_before"].get("stack_profile", {}).get("prefix_cache", {})
        for key in ("prefix_cache_queries", "prefix_cache_hits"):
            after[key] = before.get(key, 0)

    last, unfinished = _unfinished(run)
    return [("your run", run), ("every time doubled (planted)", planted(run, stretch)),
            ("request 0's last chunk a second late (planted)", planted(run, late_last)),
            ("500 prompt tokens looked up before the run, 1000 more during it (planted)", planted(run, cache)),
            ("request 0 failed (planted)", _fail_request(run, 0, "RuntimeError: planted")),
            ("request 0 answered in one chunk (planted)", planted(run, one_chunk)),
            (f"request {last}, the last to finish, ended with no finish_reason and no error, its chunks and "
             f"token ids kept (planted)", unfinished),
            ("no prompt token looked up in the prefix cache during the run (planted)", planted(run, no_query))]


def _figure_mistakes(stack: dict, key: str, p: int | None = None) -> dict[str, float]:
    done = [r for r in stack["records"] if _served(r)]
    out: dict[str, float] = {}
    if key in ("ttft_s", "tpot_s") and done:
        values = [r["token_times_s"][0] - r["sent_s"] for r in done] if key == "ttft_s" else \
            [(r["token_times_s"][-1] - r["token_times_s"][0]) / (len(r["token_times_s"]) - 1)
             for r in done if len(r["token_times_s"]) > 1]
        if values:
            data = sorted(values)
            pos = p / 100 * (len(data) - 1)  # numpy's default: linear between the closest ranks
            low = math.floor(pos)
            out["the percentile interpolates between ranks (numpy's default) instead of nearest rank"] = \
                data[low] + (data[min(low + 1, len(data) - 1)] - data[low]) * (pos - low)
        if key == "tpot_s":
            e2e = [(r["token_times_s"][-1] - r["sent_s"]) / len(r["token_times_s"]) for r in done]
            out["TPOT is the whole time over the chunks (the first token's wait counted in)"] = nearest_rank(e2e, p)
            zeros = [(r["token_times_s"][-1] - r["token_times_s"][0]) / max(1, len(r["token_times_s"]) - 1)
                     for r in done]
            out["a one-chunk request counts with a TPOT of 0 (TPOT covers requests with two chunks or more)"] = \
                nearest_rank(zeros, p)
    if key == "output_tokens_per_s" and done:
        wall = max(r["token_times_s"][-1] for r in done) - min(r["sent_s"] for r in stack["records"])
        out["tokens are counted as content chunks, not sampled token ids"] = \
            sum(len(r["token_times_s"]) for r in done) / wall
        out["the time is the sum of the requests' own times, not the wall time"] = \
            sum(len(r["token_ids"]) for r in done) / sum(r["token_times_s"][-1] - r["sent_s"] for r in done)
        out["the token ids of requests that were not served are counted too (only served records' count)"] = \
            sum(len(r["token_ids"]) for r in stack["records"]) / wall
        last = max(r["token_times_s"][-1] for r in stack["records"] if r["token_times_s"])
        out["the wall time ends at the last chunk of any record, served or not (it ends at a served one's)"] = \
            sum(len(r["token_ids"]) for r in done) / (last - min(r["sent_s"] for r in stack["records"]))
    if key == "prefix_cache_hit_rate":
        after = stack["health_after"].get("stack_profile", {}).get("prefix_cache", {})
        if after.get("prefix_cache_queries"):
            out["the counts are the server's totals since it started, not their change during the run"] = \
                after["prefix_cache_hits"] / after["prefix_cache_queries"]
    return out


@graded(points=4, bans=(report, stack_figures, greedy_agreement))
def check_capstone_figures(fn, checker, run=None):
    """Your report's TTFT, TPOT, throughput and prefix-cache figures are the ones the run's records give."""
    _require_run(checker, run, Case(case="your run"))
    for label, this in _figure_cases(run):
        c = Case(case=label)
        got = _report(checker, fn, this, c)
        for name in STACKS:
            want, mine = stack_figures(this[name]), got[name]
            if not isinstance(mine, dict):
                checker.fail(c, f"report[{name!r}] is {mine!r:.100}, expected a dict of figures.", FIGURES_RULE)
            pairs = [(key, p, want[key][p], (mine.get(key) or {}).get(p) if isinstance(mine.get(key), dict) else None)
                     for key in ("ttft_s", "tpot_s") for p in PERCENTILES]
            pairs += [(key, None, want[key], mine.get(key)) for key in ("output_tokens_per_s", "prefix_cache_hit_rate")]
            for key, p, expected, actual in pairs:
                what = f"report[{name!r}][{key!r}]" + (f"[{p}]" if p is not None else "")
                if expected is None:
                    if actual is not None:
                        why = " Your figure is 0 where no prompt token was looked up: with no query there is no " \
                              "rate (0 hits of 0 queries), so it is None." if key == "prefix_cache_hit_rate" and \
                              actual == 0 else ""
                        checker.fail(c, f"{what} is {actual!r}, expected None (nothing to measure it on).{why}",
                                     FIGURES_RULE)
                    continue
                checker.expect_number(actual, expected, case=c, rel=1e-9, what=what, hint=FIGURES_RULE,
                                      mistakes=_figure_mistakes(this[name], key, p))
