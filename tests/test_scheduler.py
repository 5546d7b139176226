"""The scheduler's rule (chapter 13), its validation of a decision, static batching and the
model-free simulation."""

from __future__ import annotations

import pytest

from labsupport._answers import unguarded
from labsupport.scheduler import (
    SeqView,
    TraceItem,
    check_decision,
    schedule_step,
    simulate,
    static_batch_step,
)

schedule = unguarded(schedule_step)
RUNNING = [SeqView("a", 12, 11, 3), SeqView("b", 30, 8, 2), SeqView("c", 7, 6, 2)]
WAITING = [SeqView("d", 20), SeqView("e", 3)]


def test_running_first_then_chunks_in_order():
    assert schedule(RUNNING, WAITING, 8, 10, 4, 8) == ({"a": 1, "b": 7}, [])
    assert schedule(RUNNING, WAITING, 32, 10, 4, 8) == ({"a": 1, "b": 22, "c": 1, "d": 8}, [])
    # a slot cap stops admission
    assert schedule(RUNNING, WAITING, 64, 20, 4, 4) == ({"a": 1, "b": 22, "c": 1, "d": 20}, [])


def test_preempts_the_newest_when_blocks_run_out():
    # "a" needs no block (11 -> 12 of 12 slots), "b" needs 6 more: "c" (2 blocks) is preempted, then "b" itself
    assert schedule(RUNNING, WAITING, 32, 0, 4, 8) == ({"a": 1}, ["c", "b"])
    # nothing admitted in a step that preempted
    scheduled, preempted = schedule(RUNNING, WAITING, 32, 4, 4, 8)
    assert preempted and not set(scheduled) & {"d", "e"}


def test_first_come_first_served():
    waiting = [SeqView("long", 100), SeqView("short", 2)]
    # the long prompt gets the budget's chunk; the short one behind it waits
    assert schedule([], waiting, 16, 100, 4, 8) == ({"long": 16}, [])
    # a long prompt that cannot get its blocks blocks the queue rather than being overtaken
    assert schedule([], waiting, 200, 3, 4, 8) == ({}, [])


@pytest.mark.parametrize("decision, match", [
    (({"a": 2}, []), "1 to 1"),
    (({"zz": 1}, []), "neither running nor waiting"),
    (({"a": 1}, ["a"]), "both scheduled and preempted"),
    (({"d": 20}, []), "over the budget"),
    (({}, ["d"]), "not running"),
    (({"d": 16}, []), "new blocks"),
    (([], []), "dict"),
    ("nothing", "returns"),
])
def test_check_decision_says_what_is_impossible(decision, match):
    with pytest.raises(ValueError, match=match):
        check_decision(decision, RUNNING, WAITING, 16, 2, 4, 8)


def test_static_batching_waits_for_the_whole_batch():
    running = [SeqView("a", 12, 11, 3)]
    assert static_batch_step(running, WAITING, None, 10, 4, 8) == ({"a": 1}, [])
    assert static_batch_step([], WAITING, None, 10, 4, 8) == ({"d": 20, "e": 3}, [])


def test_simulation_finishes_every_request_and_counts_preemptions():
    trace = [TraceItem(0, 40, 60) for _ in range(6)]
    result = simulate(schedule, trace, token_budget=256, num_blocks=30, block_size=16, max_running=8)
    assert all(r["finish"] is not None for r in result["requests"])
    assert sum(r["preemptions"] for r in result["requests"]) > 0
    assert all(r["first"] <= r["first_token"] <= r["finish"] for r in result["requests"])
    static = simulate(static_batch_step, trace, token_budget=None, num_blocks=64, block_size=16, max_running=3)
    assert static["steps"] > result["steps"]
    with pytest.raises(RuntimeError, match="did not finish"):
        simulate(schedule, [TraceItem(0, 100, 5)], token_budget=8, num_blocks=4, block_size=4, max_running=2)
