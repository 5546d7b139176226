"""The engine's greedy tokens against ``Transformer.generate`` alone, on a GPU (chapter 13).

Every other engine test runs on a CPU, where the step's host buffers are the device tensors and
every copy is synchronous. This suite runs the same comparisons where the GPU path is real: pinned
buffers copied without blocking (and their guard, ``model_runner.Copier``), the mixed-batch and
split-KV Triton kernels, CUDA graphs on and off. The scenarios:

* a long prompt chunked at an idle engine: several steps in a row sample nothing, the case the
  buffers' guard exists for; on a GPU every step is queued behind a spin (``gpu_behind``) so that
  the host always refills before the GPU copied, and a planted run without the guard must fail;
* mixed arrivals (requests join while others prefill and decode);
* preemption (too few blocks for everyone);
* prefix hits (requests sharing a long prefix, the later ones finding it cached);
* speculation (n-gram drafts verified in the step's forward pass).

**How tokens are compared.** In fp32 with TF32 off (the Triton kernels use IEEE fp32 dots for fp32)
every token must equal ``generate``'s. In bf16 the engine's and ``generate``'s kernels round
differently, so a near tie may flip: a request passes when its tokens equal the reference's up to
the first difference, and there the engine's token is among the reference's five most likely
(vLLM's ``check_logprobs_close`` in ``tests/models/utils.py``, at 9cfdcd89, stops at the first
divergence after checking each side's token is in the other's top-N logprobs; the engine reports
no logprobs, so only the reference's are checked). The comparison stops there: after a different
token the two sequences are no longer the same problem.

**Weights that decide.** A random model's logits are nearly Gaussian over the vocabulary: the
top-1 margin is often a small fraction of their spread, and greedy choices would be coin flips
that any rounding moves. :func:`decisive_model` scales the output-head rows of a random sixteenth of
the vocabulary by 4: the winner then nearly always comes from those rows, whose logits are spread
four times as wide, so the gap to the runner-up is wide too. ``test_the_weights_decide`` measures it
(the median top-1 margin over the reference's positions, in units of the logits' standard deviation:
on the CPU profile's model 0.18 unscaled, 0.46 with a factor of 2, 0.82 with 4, measured over 30
positions) and fails if it falls below 0.4.

**Profiles.** ``gpu``: a model of about 150M parameters, prompts up to 3,000 tokens, fp32 and
bf16, CUDA graphs on and off (marked ``gpu``, skipped without CUDA; ``scripts/gpu_all.sh`` runs it
first; sized for under 90 s on an H100). ``cpu``: the same test functions on the course's tiny
shape with short prompts, the torch path and the Triton kernels in the interpreter, a few seconds,
in every normal test run, so the suite cannot rot where there is no GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from labsupport.engine import Engine, SpeculativeConfig, TraceRequest, run_trace
from labsupport.engine.model_runner import Copier
from labsupport.engine.sequence import Request
from labsupport.models import ModelConfig, get_model
from labsupport.phases import cpu_threads
from labsupport.sampling import SamplingParams
from labsupport.transformer import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

TOP_N = 5  # the reference's most likely tokens a bf16 difference must be among
FAVOURED_SHARE, FAVOURED_SCALE = 16, 4.0  # decisive_model: 1/16 of the head's rows, scaled by 4
MIN_MEDIAN_MARGIN = 0.4  # in standard deviations of the logits


@dataclass(frozen=True)
class Profile:
    """A device and the sizes the scenarios run at on it."""

    name: str
    device: str
    cfg: ModelConfig
    long_prompt: int  # the prompt chunked at an idle engine
    budget: int  # the token budget per step (chunks of it)
    block_size: int
    prompt_lens: tuple  # mixed arrivals' prompt lengths
    output_len: int
    prefix: int  # the shared prefix of the prefix-hit scenario
    max_running: int


GPU_CFG = ModelConfig("engine-check-150m", 8, 1024, 16, 4, 2816, 32000, tied_embeddings=False,
                      source="a test shape: about 150M parameters")
PROFILES = {
    "cpu": Profile("cpu", "cpu", dataclasses.replace(get_model("tiny-2m"), tied_embeddings=False,
                                                     name="tiny-2m-untied"),
                   long_prompt=40, budget=16, block_size=8, prompt_lens=(3, 21, 7, 12), output_len=5,
                   prefix=16, max_running=3),
    "gpu": Profile("gpu", "cuda", GPU_CFG, long_prompt=3000, budget=512, block_size=16,
                   prompt_lens=(40, 900, 130, 1500, 7, 600, 260, 1100, 75, 350), output_len=32, prefix=1024,
                   max_running=16),
}


def profile_params():
    """The (profile, dtype, attention, cuda_graphs) combinations: on the CPU fp32 with the torch
    path and the Triton kernels (interpreter), and bf16 with the torch path (the interpreter's bf16
    is broken); on a GPU the Triton kernels in fp32 and bf16, CUDA graphs on and off."""
    cpu = [("cpu", torch.float32, "torch", None), ("cpu", torch.float32, "triton", None),
           ("cpu", torch.bfloat16, "torch", None)]
    gpu = [(p, dt, "triton", g) for p in ("gpu",) for dt in (torch.float32, torch.bfloat16) for g in (True, False)]
    marks = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
    return ([pytest.param(*c, id=f"cpu-{str(c[1])[6:]}-{c[2]}") for c in cpu]
            + [pytest.param(*c, id=f"gpu-{str(c[1])[6:]}-graphs-{'on' if c[3] else 'off'}", marks=marks)
               for c in gpu])


SETTINGS = profile_params()


@pytest.fixture(autouse=True)
def _exact_fp32():
    """TF32 off: fp32 matmuls in full precision on a GPU (no effect on a CPU)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with cpu_threads(1):
        yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


_MODELS: dict = {}


def decisive_model(profile: Profile, dtype: torch.dtype) -> Transformer:
    """The profile's model with random weights (seed 0) and a random sixteenth of its output head's
    rows scaled by 4 (module docstring), built once per profile and dtype."""
    key = (profile.name, dtype)
    if key not in _MODELS:
        model = Transformer(profile.cfg, device=profile.device, dtype=torch.float32, seed=0)
        V = profile.cfg.vocab_size
        rows = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:V // FAVOURED_SHARE]
        with torch.no_grad():
            model.output.weight[rows.to(model.device)] *= FAVOURED_SCALE
        _MODELS[key] = model.to(dtype)
    return _MODELS[key]


_REFERENCES: dict = {}


def reference(model: Transformer, prompt: list[int], n: int) -> tuple[list[int], list[set], list[float]]:
    """``generate``'s greedy tokens for ``prompt`` alone, with the reference's top-5 tokens and its
    top-1 margin (in standard deviations of the logits) at each position; computed once per model,
    prompt and length (the settings with CUDA graphs on and off share them)."""
    key = (id(model), tuple(prompt), n)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(model, prompt, n)
    return _REFERENCES[key]


@torch.no_grad()
def _reference(model: Transformer, prompt: list[int], n: int) -> tuple[list[int], list[set], list[float]]:
    """The tokens come from ``model.generate``; the logits from the same calls it makes (prefill,
    then decode steps)."""
    tokens = model.generate(torch.tensor([prompt], device=model.device), n)[0, len(prompt):].tolist()
    cache = model.new_cache(1, len(prompt) + n)
    logits = model.prefill(torch.tensor([prompt], device=model.device), cache)
    tops, margins = [], []
    for i, token in enumerate(tokens):
        row = logits[0].float()
        best = row.topk(TOP_N)
        tops.append(set(best.indices.tolist()))
        margins.append(float((best.values[0] - best.values[1]) / row.std()))
        if i + 1 < n:
            logits = model.decode_step(torch.tensor([[token]], device=model.device), cache)
    return tokens, tops, margins


def mismatch(got: list[int], want: list[int], top: list[set], exact: bool) -> str | None:
    """Why ``got`` fails against the reference ``want`` (None when it passes): exact, every token
    equal; else equal up to the first difference, where ``got``'s token must be among the
    reference's top-5 there, and nothing compared after it."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            if exact:
                return f"token {i}: the engine gave {a}, generate {b} (tokens before: {want[:i]})"
            if a not in top[i]:
                return f"token {i}: the engine gave {a}, not among generate's top {TOP_N} {sorted(top[i])}"
            return None  # a near tie flipped: the sequences diverge from here
    if len(got) != len(want):
        return f"the engine gave {len(got)} tokens, generate {len(want)}"
    return None


def prompts_of(profile: Profile, lengths, seed: int, prefix: list[int] = ()) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(0, profile.cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def engine_for(model, profile: Profile, attention: str, graphs, **kw) -> Engine:
    kw = {"num_blocks": 4096 if profile.device == "cuda" else 256, "block_size": profile.block_size,
          "token_budget": profile.budget, "max_running": profile.max_running, "clock": "steps", **kw}
    return Engine(model, attention=attention, cuda_graphs=graphs, **kw)


def check(model, engine: Engine, rids: dict, prompts: dict, n: int, dtype) -> dict:
    """Compare every request with the reference; returns counts for the scenario's own asserts."""
    exact = dtype == torch.float32
    failures, diverged = [], 0
    for key, rid in rids.items():
        got = engine.requests[rid].output_ids
        want, top, _ = reference(model, prompts[key], n)
        why = mismatch(got, want, top, exact)
        if why:
            failures.append(f"request {key!r} (prompt of {len(prompts[key])}): {why}")
        diverged += got != want
    assert not failures, "; ".join(failures)
    return {"diverged": diverged, **engine.stats()}


# -- the scenarios ------------------------------------------------------------------------------------


GPU_BEHIND_CYCLES = 40_000_000  # about 20 ms of an H100's clock: far longer than the host takes to issue a step


def gpu_behind(engine: Engine) -> None:
    """On a GPU, queue a ``GPU_BEHIND_CYCLES`` spin before the inputs of every step that samples
    nothing: the GPU then runs each such step's copies well after the host has issued the next step
    (the race's condition, which a fast GPU and a small model would otherwise meet only by chance).
    A step that samples waits for the GPU anyway, so it gets no spin. Nothing on a CPU."""
    if engine.runner.device.type != "cuda":
        return
    prepare = engine.runner.prepare

    def behind(batch):
        if not any(req.samples_after(n) for req, n in batch):
            torch.cuda._sleep(GPU_BEHIND_CYCLES)
        return prepare(batch)

    engine.runner.prepare = behind


def chunked_prompt(p: Profile, dtype, attention: str, graphs) -> tuple:
    """One request alone at an idle engine whose GPU is held behind (:func:`gpu_behind`), its
    prompt in budget-sized chunks; returns the model, the engine, the request id and the prompt."""
    model = decisive_model(p, dtype)
    engine = engine_for(model, p, attention, graphs)
    gpu_behind(engine)
    (prompt,) = prompts_of(p, [p.long_prompt], seed=1)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=p.output_len))
    for _ in engine.stream():
        pass
    assert engine.steps[0].sampled == 0 and engine.steps[1].sampled == 0  # two steps in a row sample nothing
    return model, engine, rid, prompt


@pytest.mark.parametrize("name, dtype, attention, graphs", SETTINGS)
def test_a_long_prompt_chunked_at_an_idle_engine(name, dtype, attention, graphs):
    """One request alone, its prompt in budget-sized chunks: every step but the last samples
    nothing, so only the buffers' guard orders one chunk's copies before the next chunk's refill
    (on a GPU held behind the host, so that the next refill always comes first without it)."""
    p = PROFILES[name]
    model, engine, rid, prompt = chunked_prompt(p, dtype, attention, graphs)
    check(model, engine, {0: rid}, {0: prompt}, p.output_len, dtype)


@pytest.mark.parametrize("name, dtype, attention, graphs", SETTINGS)
def test_mixed_arrivals_and_preemption(name, dtype, attention, graphs):
    """Requests arrive while others prefill and decode, in a cache too small for all of them."""
    p = PROFILES[name]
    model = decisive_model(p, dtype)
    prompts, n = prompts_of(p, p.prompt_lens, seed=2), 2 * p.output_len
    per_seq = [-(-(len(q) + n) // p.block_size) for q in prompts]
    engine = engine_for(model, p, attention, graphs, num_blocks=max(per_seq) + 1)  # the longest, and one block
    trace = [TraceRequest(float(i // 2), tuple(q), SamplingParams(temperature=0, max_tokens=n))  # two per step
             for i, q in enumerate(prompts)]
    done = run_trace(engine, trace)
    stats = check(model, engine, {i: r.request_id for i, r in enumerate(done)}, dict(enumerate(prompts)), n, dtype)
    assert stats["preemptions"] > 0


@pytest.mark.parametrize("name, dtype, attention, graphs", SETTINGS)
def test_prefix_hits(name, dtype, attention, graphs):
    """Requests sharing a long prefix: the first computes it, the later ones find it cached."""
    p = PROFILES[name]
    model = decisive_model(p, dtype)
    (prefix,) = prompts_of(p, [p.prefix], seed=3)
    prompts = prompts_of(p, [5, 1, 17, 9], seed=4, prefix=prefix)
    engine = engine_for(model, p, attention, graphs)
    params = SamplingParams(temperature=0, max_tokens=p.output_len)
    rids = {0: engine.add_request(prompts[0], params)}
    for _ in engine.stream():
        pass
    rids |= {i: engine.add_request(prompts[i], params) for i in range(1, len(prompts))}
    for _ in engine.stream():
        pass
    stats = check(model, engine, rids, dict(enumerate(prompts)), p.output_len, dtype)
    assert stats["prefix_cache_hits"] >= 3 * (p.prefix // p.block_size) * p.block_size


@pytest.mark.parametrize("name, dtype, attention, graphs", SETTINGS)
def test_speculation(name, dtype, attention, graphs):
    """N-gram drafts verified in the step's forward pass, beside prefill chunks of other requests."""
    p = PROFILES[name]
    model = decisive_model(p, dtype)
    gen = torch.Generator().manual_seed(5)
    motifs = [torch.randint(0, p.cfg.vocab_size, (n,), generator=gen).tolist() for n in (3, 4, 5)]
    prompts = [m * (p.prompt_lens[1] // len(m) + 1) for m in motifs]  # repetitive: prompt lookup finds drafts
    engine = engine_for(model, p, attention, graphs, speculative=SpeculativeConfig(num_speculative_tokens=4))
    params = SamplingParams(temperature=0, max_tokens=p.output_len)
    rids = {i: engine.add_request(q, params) for i, q in enumerate(prompts)}
    for _ in engine.stream():
        pass
    stats = check(model, engine, rids, dict(enumerate(prompts)), p.output_len, dtype)
    assert stats["spec_draft_tokens"] > 0


@pytest.mark.parametrize("name", ["cpu", pytest.param("gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_the_weights_decide(name):
    """The scaled head makes greedy choices clear: the median top-1 margin along the reference's
    positions is at least 0.4 standard deviations of the logits (module docstring)."""
    p = PROFILES[name]
    model = decisive_model(p, torch.float32)
    margins = []
    for q in prompts_of(p, p.prompt_lens, seed=2):
        margins += reference(model, q, p.output_len)[2]
    margins.sort()
    assert margins[len(margins) // 2] >= MIN_MEDIAN_MARGIN, f"median top-1 margin {margins[len(margins) // 2]:.3f}"


@pytest.mark.parametrize("name", ["cpu", pytest.param("gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_a_speculative_step_sends_its_rows_without_waiting_for_the_gpu(name):
    """``ModelRunner.verify_rows`` (the rows a speculative step verifies) runs before the forward pass
    is queued: on a GPU it must not wait for the stream (a copy from pageable memory would, and the
    GPU would idle while the host issues the forward pass). CUDA's sync debug mode raises on any
    synchronising call; the GPU is kept busy meanwhile, so a wait would be a real one."""
    p = PROFILES[name]
    engine = engine_for(decisive_model(p, torch.float32), p, "torch" if name == "cpu" else "triton", False)
    req = Request(0, [1, 2, 3], SamplingParams(), 0.0, None, output_ids=[5], num_computed=3, draft_ids=[7, 8])
    assert req.samples_after(3)  # its last sampled token and two drafts: 3 rows, the batch's first three
    if name == "gpu":
        torch.cuda.synchronize()
        torch.cuda._sleep(GPU_BEHIND_CYCLES)
        torch.cuda.set_sync_debug_mode("error")
    try:
        rows = engine.runner.verify_rows([(req, 3)])
    finally:
        if name == "gpu":
            torch.cuda.set_sync_debug_mode("default")
    assert rows.device.type == engine.runner.device.type and rows.tolist() == [0, 1, 2]


def test_the_comparison_rule():
    """fp32: any difference fails; bf16: a difference among the reference's top 5 passes and ends the
    comparison, one outside fails."""
    top = [{1, 2, 3, 4, 5}] * 3
    assert mismatch([1, 2, 3], [1, 2, 3], top, exact=True) is None
    assert "token 1" in mismatch([1, 9, 3], [1, 2, 3], top, exact=True)
    assert mismatch([1, 4, 7], [1, 2, 3], top, exact=False) is None  # 4 in the top 5; nothing after compared
    assert "not among" in mismatch([1, 9, 3], [1, 2, 3], top, exact=False)
    assert "2 tokens" in mismatch([1, 2], [1, 2, 3], top, exact=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_without_the_guard_the_chunked_prompt_goes_wrong(monkeypatch):
    """The planted mistake: the same scenario with the guard's wait removed must give other tokens
    (each chunk's copies read the host buffers after later chunks refilled them), or the scenario
    above could not catch a missing guard. Last in the file: a run on wrong inputs must not
    disturb the others."""
    monkeypatch.setattr(Copier, "wait", lambda self, mark: None)
    p = PROFILES["gpu"]
    model, engine, rid, prompt = chunked_prompt(p, torch.float32, "triton", False)
    want, top, _ = reference(model, prompt, p.output_len)
    assert mismatch(engine.requests[rid].output_ids, want, top, exact=True) is not None, (
        "without the guard the engine still gave generate's tokens: the GPU was not behind the host")
