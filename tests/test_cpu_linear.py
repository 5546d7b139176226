"""Weights packed for the CPU (labsupport.cpu_linear): the same model up to float rounding in fp32
and bit for bit in bf16, every entry point running the packed products, and the engine's greedy
tokens still those of the packed model's own generate."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from labsupport import cpu_linear
from labsupport.engine import Engine
from labsupport.models import get_model
from labsupport.sampling import SamplingParams
from labsupport.serve import cli
from labsupport.transformer import Transformer

pytestmark = [pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN"),
              pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
def test_packed_logits_equal_the_models(dtype, tol):
    plain = Transformer(get_model("tiny-2m"), dtype=dtype)
    packed = cpu_linear.prepack(Transformer(get_model("tiny-2m"), dtype=dtype))
    assert cpu_linear.is_packed(packed) and not cpu_linear.is_packed(plain)
    assert packed.param_count() == plain.param_count()  # the packed copies are not parameters
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, *_: calls.append(type(mod).__name__) if isinstance(mod, cpu_linear.PackedLinear) else None)
    prompt = plain.random_prompt(2, 12)
    try:
        got = packed.prefill(prompt, packed.new_cache(2, 12))
    finally:
        handle.remove()
    want = plain.prefill(prompt, plain.new_cache(2, 12))
    assert len(calls) == 4 * plain.cfg.n_layers + 1  # q/k/v, o, gate/up, down per layer, and the head
    assert (got - want).abs().max().item() <= tol


def test_the_engine_on_packed_weights_gives_the_packed_models_generate():
    model = cpu_linear.prepack(Transformer(get_model("tiny-2m")))
    prompts = [model.random_prompt(1, n, seed=n)[0].tolist() for n in (5, 9, 3)]
    engine = Engine(model, num_blocks=24, block_size=4, token_budget=8, max_running=3, clock="steps")
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    for p, out in zip(prompts, outs):
        assert out == model.generate(torch.tensor([p]), 6)[0, len(p):].tolist()


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="Transformer"):
        cpu_linear.prepack(torch.nn.Linear(2, 2))
    model = Transformer(get_model("tiny-2m"))
    assert cpu_linear.prepack(cpu_linear.prepack(model)) is model  # packing twice packs once


def test_the_servers_dtype_and_prepack_options_reach_the_served_model():
    backend = cli._backend(cli.parse_args(["--engine", "continuous", "--dtype", "bfloat16", "--prepack"]))
    assert backend.model.dtype == torch.bfloat16 and cpu_linear.is_packed(backend.model)
    plain = cli._backend(cli.parse_args([]))
    assert plain.model.dtype == torch.float32 and not cpu_linear.is_packed(plain.model)  # the default: the reference
    with pytest.raises(SystemExit):
        cli.parse_args(["--dtype", "int4"])


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_projections_rotate_queries_and_keys_as_the_unfused_model(qk_norm):
    """The fused attention rotates the queries' and keys' heads in one call; a model with q/k norms
    (Qwen3) rotates after its norms, as before (a tolerance: a fused matmul may sum in another order)."""
    cfg = dataclasses.replace(get_model("tiny-2m"), qk_norm=qk_norm)
    plain = Transformer(cfg)
    fused = copy.deepcopy(plain).fuse_projections()
    prompt = plain.random_prompt(2, 9)
    want = plain.prefill(prompt, plain.new_cache(2, 9))
    torch.testing.assert_close(fused.prefill(prompt, fused.new_cache(2, 9)), want, atol=1e-5, rtol=1e-5)


def test_a_packed_model_copied_cast_or_reloaded_packs_the_weights_it_has_now():
    """Packing is not a snapshot: ``copy.deepcopy`` and ``model.to(dtype)`` after packing, and
    ``load_state_dict`` into a packed model, run the weights the model holds (a stale packed copy
    gave the old weights' logits; a deepcopy raised on oneDNN's opaque tensor)."""
    plain = Transformer(get_model("tiny-2m"))
    packed = cpu_linear.prepack(copy.deepcopy(plain))
    prompt = plain.random_prompt(1, 7)
    cast = copy.deepcopy(packed).to(torch.bfloat16)
    want = copy.deepcopy(plain).to(torch.bfloat16)
    assert torch.equal(cast.prefill(prompt, cast.new_cache(1, 7)), want.prefill(prompt, want.new_cache(1, 7)))
    halved = {k: v * 0.5 if v.dim() == 2 else v for k, v in packed.state_dict().items()}
    packed.load_state_dict(halved)
    plain.fuse_projections().load_state_dict({k: v for k, v in halved.items() if not k.startswith("packed_head")})
    torch.testing.assert_close(packed.prefill(prompt, packed.new_cache(1, 7)),
                               plain.prefill(prompt, plain.new_cache(1, 7)), atol=1e-5, rtol=1e-5)


def test_a_packed_layer_moved_off_the_cpu_runs_the_plain_product():
    layer = cpu_linear.PackedLinear(torch.randn(6, 4)).to("meta")  # "meta" stands for a GPU here
    assert layer(torch.randn(3, 4, device="meta")).shape == (3, 6)
