"""The fused CPU decode step (labsupport.cpu_decode): one C call per batch-1 decode step gives the
torch path's logits (float32: up to the order of sums), writes the same keys and values into the
paged cache, serves through the engine with greedy tokens equal to ``generate``'s, and refuses,
with a reason, what it cannot run."""

from __future__ import annotations

import pytest
import torch

from labsupport import cpu_decode, cpu_linear
from labsupport.engine import Engine
from labsupport.models import ModelConfig
from labsupport.sampling import SamplingParams
from labsupport.transformer import Transformer

LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64, "rope_type": "llama3"}


def small(dtype=torch.float32, seed=0, **shape) -> Transformer:
    kw = dict(n_layers=2, d_model=96, n_heads=6, n_kv_heads=2, d_ff=128, vocab_size=300)
    kw.update(shape)
    return Transformer(ModelConfig("fused-test", **kw), dtype=dtype, seed=seed)


def engine_tokens(model, prompts, cpu_decode_mode, max_tokens=12, **kw):
    """Greedy outputs of the engine (one request at a time unless ``together``)."""
    eng = Engine(model, num_blocks=40, block_size=kw.pop("block_size", 4), cpu_decode=cpu_decode_mode,
                 prefix_caching=False, **kw)
    return eng.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens)), eng


def prompt(n, seed=0, vocab=300):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("shape", [
    dict(),  # grouped-query attention, 3 query heads per key/value head
    dict(n_heads=4, n_kv_heads=4, d_model=128, tied_embeddings=True),  # multi-head attention, a tied head
    dict(qkv_bias=True, o_bias=True, rope_scaling=LLAMA3_SCALING),  # Qwen2's biases, Llama 3.1's rotation
])
def test_logits_equal_the_torch_step_and_the_cache_gets_the_same_keys(shape):
    """At every fused step of a request (9 prompt tokens, decode steps across block boundaries), the
    torch path's forward pass on the same metadata and cache gives the same logits and keys/values."""
    model = small(**shape)
    eng = Engine(model, num_blocks=40, block_size=4, cpu_decode="fused", prefix_caching=False)
    runner, store, fused_step, checked = eng.runner, eng.store, eng.runner.fused_step, []

    def compare(meta):
        k0, v0 = store.k.clone(), store.v.clone()
        want = model.logits(runner.forward(meta))  # (1, V): the torch path, which writes the token's keys
        k_want, v_want = store.k.clone(), store.v.clone()
        store.k.copy_(k0), store.v.copy_(v0)
        got = fused_step(meta)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        assert not torch.equal(store.k, k0)
        torch.testing.assert_close(store.k, k_want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(store.v, v_want, atol=1e-6, rtol=1e-5)
        checked.append(int(meta.positions[0]))
        return got

    runner.fused_step = compare
    eng.generate([prompt(9)], SamplingParams(temperature=0, max_tokens=10))
    assert checked == list(range(9, 18))  # every decode step after the prompt's


def test_the_engine_serves_generates_tokens_on_scattered_blocks_and_mixed_steps():
    """Fused batch-1 steps between torch steps (prompts, batches of two): every output equals the
    torch engine's and generate's; the blocks of a sequence are not consecutive (requests interleave)."""
    model = small(seed=3)
    prompts = [prompt(n, seed=n) for n in (5, 11, 3)]
    fused, eng = engine_tokens(model, prompts, "fused", max_tokens=14)
    torch_out, _ = engine_tokens(model, prompts, "torch", max_tokens=14)
    assert fused == torch_out
    for p, out in zip(prompts, fused):
        assert model.generate(torch.tensor([p]), 14)[0, len(p):].tolist() == out


def test_bf16_and_int8_weights_stay_close_to_float32():
    """bfloat16 and int8 weights with float32 activations: logits near the float32 model's (closer than
    the bfloat16 torch path's), the bfloat16 cache written as torch rounds it."""
    ref = small(seed=5, n_layers=3)
    p = prompt(7, seed=5)
    want, _ = engine_tokens(ref, [p], "fused", max_tokens=10)
    for fmt in ("bf16", "int8"):
        model = small(seed=5, n_layers=3).to(torch.bfloat16)
        if fmt == "int8":
            cpu_linear.prepack(model, "int8")
        got, eng = engine_tokens(model, [p], "fused", max_tokens=10)
        assert got == want, fmt
        assert eng.store.k.dtype == torch.bfloat16
    model = small(seed=5, n_layers=3).to(torch.bfloat16)
    eng = Engine(model, num_blocks=40, block_size=4, cpu_decode="fused", prefix_caching=False)
    eng.add_request(p, SamplingParams(temperature=0, max_tokens=3), request_id="a")
    eng.step()
    meta = eng.runner.prepare([(eng.requests["a"], 1)])
    k_before = eng.store.k.clone()
    fused = eng.runner.fused_step(meta)
    k_fused = eng.store.k.clone()
    eng.store.k.copy_(k_before)
    torch_logits = model.logits(eng.runner.forward(meta))
    assert not torch.equal(k_fused, k_before)  # it wrote the token's keys
    torch.testing.assert_close(k_fused, eng.store.k, atol=0.02, rtol=0.02)  # within bfloat16 of torch's
    ref_eng = Engine(ref, num_blocks=40, block_size=4, prefix_caching=False)
    ref_eng.add_request(p, SamplingParams(temperature=0, max_tokens=3), request_id="a")
    ref_eng.step()
    f32 = ref.logits(ref_eng.runner.forward(ref_eng.runner.prepare([(ref_eng.requests["a"], 1)])))
    assert (fused - f32).abs().max() < (torch_logits - f32).abs().max()


def test_packed_models_and_unfused_projections_give_the_same_logits():
    base = small(seed=7)
    packed = small(seed=7)
    cpu_linear.prepack(packed, plain_rows=0)
    p = prompt(6, seed=7)
    a, _ = engine_tokens(base, [p], "fused")  # wq, wk, wv and w1, w3 apart
    b, _ = engine_tokens(packed, [p], "fused")  # wqkv and w13 (prepack fuses them), the packed head
    assert base.layers[0].attention.wqkv is None and packed.layers[0].attention.wqkv is not None
    assert a == b


def test_refusals_say_why():
    assert "qk_norm" in cpu_decode.unsupported(small(qk_norm=True))
    assert "multiple of 8" in cpu_decode.unsupported(small(d_model=60, n_heads=6, n_kv_heads=2))
    hooked = small()
    hooked.layers[1].attention.rope = lambda q, k, positions: (q, k)
    assert "layer 1" in cpu_decode.unsupported(hooked)
    assert cpu_decode.unsupported(small()) is None
    with pytest.raises(ValueError, match="qk_norm.*cpu_decode='torch'"):
        Engine(small(qk_norm=True), num_blocks=8, block_size=4, cpu_decode="fused")
    with pytest.raises(ValueError, match="cpu_decode must be one of"):
        Engine(small(), num_blocks=8, block_size=4, cpu_decode="c")
    eng = Engine(small(), num_blocks=8, block_size=4, max_model_len=16, cpu_decode="fused")
    with pytest.raises(ValueError, match="past the longest sequence"):
        eng.runner.fused.step(1, 16, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="token id"):
        eng.runner.fused.step(300, 3, torch.zeros(4, dtype=torch.int32))


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_decode, "_library", None)
    monkeypatch.setenv("LABSUPPORT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(RuntimeError, match="no C compiler.*cpu_decode='torch'"):
        cpu_decode.build()
    bad = tmp_path / "bad-cc"
    bad.write_text("#!/bin/sh\necho 'cc: error: planted failure' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    with pytest.raises(RuntimeError, match="planted failure"):
        cpu_decode.build()
    assert not list((tmp_path / "cpu_decode").glob("*.so"))  # nothing half-built left behind


def test_real_model_fused_greedy_equals_generate(smollm2):
    """SmolLM2-135M in float32: the fused engine's greedy tokens are generate's."""
    p = [1, 9690, 42, 2114, 314, 253, 4587, 30]
    model = smollm2.model
    out, _ = engine_tokens(model, [p], "fused", max_tokens=24, block_size=16)
    assert out[0] == model.generate(torch.tensor([p]), 24)[0, len(p):].tolist()


def test_a_started_server_with_int8_weights_and_the_fused_step_answers(smollm2):
    """``--dtype bfloat16 --prepack int8 --cpu-decode fused``: the official client gets the answer,
    streamed and whole alike, and the server says how it decodes."""
    import openai

    from labsupport.serve import ServerProcess

    args = ["--model", "smollm2-135m-instruct", "--context", 256, "--engine", "continuous", "--max-running", "2",
            "--dtype", "bfloat16", "--prepack", "int8", "--cpu-decode", "fused"]
    with ServerProcess(args, threads=2) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=120)
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        whole = client.chat.completions.create(model="smollm2-135m-instruct", messages=chat, max_tokens=16,
                                               temperature=0).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smollm2-135m-instruct", messages=chat, max_tokens=16, temperature=0, stream=True) if c.choices)
        assert "Paris" in whole and streamed == whole


def test_the_server_refuses_fused_without_the_engine_or_with_a_stack(capsys):
    from labsupport.serve import cli

    for argv, says in ((["--cpu-decode", "fused"], "needs --engine continuous"),
                       (["--engine", "continuous", "--cpu-decode", "fused", "--stack", "labs"], "past your parts")):
        with pytest.raises(SystemExit):
            cli.parse_args(argv)
        assert says in capsys.readouterr().err
