"""The capstone (lab 16): the learner's serving stack and the course's, run on one trace side by side.

Chapter 16 explains all of it. A **trace** (:class:`Trace`) is a stated set of chat prompts sent at
Poisson arrival times, greedy, with a token limit and a ``"\\n\\n"`` stop; :func:`run_stack` sends it
to a started server with the client parts it is given (lab 03's ``stream_events`` and lab 15's
``poisson_arrivals`` and ``open_loop``: the learner's where their checks passed, else the course's,
:func:`client_parts`) and keeps the **raw run records**: per request its send time, its content
chunks' arrival times, its text, its finish reason or error, and its sampled token ids (read back from
the server's request timeline); per server its ``/health`` before and after (the profile by slot and
the prefix cache's counts, :mod:`labsupport.serve.stack`) and its ``/metrics`` histograms.

:func:`report` (the course's answer to the lab's exercise) computes every figure of the capstone's
report from those records only, so a check can recompute them: requests served, greedy agreement
per request (:func:`greedy_agreement`, vLLM's rule), TTFT and TPOT percentiles (nearest rank, chapter
03's convention), output tokens per second and the prefix cache's hit rate. :func:`slot_costs` turns
the profiles into what each slot cost per engine step, and :func:`where_to_look` names the part to
look at where the learner's stack is slower.

This module imports nothing of ``labsupport.course``: the lab assembles through the command
``python -m labsupport stack`` (:func:`assemble`) and reads the ``stack.json`` it writes.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ._answers import answer
from ._validate import positive_int, positive_number
from .stack import BY_NAME, SLOTS

MODEL = "smollm2-135m-instruct"
STACKS = ("yours", "course")  # the run's two stacks, the learner's first
CLIENT_SLOTS = ("sse_client", "latency_metrics", "poisson_arrivals", "open_loop", "histogram_quantile", "slo_report")
RECORDED = Path(__file__).resolve().parents[1] / "results" / "cpu_capstone.json"  # chapter 16's run (main())
#: Slots whose part the trace calls on every run once it serves (each request is detokenized and has a stop
#: string; every step is scheduled, assembled and sampled). Other serving slots may run only at start-up
#: (kv_capacity, the dequantisers) or in modes the trace does not use (speculative_accept).
CALLED_BY_THE_TRACE = ("stop_strings", "detokenizer", "prepare_step", "scheduler", "sampler")
TOP_LOGPROBS = 5  # vLLM's tests compare against the reference's top 5 (check_logprobs_close's callers)

#: The stated prompt set: short chat questions whose greedy answers on SmolLM2-135M-Instruct are short.
PROMPTS = (
    "What is the capital of France?",
    "Name three primary colours.",
    "What does a CPU do?",
    "How many legs does a spider have?",
    "Give one tip for sleeping well.",
    "What is water made of?",
    "Name a planet with rings.",
    "Say hello in Spanish.",
    "What is 12 times 12?",
    "Why is the sky blue?",
    "Suggest a name for a black cat.",
    "What is the largest ocean?",
)


@dataclass(frozen=True)
class Trace:
    """What is sent: ``requests`` chat requests, prompt ``i`` being ``PROMPTS[i % len(PROMPTS)]``,
    at Poisson arrivals of ``rate`` per second drawn from ``random.Random(seed)``, greedy, at most
    ``max_tokens`` tokens each, ending early at ``stop``."""

    requests: int = 10
    rate: float = 4.0
    max_tokens: int = 24
    seed: int = 16
    stop: tuple[str, ...] = ("\n\n",)

    def __post_init__(self):
        positive_int("requests", self.requests)
        positive_number("rate", self.rate)
        positive_int("max_tokens", self.max_tokens)

    def prompt(self, i: int) -> str:
        return PROMPTS[i % len(PROMPTS)]

    def payload(self, i: int, model: str = MODEL) -> dict:
        """Request ``i`` as the JSON body of ``POST /v1/chat/completions`` (streamed, greedy)."""
        return {"model": model, "messages": [{"role": "user", "content": self.prompt(i)}], "stream": True,
                "temperature": 0, "max_tokens": self.max_tokens, "stop": list(self.stop)}


#: The trace on a CPU (the solution notebook runs it in well under a minute) and a bigger one for a GPU.
PRESETS = {"cpu": Trace(), "gpu": Trace(requests=64, rate=16.0, max_tokens=128)}


def server_options(trace: Trace, *, max_running: int = 16) -> list[str]:
    """The options both servers start with (``python -m labsupport.serve``): the real model on chapter
    13's engine, room for every request of ``trace`` at once."""
    context = 256 if trace.max_tokens <= 64 else 512
    # No --num-blocks: the course's server takes its default (--max-running requests at the full
    # --context), and in yours lab 12's kv_capacity sizes the cache for the same budget, so a right
    # answer gives both stacks the same number of blocks.
    return ["--model", MODEL, "--engine", "continuous", "--context", str(context), "--max-running",
            str(max_running), "--max-requests", str(max(64, trace.requests))]


# --- assembly: which parts are whose ------------------------------------------------------------------


#: Slots wired to serve that this run leaves out, and why. Every other serving slot serves the run: the
#: dequantisers and kv_capacity at start-up (the model is the Q4_1 GGUF file), the rest on every step.
LEFT_OUT = {
    "speculative_accept": "the run serves your sampler, and with speculative decoding on (--num-speculative-tokens) "
                          "the engine samples with its own, so the run does not speculate; tests/test_stack_engine.py "
                          "serves your acceptance rule",
}


def run_slots() -> list[str]:
    """The slots the capstone's run uses: every slot wired to serve today that the run calls (not
    :data:`LEFT_OUT`), the Triton kernels (they serve on a GPU; on a CPU the server checks them beside
    the course's on one forward pass at start-up), the slots checked while serving (``prefix_cache``,
    replayed beside the engine's pool), and the client's slots."""
    wired = [s.name for s in SLOTS if s.serves or (s.wired and (s.mode == "checked" or s.gpu_only))]
    return [name for name in wired if name not in LEFT_OUT] + list(CLIENT_SLOTS)


def assemble(labs_dir, cache_dir, slots: Sequence[str] | None = None) -> dict:
    """Assemble ``slots`` (default :func:`run_slots`) from the notebooks in ``labs_dir`` with
    ``python -m labsupport stack`` (checks in subprocesses, cached by content in ``cache_dir``) and
    return the ``stack.json`` it wrote: ``"rows"`` (slot, lab, source, check, message...) and
    ``"parts"`` (slot -> module file and name of each learner's part)."""
    slots = run_slots() if slots is None else list(slots)
    command = [sys.executable, "-m", "labsupport", "stack", str(labs_dir), "--cache", str(cache_dir)]
    for name in slots:
        command += ["--slot", name]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"assembling your stack failed: {(done.stderr or done.stdout).strip()[-800:]}")
    return json.loads((Path(cache_dir) / "stack.json").read_text(encoding="utf-8"))


def find_notebook(labs_dir: Path, lab: str) -> Path | None:
    """The notebook of ``lab`` in ``labs_dir``, found as the assembly finds it (``<lab>.ipynb``, else
    the one ``NN_*.ipynb``)."""
    exact = Path(labs_dir) / f"{lab}.ipynb"
    if exact.exists():
        return exact
    found = sorted(Path(labs_dir).glob(f"{lab[:2]}_*.ipynb"))
    return found[0] if len(found) == 1 else None


def serving_folder(labs_dir, into) -> Path:
    """A folder ``into`` of links to the learner's notebooks of the labs with a slot that serves in this
    run (:func:`run_slots`, read from :data:`labsupport.stack.SLOTS`, so newly wired slots come in by
    themselves). A
    server started with ``--stack`` on it assembles only those labs, from the same cache, instead of
    checking every lab; nothing is written in ``labs_dir``."""
    into = Path(into)
    into.mkdir(parents=True, exist_ok=True)
    for lab in sorted({BY_NAME[name].lab for name in run_slots() if BY_NAME[name].mode == "serves"}):
        found = find_notebook(Path(labs_dir), lab)
        link = into / f"{lab}.ipynb"
        if found is not None and not link.exists():
            link.symlink_to(found.resolve())
    return into


def _course_client_parts() -> dict[str, Callable]:
    from . import latency, load_testing, prometheus, sse  # sse needs httpx, the serve extra's, at call time

    return {"sse_client": sse.stream_events, "latency_metrics": latency.latency_metrics,
            "poisson_arrivals": load_testing.poisson_arrivals, "open_loop": load_testing.open_loop,
            "histogram_quantile": prometheus.histogram_quantile_between, "slo_report": load_testing.slo_report}


def client_parts(stack: dict) -> tuple[dict[str, Callable], dict[str, str]]:
    """The client's parts for the run: slot -> function, the learner's where the assembly
    (``stack``, :func:`assemble`'s answer) gave it to them, else the course's; and slot -> whose."""
    parts, whose, modules = _course_client_parts(), {}, {}
    for name in CLIENT_SLOTS:
        where = stack.get("parts", {}).get(name)
        whose[name] = "course"
        if where is None:
            continue
        file = where["file"]
        if file not in modules:
            spec = importlib.util.spec_from_file_location(Path(file).stem, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            modules[file] = module
        parts[name], whose[name] = getattr(modules[file], where["name"]), "learner"
    return parts, whose


def labs_dir() -> Path:
    """The folder of the learner's lab notebooks: ``$LABSUPPORT_LABS_DIR`` where the grader set it (the
    graded notebook's folder), else the notebook's own folder (the working directory)."""
    return Path(os.environ.get("LABSUPPORT_LABS_DIR") or ".").resolve()


def writable_cache() -> Path:
    """The assembly's cache: ``$LABSUPPORT_CACHE/stack`` where it can be written, else a folder in
    the temporary directory (in the grader's sandbox the home folder is read-only)."""
    home = Path(os.environ.get("LABSUPPORT_CACHE") or Path.home() / ".cache" / "labsupport").expanduser() / "stack"
    try:
        home.mkdir(parents=True, exist_ok=True)
        probe = home / f".writable-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        return home
    except OSError:
        return Path(tempfile.gettempdir()) / "labsupport-stack"


# --- the run --------------------------------------------------------------------------------------


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _histograms(base: str) -> dict[str, dict[str, float]]:
    """``{metric: {le: cumulative count}}`` of the server's TTFT and inter-token histograms."""
    from .load_testing import scrape_metrics
    from .prometheus import bucket_counts

    samples = scrape_metrics(base)
    return {name: bucket_counts(samples, "course:" + name)
            for name in ("time_to_first_token_seconds", "inter_token_latency_seconds")}


def _sampled_ids(base: str, request_id: str) -> list[int]:
    timeline = _get_json(f"{base}/v1/requests/{request_id}/timeline")
    return [e["token"] for e in timeline["events"] if e["stage"] == "sampled"]


def run_stack(base_url: str, trace: Trace, parts: dict[str, Callable], model: str = MODEL) -> dict:
    """Send ``trace`` to the server at ``base_url`` (``http://host:port``) with the client ``parts``
    (:func:`client_parts`) and return the raw run records (module docstring). Times are seconds of
    ``time.monotonic`` from the run's start."""
    import httpx  # the serve extra's

    base = base_url.rstrip("/").removesuffix("/v1")
    warm = {**trace.payload(0, model), "stream": False, "max_tokens": 2}  # the first forward pass's one-off costs
    httpx.post(base + "/v1/chat/completions", json=warm, timeout=120).raise_for_status()
    arrivals = list(parts["poisson_arrivals"](trace.requests, trace.rate, random.Random(trace.seed)))
    before, hist_before = _get_json(base + "/health"), _histograms(base)
    start = time.monotonic()

    def send(i: int) -> dict:
        record = {"i": i, "id": None, "sent_s": time.monotonic() - start, "token_times_s": [], "text": "",
                  "finish_reason": None, "error": None, "token_ids": []}
        try:
            with httpx.Client(timeout=120) as client:
                for arrived, chunk in parts["sse_client"](client, base + "/v1/chat/completions", trace.payload(i, model)):
                    record["id"] = record["id"] or chunk.get("id")
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content") or ""
                        if piece:
                            record["text"] += piece
                            record["token_times_s"].append(arrived - start)
                        record["finish_reason"] = choice.get("finish_reason") or record["finish_reason"]
            if record["id"]:
                record["token_ids"] = _sampled_ids(base, record["id"])
        except Exception as exc:  # noqa: BLE001 - a failed request is a record, the trace goes on
            record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        return record

    records = parts["open_loop"](arrivals, send)
    duration = time.monotonic() - start
    after, hist_after = _get_json(base + "/health"), _histograms(base)
    return {"trace": asdict(trace), "arrivals_s": arrivals, "records": records, "duration_s": duration,
            "health_before": before, "health_after": after, "histograms_before": hist_before,
            "histograms_after": hist_after}


def reference_top_logprobs(model, tokenizer, prompt: str, ids: Sequence[int], k: int = TOP_LOGPROBS) -> list[dict]:
    """The reference's top ``k`` log-probabilities at each of ``ids``' positions: one forward pass of
    the course model (``checkpoints.load(MODEL)``) over the chat prompt followed by ``ids``. Only
    needed where a request's text differs from the reference's (:func:`greedy_agreement`)."""
    import torch

    prompt_ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    tokens = torch.tensor([prompt_ids + list(ids)], device=model.device)
    with torch.no_grad():  # every position at once, no cache: (1, S, d), then the positions that chose ids
        hidden = model(tokens, model.contiguous_batch(None, 0, tokens.shape[1]))
        logits = model.logits(hidden[0, len(prompt_ids) - 1:len(prompt_ids) - 1 + len(ids)]).float()
    top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    return [{int(i): float(v) for i, v in zip(row_i.tolist(), row_v.tolist())}
            for row_i, row_v in zip(top.indices, top.values)]


def add_reference_logprobs(run: dict, model, tokenizer) -> int:
    """For every request whose text differs between the two stacks, add ``"top_logprobs"`` to the
    course's record (:func:`reference_top_logprobs`). Returns how many requests needed it."""
    needed = 0
    for mine, ref in zip(run["yours"]["records"], run["course"]["records"]):
        if mine["text"] != ref["text"] and ref["token_ids"] and "top_logprobs" not in ref:
            prompt = Trace(**{**run["trace"], "stop": tuple(run["trace"]["stop"])}).prompt(ref["i"])
            ref["top_logprobs"] = reference_top_logprobs(model, tokenizer, prompt, ref["token_ids"])
            needed += 1
    return needed


# --- the report -----------------------------------------------------------------------------------


@answer
def greedy_agreement(reference: dict, candidate: dict) -> tuple[bool, int | None]:
    """Whether ``candidate``'s greedy answer equals ``reference``'s (two run records), and the index of
    the first token where their sampled ids differ (None where they never do).

    Equal texts agree. Otherwise the rule of vLLM's model tests (``check_logprobs_close`` in
    ``tests/models/utils.py``) decides, for a part that is not bit-exact by nature: walk both
    sequences of token ids; at the first position where they differ, the candidate's token must be
    among the reference's top log-probabilities there (``reference["top_logprobs"][i]``, a dict of
    token id to log-probability), and nothing after that position is compared, since the sequences
    diverge from there. vLLM also asks the reference's token to be in the candidate's top
    log-probabilities; the learner's stack reports none, so only the reference's side is checked here.
    Texts that differ while the ids never do (a detokenizer or a stop filter that is wrong) disagree."""
    if candidate.get("error") or reference.get("error"):
        return False, None
    if candidate["text"] == reference["text"]:
        return True, None
    ref_ids, ids = reference["token_ids"], candidate["token_ids"]
    for i, (a, b) in enumerate(zip(ref_ids, ids)):
        if a != b:
            top = (reference.get("top_logprobs") or [])
            return (i < len(top) and b in {int(k) for k in top[i]}), i
    return False, None


def nearest_rank(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile by nearest rank (chapter 03's convention): the ``ceil(p * n / 100)``-th
    smallest; None for no values."""
    data = sorted(values)
    return data[max(1, math.ceil(p * len(data) / 100)) - 1] if data else None


PERCENTILES = (50, 90, 99)


def _served(record: dict) -> bool:
    return not record.get("error") and bool(record["token_times_s"]) and record.get("finish_reason") in ("stop", "length")


@answer
def stack_figures(stack: dict) -> dict:
    """The figures of one stack's run (``run["yours"]`` or ``run["course"]``), from its records only:
    ``served``; ``ttft_s`` and ``tpot_s`` at :data:`PERCENTILES` over the served requests (TTFT: first
    content chunk's arrival minus the send; TPOT: the rest of the request's time over its other
    chunks, chapter 03); ``output_tokens_per_s``: sampled tokens of the served requests over the wall
    time from the first send to the last chunk; ``prefix_cache_hit_rate``: prompt tokens found in the
    cache over prompt tokens looked up during the run (the change in ``/health``'s counts)."""
    done = [r for r in stack["records"] if _served(r)]
    ttft = [r["token_times_s"][0] - r["sent_s"] for r in done]
    tpot = [(r["token_times_s"][-1] - r["token_times_s"][0]) / (len(r["token_times_s"]) - 1)
            for r in done if len(r["token_times_s"]) > 1]
    if done:
        wall = max(r["token_times_s"][-1] for r in done) - min(r["sent_s"] for r in stack["records"])
        throughput = sum(len(r["token_ids"]) for r in done) / wall if wall > 0 else None
    else:
        throughput = None
    cache = [stack[h].get("stack_profile", {}).get("prefix_cache", {}) for h in ("health_before", "health_after")]
    queries = cache[1].get("prefix_cache_queries", 0) - cache[0].get("prefix_cache_queries", 0)
    hits = cache[1].get("prefix_cache_hits", 0) - cache[0].get("prefix_cache_hits", 0)
    return {"served": len(done),
            "ttft_s": {p: nearest_rank(ttft, p) for p in PERCENTILES},
            "tpot_s": {p: nearest_rank(tpot, p) for p in PERCENTILES},
            "output_tokens_per_s": throughput,
            "prefix_cache_hit_rate": hits / queries if queries else None}


def prefix_cache_check(stack: dict) -> dict | None:
    """What the server said at the end of ``stack``'s run (``GET /health``: ``stack_prefix_cache``) of
    the learner's prefix cache replayed beside the engine's pool (lab 10); None where it was not replayed."""
    return stack.get("health_after", {}).get("stack_prefix_cache")


@answer
def report(run: dict) -> dict:
    """The capstone's report from a run's raw records (chapter 16): ``requests`` in the trace;
    ``agree``, per request, whether your stack's greedy answer equals the course's
    (:func:`greedy_agreement`); and for each stack (``"yours"``, ``"course"``) its
    :func:`stack_figures`."""
    pairs = zip(run["course"]["records"], run["yours"]["records"])
    return {"requests": run["trace"]["requests"],
            "agree": [greedy_agreement(ref, mine)[0] for ref, mine in pairs],
            **{name: stack_figures(run[name]) for name in STACKS}}


def new_run(trace: Trace, yours: dict, course: dict, stack: dict) -> dict:
    """The capstone's run: the trace, each stack's raw records (:func:`run_stack`), and under
    ``yours["serving"]`` the slots whose part was the learner's in the server (from the assembly,
    ``stack``)."""
    serving = [r["slot"] for r in stack.get("rows", []) if r["source"] == "learner" and r["serves"]]
    return {"trace": asdict(trace), "yours": {**yours, "serving": serving}, "course": course}


def slot_costs(stack: dict) -> dict[str, float]:
    """Seconds per engine step of each timed slot during the run (``/health``'s ``stack_profile``,
    after minus before), with the whole step under ``"step"``; {} where the server kept no profile."""
    before, after = (stack[h].get("stack_profile", {}).get("slots", {}) for h in ("health_before", "health_after"))
    diff = {name: (v["calls"] - before.get(name, {}).get("calls", 0), v["seconds"] - before.get(name, {}).get("seconds", 0.0))
            for name, v in after.items()}
    steps = diff.get("step", (0, 0.0))[0]
    return {name: seconds / steps for name, (_, seconds) in diff.items()} if steps else {}


def where_to_look(run: dict, margin: float = 1.1) -> str:
    """One sentence: whether your stack's steps were slower than the course's (by more than
    ``margin`` times), and which of your parts took the most of your step."""
    yours, course = slot_costs(run["yours"]), slot_costs(run["course"])
    if "step" not in yours or "step" not in course:
        return "no step profile in this run (the servers were not started with --stack)"
    parts = sorted(((s, t) for s, t in yours.items() if s != "step"), key=lambda x: -x[1])
    ratio = yours["step"] / course["step"]
    if ratio <= margin:
        return (f"your stack's steps took {ratio:.2f}x the course's ({yours['step'] * 1e3:.2f} ms against "
                f"{course['step'] * 1e3:.2f} ms): not slower, within noise")
    if not parts:
        return (f"your stack's steps took {ratio:.2f}x the course's, but none of your parts serves in the "
                f"step: the difference is the machine's noise; run again")
    slot, seconds = parts[0]
    gap, mine = yours["step"] - course["step"], sum(t for _, t in parts)
    said = (f"your stack's steps took {ratio:.2f}x the course's ({yours['step'] * 1e3:.2f} ms against "
            f"{course['step'] * 1e3:.2f} ms); your parts took {mine * 1e3:.2f} ms of each step, the most your "
            f"{slot} part (lab {BY_NAME[slot].lab[:2]}, {seconds * 1e3:.2f} ms)")
    if mine < gap / 2:
        return (said + f": less than half the {gap * 1e3:.2f} ms gap, so most of it is outside your parts "
                f"(the machine's load, or a course part your stack runs differently): run both again")
    return said + ": look at it first"


def planted(run: dict, change: Callable[[dict], None]) -> dict:
    """A deep copy of ``run`` with ``change`` applied to it (for the checks' planted runs)."""
    out = copy.deepcopy(run)
    change(out)
    return out


# --- the whole run, for the chapter's recorded figures ------------------------------------------------


def side_by_side(labs_dir, trace: Trace, cache=None) -> dict:
    """What the lab does, in one call: assemble ``labs_dir``'s stack, start both servers, run
    ``trace`` against each (yours first), stop them; the run (:func:`new_run`), with the reference's
    top log-probabilities where an answer differs."""
    from .serve import ServerProcess  # the server's packages (the serve extra) only when a run is made

    cache = Path(cache) if cache is not None else writable_cache()
    stack = assemble(labs_dir, cache)
    parts, _ = client_parts(stack)
    work = Path(tempfile.mkdtemp(prefix="capstone-"))
    serving = serving_folder(labs_dir, work / "yours")
    (work / "none").mkdir()
    options = server_options(trace)
    servers = [ServerProcess([*options, "--stack", serving, "--stack-cache", cache], threads=1, startup_timeout_s=600),
               ServerProcess([*options, "--stack", work / "none", "--stack-cache", work / "course-cache"], threads=1,
                             startup_timeout_s=600)]
    try:
        for server in servers:
            server.start()
        yours, course = (run_stack(server.url, trace, parts) for server in servers)
    finally:
        for server in servers:
            server.stop()
    run = new_run(trace, yours, course, stack)
    if any(a["text"] != b["text"] for a, b in zip(yours["records"], course["records"])):
        from .checkpoints import load

        reference = load(MODEL, verbose=False)
        add_reference_logprobs(run, reference.model, reference.tokenizer)
    return run


def load_recorded(path=None) -> dict:
    """The run :func:`main` recorded (default :data:`RECORDED`), with ``"recorded"``: device, date."""
    path = Path(path) if path is not None else RECORDED
    run = json.loads(path.read_text(encoding="utf-8"))
    if not {"device", "date"} <= set(run.get("recorded", {})):
        raise ValueError(f"{path} does not say on which machine and when it was recorded: record it again with "
                         f"python -m labsupport.capstone --out {path}")
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m labsupport.capstone --labs solutions --out results/cpu_capstone.json``: the lab's run
    on this machine, saved with the machine and the date for chapter 16's figures."""
    # it imports torch and the real-model helpers: only this command needs it
    from .real_model_figures import cpu_name

    p = argparse.ArgumentParser(prog="python -m labsupport.capstone", description=main.__doc__)
    p.add_argument("--labs", default="solutions", help="the folder of lab notebooks whose stack runs")
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--out", required=True, help="where the run goes (JSON)")
    args = p.parse_args(argv)
    run = side_by_side(args.labs, PRESETS[args.preset])
    for name in STACKS:  # the histograms are the lab's; the chapter reads the records and the profiles
        run[name].pop("histograms_before", None)
        run[name].pop("histograms_after", None)
    run["recorded"] = {"device": f"{cpu_name()}, {os.cpu_count()} cores ({platform.machine()})",
                       "date": time.strftime("%Y-%m-%d", time.gmtime()), "labs": str(args.labs),
                       "preset": args.preset}
    Path(args.out).write_text(json.dumps(run, indent=None, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {where_to_look(run)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
