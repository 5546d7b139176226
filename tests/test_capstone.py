"""The capstone's domain module (lab 16): vLLM's greedy-agreement rule, the report's figures from raw
run records, the profile by slot and where to look, the serving folder, and the reference's top
log-probabilities from the real model. The whole run against two started servers is the lab's own
notebook (solutions/16_capstone.py, under nbval); here every figure is checked against records whose
answers are worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from labsupport import capstone
from labsupport.sampling import SamplingParams
from labsupport.serve.continuous import ContinuousBackend
from labsupport.serve.stack import SlotProfile, plug_in
from labsupport.stack import SLOTS


def record(i, text, ids, sent=0.0, times=(0.5, 0.6, 0.8), finish="stop", error=None, top=None):
    out = {"i": i, "id": f"chatcmpl-{i}", "sent_s": sent, "token_times_s": list(times), "text": text,
           "finish_reason": finish, "error": error, "token_ids": list(ids)}
    if top is not None:
        out["top_logprobs"] = top
    return out


def health(queries=0, hits=0, steps=(0, 0.0), **slots):
    profile = {"step": {"calls": steps[0], "seconds": steps[1]},
               **{k: {"calls": c, "seconds": s} for k, (c, s) in slots.items()}}
    return {"status": "ok", "stack_profile": {"slots": profile, "prefix_cache": {
        "prefix_cache_queries": queries, "prefix_cache_hits": hits}}}


def stack(records, before=None, after=None):
    return {"records": records, "health_before": before or health(), "health_after": after or health()}


def test_equal_texts_agree_and_a_divergence_agrees_only_within_the_references_top_tokens():
    ref = record(0, "Paris is big", [5, 6, 7], top=[{5: -0.1}, {6: -0.2, 9: -1.5}, {7: -0.1}])
    assert capstone.greedy_agreement(ref, record(0, "Paris is big", [5, 6, 7])) == (True, None)
    assert capstone.greedy_agreement(ref, record(0, "Paris was", [5, 9, 8])) == (True, 1)  # 9 in the top at 1
    assert capstone.greedy_agreement(ref, record(0, "Paris no", [5, 4, 7])) == (False, 1)  # 4 is not
    no_top = record(0, "Paris is big", [5, 6, 7])
    assert capstone.greedy_agreement(no_top, record(0, "Paris was", [5, 9, 8])) == (False, 1)
    # same ids, other text: the detokenizer or the stop filter is wrong, whatever the logprobs say
    assert capstone.greedy_agreement(ref, record(0, "Paris is bug", [5, 6, 7])) == (False, None)
    assert capstone.greedy_agreement(ref, record(0, "", [], error="RuntimeError: x")) == (False, None)


def test_stack_figures_are_the_hand_computed_ones():
    records = [record(0, "a", [1, 2, 3], sent=0.0, times=(0.5, 0.6, 0.8)),  # TTFT 0.5, TPOT 0.15
               record(1, "b", [1, 2], sent=0.2, times=(0.3, 1.3)),  # TTFT 0.1, TPOT 1.0
               record(2, "c", [4], sent=0.4, times=(1.4,), finish="length"),  # TTFT 1.0, no TPOT
               record(3, "", [], sent=0.5, times=(), finish=None, error="RuntimeError: planted")]
    figures = capstone.stack_figures(stack(records, health(100, 10), health(300, 70)))
    assert figures["served"] == 3
    assert figures["ttft_s"] == pytest.approx({50: 0.5, 90: 1.0, 99: 1.0})
    assert figures["tpot_s"][50] == pytest.approx(0.15) and figures["tpot_s"][90] == pytest.approx(1.0)
    assert figures["output_tokens_per_s"] == pytest.approx(6 / 1.4)  # first send 0.0, last chunk 1.4
    assert figures["prefix_cache_hit_rate"] == pytest.approx(60 / 200)  # the run's change only
    nothing = capstone.stack_figures(stack([records[3]]))
    assert nothing["served"] == 0 and nothing["output_tokens_per_s"] is None and nothing["ttft_s"][50] is None


def test_report_compares_each_request_with_the_course_stacks_record():
    course = [record(0, "x y", [1, 2]), record(1, "z", [3], top=[{3: -0.1, 4: -2.0}])]
    yours = [record(0, "x y", [1, 2]), record(1, "w", [4])]
    run = {"trace": {"requests": 2}, "yours": stack(yours), "course": stack(course)}
    got = capstone.report(run)
    assert got["requests"] == 2 and got["agree"] == [True, True]
    wrong = capstone.planted(run, lambda r: r["yours"]["records"][0].update(text="x z", token_ids=[1, 5]))
    assert capstone.report(wrong)["agree"] == [False, True]
    assert run["yours"]["records"][0]["text"] == "x y"  # planted() changed a copy


def test_slot_costs_and_where_to_look_name_the_part_that_took_the_step():
    def run(step_ms, sampler_ms):
        yours = stack([], health(steps=(10, 0.0), sampler=(10, 0.0)),
                      health(steps=(110, step_ms * 100e-3), sampler=(110, sampler_ms * 100e-3)))
        return {"yours": yours, "course": stack([], health(steps=(0, 0.0)), health(steps=(100, 0.1)))}

    slow = run(step_ms=3.0, sampler_ms=1.8)  # course: 1 ms a step; yours 3 ms, 1.8 of it your sampler
    costs = capstone.slot_costs(slow["yours"])
    assert costs["step"] == pytest.approx(3e-3) and costs["sampler"] == pytest.approx(1.8e-3)
    said = capstone.where_to_look(slow)
    assert "3.00x" in said and "sampler part (lab 13" in said and said.endswith("look at it first")
    assert "outside your parts" in capstone.where_to_look(run(step_ms=3.0, sampler_ms=0.1))
    assert "not slower" in capstone.where_to_look(run(step_ms=1.05, sampler_ms=0.5))
    assert "no step profile" in capstone.where_to_look({"yours": stack([]), "course": stack([])})


def test_the_servers_profile_times_every_step_and_every_guarded_part():
    """plug_in's timer seam: the engine's steps and the learner's parts, in /health's stats."""
    backend = ContinuousBackend()  # the course model with random weights: fast
    profile = SlotProfile()
    fake = profile.timed("sampler", lambda x: x + 1)
    assert fake(1) == 2 and profile.snapshot()["sampler"]["calls"] == 1
    assert plug_in(backend, {}) == []
    engine = backend.engine
    engine.add_request(list(range(1, 20)), SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    found = backend.stats()["stack_profile"]
    assert found["slots"]["step"]["calls"] == 3 and found["slots"]["step"]["seconds"] > 0
    assert found["prefix_cache"]["prefix_cache_queries"] == 19


def test_the_serving_folder_links_the_notebooks_of_the_labs_that_serve_and_writes_nothing_in_the_labs(tmp_path):
    labs = tmp_path / "labs"
    labs.mkdir()
    for name in ("01_tokens.ipynb", "03_journey.ipynb", "13_my_copy.ipynb"):
        (labs / name).write_text("{}")
    folder = capstone.serving_folder(labs, tmp_path / "serving")
    serving_labs = {s.lab for s in SLOTS if s.serves}
    expected = sorted(f"{lab}.ipynb" for lab in serving_labs if lab in ("01_tokens", "13_decode_loop"))
    assert sorted(p.name for p in folder.iterdir()) == expected
    assert (folder / "13_decode_loop.ipynb").resolve() == (labs / "13_my_copy.ipynb").resolve()
    assert sorted(p.name for p in labs.iterdir()) == ["01_tokens.ipynb", "03_journey.ipynb", "13_my_copy.ipynb"]


def test_a_trace_says_what_it_sends_and_refuses_a_bad_setting():
    trace = capstone.PRESETS["cpu"]
    body = trace.payload(13)
    assert body["messages"][0]["content"] == capstone.PROMPTS[1] and body["temperature"] == 0
    assert body["stream"] is True and body["stop"] == ["\n\n"] and body["max_tokens"] == trace.max_tokens
    assert "--stack" not in capstone.server_options(trace) and "continuous" in capstone.server_options(trace)
    with pytest.raises(ValueError, match="rate"):
        capstone.Trace(rate=0)
    assert set(capstone.run_slots()) >= set(capstone.CLIENT_SLOTS)


def test_the_references_top_logprobs_rank_the_greedy_token_first(smollm2):
    """The real model: the top-1 of each position is the token greedy decoding chose there."""
    prompt = capstone.PROMPTS[0]
    ids = list(smollm2.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    out = smollm2.model.generate(torch.tensor([ids], device=smollm2.model.device), 4)[0, len(ids):].tolist()
    top = capstone.reference_top_logprobs(smollm2.model, smollm2.tokenizer, prompt, out)
    assert len(top) == len(out) and all(len(t) == capstone.TOP_LOGPROBS for t in top)
    assert [max(t, key=t.get) for t in top] == out


def test_the_recorded_run_says_on_which_machine_and_when_and_a_run_without_it_is_refused(tmp_path):
    run = capstone.load_recorded()
    assert run["recorded"]["device"] and run["recorded"]["date"][:2] == "20"
    assert [r["i"] for r in run["yours"]["records"]] == list(range(run["trace"]["requests"]))
    bare = tmp_path / "run.json"
    bare.write_text(json.dumps({k: v for k, v in run.items() if k != "recorded"}), encoding="utf-8")
    with pytest.raises(ValueError, match="python -m labsupport.capstone --out"):
        capstone.load_recorded(bare)


def test_the_grader_tells_the_capstone_where_the_learners_labs_are(tmp_path):
    """The grader's kernel gets the graded notebook's folder under the name the lab reads."""
    from labsupport.course.grade import LABS_DIR_ENV, labs_dir_env

    assert labs_dir_env(tmp_path / "16_capstone.ipynb") == {LABS_DIR_ENV: str(tmp_path.resolve())}
    source = (Path(__file__).resolve().parents[1] / "solutions" / "16_capstone.py").read_text(encoding="utf-8")
    assert "capstone.labs_dir()" in source  # the lab reads the folder through labsupport (no os.environ in a cell)
    from labsupport import capstone

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LABS_DIR_ENV, str(tmp_path))
        assert capstone.labs_dir() == tmp_path.resolve()
        mp.delenv(LABS_DIR_ENV)
        mp.chdir(tmp_path / "..")
        assert capstone.labs_dir() == tmp_path.parent.resolve()
