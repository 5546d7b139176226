"""labsupport.real_model_figures: the quick mode on the real model, and the committed results file."""

import json

import pytest

from labsupport import real_model_figures as R
from labsupport import real_model_pages as pages

PAGES = {"tokens": (pages.tokens_md, pages.template_md), "journey": (pages.journey_md,),
         "position": (pages.position_md,), "quality": (pages.quality_md,), "prefix": (pages.prefix_md,),
         "speculative": (pages.speculative_md,), "engine_speculative": (pages.engine_speculative_md,)}

QUICK_SECTIONS = ("tokens", "position", "quality", "prefix", "speculative", "engine_speculative")  # journey starts a server: see test_serve_chat


def test_quick_mode_measures_and_is_never_shown(smollm2, tmp_path):
    out = R.measure(smollm2, QUICK_SECTIONS, quick=True, log=lambda *_: None)
    assert list(out) == list(QUICK_SECTIONS)
    for part in out.values():
        assert part["quick"] is True and part["model"]["name"] == "smollm2-135m-instruct" and part["date"]
    tokens = out["tokens"]
    assert tokens["injection"]["course_role_tokens"] == tokens["injection"]["honest_role_tokens"]
    assert tokens["injection"]["hf_default_role_tokens"] > tokens["injection"]["course_role_tokens"]
    quality = out["quality"]["rows"]
    assert quality["reference"]["kl_mean"] == 0 and all(r["kl_mean"] > 0 for k, r in quality.items() if k != "reference")
    prefix = out["prefix"]["layouts"]["shared system prompt"]
    assert 0 < prefix["hit_rate"] < 1 and prefix["first_turn_shared_ids"] >= out["prefix"]["system_prompt_tokens"]
    spec = out["speculative"]["runs"]
    assert {r["method"] for r in spec} == {"prompt lookup", "first 15 of 30 layers"}  # each equal to plain greedy
    engine = out["engine_speculative"]  # its tokens were checked equal with and without drafts
    assert engine["prompts"] == ["edit"] and engine["by_prompt"]["edit"]["tokens"] == 6
    assert engine["engine_steps"] <= engine["plain_engine_steps"] and engine["accepted"] <= engine["drafted"]
    path = R.write_results(out, tmp_path / "quick.json", quick=True)
    assert json.loads(path.read_text())["quick"] is True
    assert R.load_results(path) is None  # a quick file is never figures
    assert R.provenance(None, "quality") == "not yet measured"
    as_file = {"format": "labsupport-real-model", "quick": True, "sections": out}
    for name in QUICK_SECTIONS:
        for render in PAGES[name]:
            text = render(as_file)
            assert "smollm2-135m-instruct" in text and "Convention:" in text, (name, text)
            assert "Not yet measured" in render(None) and "Not yet measured" in render({"sections": {}})
    assert "| weights int4, groups of 64 |" in pages.quality_md(as_file)


def test_committed_results_are_full_and_say_where_they_come_from():
    results = R.load_results()
    if results is None:
        pytest.fail(f"{R.RESULTS_PATH} is missing or quick: run `python -m labsupport.real_model_figures`")
    assert set(results["sections"]) <= set(R.SECTIONS) and {"tokens", "journey"} <= set(results["sections"])
    for name, renders in PAGES.items():
        measured = name in results["sections"]
        if measured:
            text = R.provenance(results, name)
            assert "smollm2-135m-instruct" in text and "Q4_1" in text and results["sections"][name]["quick"] is False
        for render in renders:  # a section never measured says so on its page, and only then
            assert ("Not yet measured" in render(results)) is not measured, name
    assert results["sections"]["journey"]["finish_reason"] == "stop"  # the answer ended at the end-of-turn token
