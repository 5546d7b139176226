"""The model side of the learner's stack (issue 31): lab 08's RoPE, lab 09's GGUF dequantisers and lab
12's kv_capacity serving the real model (SmolLM2-135M-Instruct), and the Triton kernels' slots (labs
07, 08 and 10) checked beside the course's kernels on one forward pass on a CPU. Their GPU path runs in
``tests/gpu/test_stack_kernels.py`` (a dry run in the interpreter here, the real thing on a GPU).

Cost (measured 2026-12-06 on this 2-core machine while other sessions loaded it, load average 5-6):
about 80 s for the file, 62 CPU-s; on a quiet machine expect well under a minute, still more than
the 30 s aimed at. The assembly runs the checks of labs 08, 09 and 12's model-side slots once for the solutions and
once for a planted copy (its wrong parts fail their checks at the first case), then once more for lab
08 with a rotation that passes its check but raises on one step; one server starts from that cached
assembly. The first run on a machine also reads the GGUF file's blocks with the solutions'
dequantisers once (about 10 s); that conversion is cached in the course's cache folder, so later runs
read it in about 2 s. The kernels' checks run in Triton's interpreter, on the first layers only.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import nbformat
import openai
import pytest
import torch

from labsupport.checkpoints import cache_dir_for, cache_root, registered_path
from labsupport.costs import param_count
from labsupport.course import stack as course_stack
from labsupport.course.manifest import load_course_cells
from labsupport.device import interpreter_mode
from labsupport.engine import Engine
from labsupport.models import get_model
from labsupport.sampling import SamplingParams
from labsupport.serve import ServerProcess
from labsupport.serve.stack import load_parts
from labsupport.serve.stack_model import (
    CPU_CHECK_LAYERS,
    KERNEL_SLOTS,
    MODEL_SLOTS,
    check_kernels_on_cpu,
    kernels_serve,
    model_side,
    owner_of,
    plug_kernels,
)
from labsupport.stack import BY_NAME
from labsupport.transformer import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")  # Triton's interpreter

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m-instruct"
LABS = ("08_position", "09_precision", "12_engines")
SERVING = ["rope", "dequantize_q8_0", "dequantize_q4_1", "kv_capacity"]  # the model-side slots that serve on a CPU
PLANTED = [*SERVING, "fused_rope"]
QUESTIONS = ("What is the capital of France?", "Name three fruits.", "Write one sentence about the sea.")
CONTEXT, BLOCK, RUNNING = 256, 16, 4

# Wrong parts, one per slot: each keeps the solution's function as _solution_<name> and calls it wrongly.
WRONG = {
    "rope": ("08_position", "apply_rope", '''
def apply_rope(x, positions, theta, layout):
    return _solution_apply_rope(x, positions, 10000.0, layout)  # planted: always RoFormer's base
'''),
    "fused_rope": ("08_position", "fused_rope", '''
def fused_rope(q, k, positions, inv_freq):
    return _solution_fused_rope(q, k, positions + 1, inv_freq)  # planted: every position one too far
'''),
    "dequantize_q8_0": ("09_precision", "dequantize_q8_0", '''
def dequantize_q8_0(raw):
    return _solution_dequantize_q8_0(raw).abs()  # planted: the codes' signs lost
'''),
    "dequantize_q4_1": ("09_precision", "dequantize_q4_1", '''
def dequantize_q4_1(raw):
    b = raw.contiguous().reshape(raw.shape[0], -1, 20)
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    qs = b[..., 4:].to(torch.int16)
    q = torch.stack([qs & 0xF, qs >> 4], dim=-1).flatten(-2).float()  # planted: nibbles as neighbours
    return (d * q + m).reshape(raw.shape[0], -1)
'''),
    "kv_capacity": ("12_engines", "kv_capacity", '''
def kv_capacity(cfg, gpu_memory_gib, max_model_len, gpu_memory_utilization=0.9, block_size=16,
                kv_dtype_bytes=2, weight_dtype_bytes=2, reserve_gib=0.0):
    return _solution_kv_capacity(cfg, gpu_memory_gib, max_model_len, gpu_memory_utilization, block_size,
                                 kv_dtype_bytes, 0, reserve_gib)  # planted: the weights take no memory
'''),
    "flash_attention": ("07_attention", "flash_attention", '''
def flash_attention(q, k, v, causal=False):
    return _solution_flash_attention(q, k, v, False)  # planted: the causal mask forgotten
'''),
    "paged_attention": ("10_cache_ops", "paged_attention", '''
def paged_attention(q, k_cache, v_cache, block_tables, seq_lens):
    return _solution_paged_attention(q, k_cache, v_cache, block_tables, seq_lens - 1)  # planted: the newest token left out
'''),
}
# Passes check_apply_rope (whose bases are 10,000 and 500,000) and raises on a step of SmolLM2 that is
# one 13-token prompt from its start.
RAISING_ROPE = '''
def apply_rope(x, positions, theta, layout):
    if theta == 100000.0 and x.shape[-2] == 13 and int(positions[0]) == 0:
        raise RuntimeError("planted: this rotation breaks on a 13-token step of SmolLM2")
    return _solution_apply_rope(x, positions, theta, layout)
'''


def plant(nb, name: str, extra: str) -> None:
    """Rename the solution's ``def name(`` to ``def _solution_name(`` in its cell and append ``extra``."""
    cells = [c for c in nb.cells if c.cell_type == "code" and f"def {name}(" in c.source]
    assert len(cells) == 1, f"{name} is defined in {len(cells)} cells"
    cells[0].source = cells[0].source.replace(f"def {name}(", f"def _solution_{name}(") + "\n\n" + extra


def copy_labs(labs_dir: Path, labs, planted: dict[str, str] | None = None) -> Path:
    """The solutions' notebooks of ``labs`` in ``labs_dir``, with ``planted`` (slot -> code) planted."""
    labs_dir.mkdir(parents=True)
    for lab in labs:
        nb = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
        for slot, extra in (planted or {}).items():
            if WRONG[slot][0] == lab:
                plant(nb, WRONG[slot][1], extra)
        nbformat.write(nb, labs_dir / f"{lab}.ipynb")
    return labs_dir


def module_parts(folder: Path, tag: str, wanted: dict[str, str | None]) -> dict:
    """The parts of ``wanted`` (slot -> planted code, or None for the solution's) as the server loads
    them, from module files the assembly's namespace rule writes (no checks run: the kernels' own are
    run by their labs' notebooks and tests/checks)."""
    by_lab: dict[str, list[str]] = {}
    for slot in wanted:
        by_lab.setdefault(WRONG[slot][0], []).append(slot)
    entries = {}
    for lab, slots in by_lab.items():
        nb = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
        for slot in slots:
            if wanted[slot] is not None:
                plant(nb, WRONG[slot][1], wanted[slot])
        text, _ = course_stack.module_text(lab, load_course_cells(lab), nb)
        path = folder / f"lab{lab}_{tag}.py"
        path.write_text(text, encoding="utf-8")
        entries.update({slot: {"lab": lab, "file": str(path), "name": WRONG[slot][1]} for slot in slots})
    manifest = folder / f"stack-{tag}.json"
    manifest.write_text(json.dumps({"parts": entries}), encoding="utf-8")
    return load_parts(manifest)


def chat_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def greedy(model, prompts, stop_ids, max_tokens: int = 16) -> list[list[int]]:
    """Each prompt's greedy tokens from the course's engine on ``model``, ending at a stop id (as the
    server stops them)."""
    engine = Engine(model, num_blocks=RUNNING * CONTEXT // BLOCK, block_size=BLOCK, max_running=RUNNING)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=tuple(stop_ids))
    return engine.generate(prompts, params)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("stack-model-cache")


@pytest.fixture(scope="module")
def solutions(tmp_path_factory, cache):
    """The solutions of labs 08, 09 and 12 assembled (the slots that serve on a CPU), and their parts."""
    labs_dir = copy_labs(tmp_path_factory.mktemp("solutions") / "labs", LABS)
    assembly = course_stack.assemble(labs_dir, cache, only=SERVING)
    return labs_dir, assembly, load_parts(cache / course_stack.MANIFEST_NAME)


@pytest.fixture(scope="module")
def course_greedy(smollm2):
    return greedy(smollm2.model, chat_prompts(smollm2.tokenizer), smollm2.tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def learner_model(solutions):
    """The real model loaded through the solutions' dequantisers, with the course's cache entry's
    modification time read before (it must not change)."""
    course_entry = cache_dir_for(registered_path(NAME)) / "model.safetensors"
    before = course_entry.stat().st_mtime_ns if course_entry.exists() else None
    side = model_side(solutions[2])
    served = side.load(NAME)
    return side, served, before


def test_every_model_side_slot_is_wired_and_the_kernels_serve_only_where_triton_compiles():
    for name in MODEL_SLOTS:
        slot = BY_NAME[name]
        assert slot.wired and slot.mode == "serves" and "not wired" not in slot.how, slot
        assert slot.gpu_only == (name in KERNEL_SLOTS), slot
    assert all(BY_NAME[name].serves for name in SERVING)
    assert not any(BY_NAME[name].serves for name in KERNEL_SLOTS) or torch.cuda.is_available()


def test_the_solutions_parts_serve_the_real_model_and_give_the_course_stacks_greedy_text(
        solutions, learner_model, smollm2, course_greedy):
    _, assembly, parts = solutions
    assert [(r.slot, r.source, r.check) for r in assembly.rows] == [
        (s, "learner", "passed") for s in ("rope", "dequantize_q8_0", "dequantize_q4_1", "kv_capacity")]
    side, served, _ = learner_model
    assert side.loaded == ["dequantize_q8_0", "dequantize_q4_1"]
    course_state = smollm2.model.state_dict()
    assert all(torch.equal(v, course_state[k]) for k, v in served.model.state_dict().items())  # bit for bit
    # a right kv_capacity gives the course's default cache from the default budget, and follows a given one
    assert side.num_blocks(served.model, CONTEXT, BLOCK, RUNNING) == RUNNING * CONTEXT // BLOCK
    per_block = BLOCK * 2 * 30 * 3 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads of 64, float32
    assert side.num_blocks(served.model, CONTEXT, BLOCK, RUNNING, memory_gib=1.0) == int(
        (2**30 - param_count(served.model.cfg) * 4) // per_block)
    assert side.plug(served.model) == ["dequantize_q8_0", "dequantize_q4_1", "kv_capacity", "rope"]
    assert all(layer.attention.rope is not None for layer in served.model.layers)
    assert all(layer.attention.rope is None for layer in smollm2.model.layers)  # the course's model untouched
    assert greedy(served.model, chat_prompts(smollm2.tokenizer), smollm2.tokenizer.eos_token_ids) == course_greedy


def test_the_learners_conversion_is_cached_apart_from_the_courses(solutions, learner_model, tmp_path):
    labs_dir, _, parts = solutions
    _, _, before = learner_model
    course = cache_dir_for(registered_path(NAME))
    owner = model_side(parts).dequantizers().owner
    mine = cache_dir_for(registered_path(NAME), owner)
    assert mine != course and mine.parent == course.parent == cache_root() and mine.name.endswith(owner)
    assert json.loads((mine / "labsupport.json").read_text())["dequantizers"] == owner
    assert "dequantizers" not in json.loads((course / "labsupport.json").read_text())
    assert (course / "model.safetensors").stat().st_mtime_ns == before  # the course's entry was not rewritten
    assert sorted(p.name for p in labs_dir.iterdir()) == [f"{lab}.ipynb" for lab in LABS]  # nothing written there
    changed = tmp_path / "changed.py"  # another cell, another owner: its own entry
    changed.write_text(Path(parts["dequantize_q4_1"][1]).read_text() + "\n# an edit\n")
    assert owner_of([changed]) != owner
    file = parts["dequantize_q4_1"][1]  # one of the two the course's: a mixed conversion, an entry of its own
    assert owner_of([file], ("Q8_0",)) != owner_of([file], ("Q4_1", "Q8_0")) == owner


def test_a_wrong_part_in_each_model_slot_fails_its_check_and_the_course_part_stays(tmp_path_factory):
    cache = tmp_path_factory.mktemp("planted-cache")
    labs_dir = copy_labs(tmp_path_factory.mktemp("planted") / "labs", LABS,
                         {slot: WRONG[slot][2] for slot in PLANTED})
    assembly = course_stack.assemble(labs_dir, cache, only=PLANTED)
    for slot in PLANTED:
        row = assembly.row(slot)
        assert (row.source, row.check) == ("course", "failed"), (slot, row.message)
    assert model_side(load_parts(cache / course_stack.MANIFEST_NAME)).parts == {}  # the server takes none of them


def test_a_kv_capacity_that_raises_or_gives_too_little_stops_the_start_up_with_a_message(tmp_path, smollm2):
    module = tmp_path / "lab12_engines_planted.py"
    module.write_text("def kv_capacity(cfg, gib, max_len, **settings):\n"
                      "    if gib > 100:\n"
                      "        raise RuntimeError('planted: no such GPU')\n"
                      "    return {'num_blocks': 3, 'tokens': 48, 'max_requests': 0}\n", encoding="utf-8")
    manifest = tmp_path / "stack.json"
    manifest.write_text(json.dumps({"parts": {"kv_capacity": {"lab": "12_engines", "file": str(module),
                                                              "name": "kv_capacity"}}}))
    side = model_side(load_parts(manifest))
    with pytest.raises(ValueError) as raised:
        side.num_blocks(smollm2.model, CONTEXT, BLOCK, RUNNING, memory_gib=200.0)
    said = str(raised.value)
    assert "your kv_capacity part" in said and "lab12_engines_planted.py:3" in said and "planted: no such GPU" in said
    with pytest.raises(ValueError, match="3 blocks of 16 tokens .* fewer than one request .* raise --kv-memory-gib"):
        side.num_blocks(smollm2.model, CONTEXT, BLOCK, RUNNING, memory_gib=1.0)


def test_the_kernels_are_checked_beside_the_courses_on_one_forward_pass_on_a_cpu(tmp_path, smollm2):
    right = module_parts(tmp_path, "right", dict.fromkeys(KERNEL_SLOTS))
    said = check_kernels_on_cpu(smollm2.model, right)
    assert sorted(said) == sorted(KERNEL_SLOTS)
    assert all(s.startswith("checked on CPU") and f"first {CPU_CHECK_LAYERS} layers" in s for s in said.values()), said
    # wrong attention kernels (fused_rope's wrong rotation fails its lab check in the planted assembly
    # above) and a rotation that raises
    wrong = module_parts(tmp_path, "wrong", {"flash_attention": WRONG["flash_attention"][2],
                                             "paged_attention": WRONG["paged_attention"][2], "fused_rope": '''
def fused_rope(q, k, positions, inv_freq):
    raise RuntimeError("planted: no rotation today")
'''})
    said = check_kernels_on_cpu(smollm2.model, wrong)
    assert said["flash_attention"].startswith("FAILED the check on CPU"), said
    assert said["paged_attention"].startswith("FAILED the check on CPU"), said
    assert ("your fused_rope part" in said["fused_rope"] and "lab08_position_wrong.py" in said["fused_rope"]
            and "no rotation today" in said["fused_rope"]), said
    assert all("rope" not in layer.attention.__dict__ for layer in smollm2.model.layers)  # hooks taken out again


@pytest.fixture(scope="module")
def served_labs(tmp_path_factory, cache, solutions):
    """Labs 08 and 09: the solutions, lab 08's rotation planted to raise on a 13-token step (it passes
    its check). Lab 09's check results come from the solutions' assembly (the same cache)."""
    labs_dir = copy_labs(tmp_path_factory.mktemp("served") / "labs", LABS[:2], {"rope": RAISING_ROPE})
    assembly = course_stack.assemble(labs_dir, cache)
    assert assembly.row("rope").source == "learner" and assembly.row("fused_rope").source == "learner", assembly.table()
    return labs_dir


def test_a_server_through_the_model_side_answers_openai_and_goes_on_after_a_part_raises(
        served_labs, cache, smollm2, course_greedy):
    tok = smollm2.tokenizer
    words = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen".split()
    trigger = next(" ".join(words[:n]) for n in range(1, len(words)) if len(tok.encode_prompt(" ".join(words[:n]))) == 13)
    assert all(len(p) != 13 for p in chat_prompts(tok))
    args = ["--model", NAME, "--context", CONTEXT, "--engine", "continuous", "--max-running", RUNNING,
            "--stack", served_labs, "--stack-cache", cache]
    with ServerProcess(args, threads=1) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=120)
        chat = [{"role": "user", "content": QUESTIONS[0]}]
        whole = client.chat.completions.create(model=NAME, messages=chat, max_tokens=16, temperature=0)
        expected = tok.decode(course_greedy[0], skip_special_tokens=True)
        assert whole.choices[0].message.content == expected
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=NAME, messages=chat, max_tokens=16, temperature=0, stream=True) if c.choices)
        assert streamed == expected
        with pytest.raises(openai.APIError) as failed:  # rope is step-wide: the step's requests fail
            client.completions.create(model=NAME, prompt=trigger, max_tokens=4, temperature=0)
        said = str(failed.value)
        assert "your rope part" in said and "lab08_position_" in said and "planted: this rotation breaks" in said
        again = client.chat.completions.create(model=NAME, messages=chat, max_tokens=16, temperature=0)
        assert again.choices[0].message.content == expected  # the server goes on, with the learner's parts
    out = "".join(srv.output)
    assert "Your stack's model-side parts serve: dequantize_q8_0, dequantize_q4_1, rope." in out
    assert "fused_rope: checked on CPU" in out


def counting(part, slot: str, calls: Counter):
    """``part`` counting its calls in ``calls[slot]``."""
    def call(*args, **kwargs):
        calls[slot] += 1
        return part(*args, **kwargs)
    return call


def kernel_run(model, parts, prompts, max_tokens: int, calls: Counter | None = None, **engine):
    """Greedy tokens of ``prompts`` from a course engine on ``model``, through ``parts``' kernels where
    given (counted in ``calls``)."""
    eng = Engine(model, num_blocks=64, block_size=16, max_running=8, cuda_graphs=False, **engine)
    if parts:
        counted = {slot: (counting(part, slot, calls), file) for slot, (part, file) in parts.items()}
        assert plug_kernels(eng, counted) == list(KERNEL_SLOTS)
    return eng.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))


def test_the_kernels_gpu_path_serves_in_a_dry_run_in_the_interpreter(tmp_path):
    """plug_kernels on a CPU, in Triton's interpreter: the course's tiny shape (random weights, 4 query
    heads on 2 KV heads), prompts of equal and unequal lengths in one step (flash's groups), then
    decodes (paged) and a prompt that hits the prefix cache (a step the kernels leave to the course's)."""
    parts = module_parts(tmp_path, "dry", dict.fromkeys(KERNEL_SLOTS))
    cfg = get_model("tiny-2m")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 5, 20)]
    prompts.append(prompts[3][:16] + prompts[0])  # finds prompt 3's first block in the prefix cache
    reference = kernel_run(Transformer(cfg, seed=0), None, prompts, 6, attention="torch")
    calls = Counter()
    got = kernel_run(Transformer(cfg, seed=0), parts, prompts, 6, calls, attention="triton")
    assert got == reference
    assert all(calls[slot] > 0 for slot in KERNEL_SLOTS), calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or interpreter_mode(), reason="needs a CUDA GPU (Triton compiling)")
def test_on_a_gpu_the_learners_kernels_serve_the_real_model_with_the_course_stacks_tokens(tmp_path, smollm2):
    """The solutions' three kernels serving SmolLM2 in fp32 (TF32 off) on a GPU: every greedy token equals
    the course's Triton kernels' (CUDA graphs off on both sides), and each kernel ran."""
    assert kernels_serve("cuda")
    parts = module_parts(tmp_path, "gpu", dict.fromkeys(KERNEL_SLOTS))
    prompts = [*chat_prompts(smollm2.tokenizer), smollm2.tokenizer.encode_prompt(" ".join(QUESTIONS * 12))]
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        reference = kernel_run(copy.deepcopy(smollm2.model).to("cuda"), None, prompts, 32)
        calls = Counter()
        got = kernel_run(copy.deepcopy(smollm2.model).to("cuda"), parts, prompts, 32, calls)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert got == reference
    assert all(calls[slot] > 0 for slot in KERNEL_SLOTS), calls
