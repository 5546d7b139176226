"""The learner's serving stack (issue 31): slots as data, assembly from notebooks with cached checks,
and a started server serving through the assembled parts to the official ``openai`` client.

Cost: the assembly runs the checks of labs 01, 12 and 13 (the labs whose parts serve today) once for
the solutions and once for a planted copy (lab 12 is unchanged there, so its checks come from the
cache), then two servers with the real model start from the cached assembly. The other labs' slots
are assembled by ``python -m labsupport stack solutions/`` in full (see the closing note of issue 31
for its cost); here they are not, to keep the suite fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from testhelpers import copy_solutions, plant_part

from labsupport.course import stack as course_stack
from labsupport.engine import Engine
from labsupport.sampling import SamplingParams
from labsupport.serve import ServerProcess
from labsupport.serve.continuous import ContinuousBackend
from labsupport.serve.stack import TokenBytes, load_parts, plug_in
from labsupport.stack import MODES, SLOTS, serving_slots

ROOT = Path(__file__).resolve().parents[1]
LABS = ("01_tokens", "12_engines", "13_decode_loop")  # the labs with a wired slot
NAME = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
ENGINE_SIDE = {"stop_strings", "detokenizer", "prepare_step", "scheduler", "sampler"}  # plug_in's; the model side: test_stack_model.py
SERVER = ["--model", NAME, "--context", 256, "--engine", "continuous", "--max-running", 4, "--num-blocks", 64]


def _slots_of(labs):
    return [s.name for lab in sorted(labs) for s in SLOTS if s.lab == lab]


IGNORES_BUDGET = '''
def schedule_step(running, waiting, token_budget, free_blocks, block_size, max_running):
    return _solution_schedule_step(running, waiting, 10**9, free_blocks, block_size, max_running)
'''
RAISING_SAMPLER = '''
def sample(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None):
    if temperature == 0.123:
        raise RuntimeError("planted: this sampler breaks at temperature 0.123")
    return _solution_sample(logits, temperature, top_k, top_p, generator)
'''
RAISING_STOPS = '''
class StopStringFilter(_solution_StopStringFilter):
    def push(self, text):
        if "BOOM" in self.stops:
            raise RuntimeError("planted: this filter breaks on the stop string BOOM")
        return super().push(text)
'''


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("stack-cache")


@pytest.fixture(scope="module")
def solutions(tmp_path_factory, cache):
    labs_dir = copy_solutions(tmp_path_factory.mktemp("solutions") / "labs", LABS)
    return labs_dir, course_stack.assemble(labs_dir, cache, only=_slots_of(LABS))


@pytest.fixture(scope="module")
def planted(tmp_path_factory, cache, solutions):
    """A copy with a scheduler that ignores the token budget (fails its check), and a sampler and a
    stop-string filter that pass their checks but raise on one request's settings while serving."""
    labs_dir = copy_solutions(tmp_path_factory.mktemp("planted") / "labs", LABS)
    plant_part(labs_dir, "13_decode_loop", "def", "schedule_step", IGNORES_BUDGET)
    plant_part(labs_dir, "13_decode_loop", "def", "sample", RAISING_SAMPLER)
    plant_part(labs_dir, "01_tokens", "class", "StopStringFilter", RAISING_STOPS)
    return labs_dir, course_stack.assemble(labs_dir, cache, only=_slots_of(LABS))


def test_every_slot_is_well_formed_and_names_a_real_check():
    import labsupport.checks as checks

    lab_checks = json.loads((ROOT / "labsupport" / "lab_checks.json").read_text())["labs"]
    assert len({s.name for s in SLOTS}) == len(SLOTS)
    for s in SLOTS:
        assert s.mode in MODES and s.how, s
        assert callable(getattr(checks, s.check)), s
        assert s.check in [c["check"] for c in lab_checks[s.lab]["checks"]], s
        defined = [n for c in lab_checks[s.lab]["cells"] if c["exercise"] for n in c.get("defines", [])]
        assert set(s.names) <= set(defined), s
    assert {s.name for s in serving_slots() if not s.gpu_only} == ENGINE_SIDE | {
        "block_allocator", "speculative_accept", "rope", "dequantize_q8_0", "dequantize_q4_1", "kv_capacity"}


def test_the_solutions_assemble_into_a_stack_of_the_learners_parts(solutions, cache):
    labs_dir, assembly = solutions
    assert [r.slot for r in assembly.rows] == _slots_of(LABS)
    assert all(r.source == "learner" and r.check == "passed" for r in assembly.rows), assembly.table()
    assert {r.slot for r in assembly.rows if r.serves} == {s.name for s in serving_slots() if s.lab in LABS}
    assert assembly.checks_run == len(assembly.rows)
    assert sorted(p.name for p in labs_dir.iterdir()) == [f"{lab}.ipynb" for lab in LABS]  # nothing written there
    again = course_stack.assemble(labs_dir, cache, only=_slots_of(LABS))
    assert again.checks_run == 0  # every result from the cache: no check subprocess ran
    assert [r.to_json() for r in again.rows] == [r.to_json() for r in assembly.rows]
    one = course_stack.assemble(labs_dir, cache, only=["sampler"])  # a subset reads the same cache
    assert one.checks_run == 0 and [r.to_json() for r in one.rows] == [assembly.row("sampler").to_json()]


def test_a_wrong_part_fails_its_check_and_the_course_part_takes_its_slot(planted):
    _, assembly = planted
    scheduler = assembly.row("scheduler")
    assert (scheduler.source, scheduler.check) == ("course", "failed")
    assert "scheduler" not in assembly.learner_parts()
    for slot in ("sampler", "stop_strings", "prepare_step"):  # the planted ones pass their checks
        assert assembly.row(slot).source == "learner", assembly.table()
    assert assembly.checks_run == 5  # labs 01 and 13 changed; lab 12's results came from the cache


def test_a_lab_not_in_the_folder_is_not_done_and_keeps_the_course_part(tmp_path, cache):
    (tmp_path / "labs").mkdir()
    assembly = course_stack.assemble(tmp_path / "labs", cache, only=["scheduler"])
    assert [r.to_json() for r in assembly.rows] == [
        {"slot": "scheduler", "lab": "13_decode_loop", "source": "course", "serves": True, "check": "not done"}]
    assert assembly.checks_run == 0


def test_the_command_prints_json_with_exactly_the_documented_keys(solutions, cache):
    labs_dir, _ = solutions
    out = subprocess.run([sys.executable, "-m", "labsupport", "stack", str(labs_dir), "--cache", str(cache),
                          "--json", "--slot", "sampler", "--slot", "kv_capacity"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [
        {"slot": "kv_capacity", "lab": "12_engines", "source": "learner", "serves": True, "check": "passed"},
        {"slot": "sampler", "lab": "13_decode_loop", "source": "learner", "serves": True, "check": "passed"}]


@pytest.fixture(scope="module")
def course_greedy(smollm2):
    """The course stack's greedy completion of PROMPT, from the course's engine in this process."""
    engine = Engine(smollm2.model, num_blocks=64, block_size=16)
    ids = list(smollm2.tokenizer.encode_prompt(PROMPT))
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=12))[0]
    return smollm2.tokenizer.decode(out, skip_special_tokens=True)


def _client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def test_a_server_with_the_solutions_stack_answers_openai_with_the_course_stacks_text(solutions, cache, smollm2,
                                                                                     course_greedy):
    labs_dir, _ = solutions
    with ServerProcess([*SERVER, "--stack", labs_dir, "--stack-cache", cache], threads=1) as srv:
        client = _client(srv)
        text = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
        assert text == course_greedy  # through lab 12's, 13's and lab 01's detokenizer
        chat = [{"role": "user", "content": "Name a fruit."}]
        whole = client.chat.completions.create(model=NAME, messages=chat, max_tokens=10, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=NAME, messages=chat, max_tokens=10, temperature=0, stream=True) if c.choices)
        assert whole.choices[0].message.content == streamed and streamed
        stopped = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stop=[course_greedy.split()[1]])  # lab 01's filter ends it
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == course_greedy[:course_greedy.index(course_greedy.split()[1])]
    said = "".join(srv.output)
    plugged = said.split("Your stack's parts serve: ")[1].split(".")[0].split(", ")
    assert sorted(plugged) == sorted(ENGINE_SIDE)


def test_a_part_that_raises_while_serving_fails_only_its_requests_and_names_its_slot(planted, cache, smollm2,
                                                                                     course_greedy):
    labs_dir, _ = planted
    with ServerProcess([*SERVER, "--stack", labs_dir, "--stack-cache", cache], threads=1) as srv:
        client = _client(srv)
        with pytest.raises(openai.APIError) as step_wide:  # the sampler is step-wide: the step's requests fail
            client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0.123)
        said = str(step_wide.value)  # the slot, the learner's module file and line, and their exception
        assert "your sampler part" in said and "lab13_decode_loop_" in said and 'raise RuntimeError("planted' in said
        with pytest.raises(openai.APIError) as per_request:  # the stop filter is per request
            client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, stop=["BOOM"])
        said = str(per_request.value)
        assert "your stop_strings part" in said and "lab01_tokens_" in said and "breaks on the stop string" in said
        text = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
        assert text == course_greedy  # the server goes on: the next request is answered


def test_a_part_that_hangs_fails_its_check_when_the_time_limit_passes_and_the_assembly_goes_on(tmp_path):
    module = tmp_path / "lab13_decode_loop_hangs.py"
    module.write_text("import time\n\n\ndef sample(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None):\n"
                      "    time.sleep(600)\n", encoding="utf-8")
    results = course_stack.run_checks(module, "13_decode_loop", [("check_sample", "sample")], timeout_s=3)
    assert results["check_sample"][0] == "failed" and "ran past 3 s" in results["check_sample"][1]


def test_the_learners_detokenizer_reads_the_token_bytes_of_both_served_tokenizers(solutions, cache, smollm2):
    """The course model's tokenizer gives token bytes itself; the real model's (byte-level BPE) through
    TokenBytes. Either way the learner's detokenizer's pieces join to the tokenizer's own decode."""
    labs_dir, _ = solutions
    assert course_stack.assemble(labs_dir, cache, only=_slots_of(LABS)).checks_run == 0  # stack.json: the solutions'
    parts = load_parts(cache / course_stack.MANIFEST_NAME)
    backend = ContinuousBackend()  # the course model (random weights) and the course tokenizer
    assert sorted(plug_in(backend, parts)) == sorted(ENGINE_SIDE)
    text = "Ünïcödé — 日本語 🙂 and  spaces\n"
    for tokenizer, make in ((backend.tokenizer, backend.detokenizer),
                            (smollm2.tokenizer, lambda: parts["detokenizer"][0](TokenBytes(smollm2.tokenizer)))):
        ids = tokenizer.encode(text)
        detok = make()
        assert "".join(detok.push(i) for i in ids) + detok.flush() == tokenizer.decode(ids) == text


@pytest.mark.parametrize("leftover", [lambda: sys.exit(3), lambda: exit(), lambda: (_ for _ in ()).throw(KeyboardInterrupt)])
def test_a_part_that_exits_or_interrupts_becomes_a_failure_of_its_slot_not_of_the_server(leftover, tmp_path):
    from labsupport.serve.stack_guard import PartFailed, guarded
    from labsupport.stack import BY_NAME

    file = tmp_path / "lab13.py"  # the learner's module file: the message names its line
    file.write_text("def sample(fn):\n    return fn()\n")
    namespace: dict = {}
    exec(compile(file.read_text(), str(file), "exec"), namespace)
    part = guarded(BY_NAME["sampler"], namespace["sample"], str(file))
    with pytest.raises(PartFailed, match=r"your sampler part .* at .*lab13\.py:2: return fn\(\)"):
        part(leftover)
