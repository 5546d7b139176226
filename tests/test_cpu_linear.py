"""Weights packed for the CPU (labsupport.cpu_linear): the same model up to float rounding in fp32
and bit for bit in bf16, every entry point running the packed products, and the engine's greedy
tokens still those of the packed model's own generate."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

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


# --- chapter 09's weight-only int8 on the CPU (prepack(model, "int8")) ---------------------------


def _int8_model():
    return cpu_linear.prepack(Transformer(get_model("tiny-2m"), dtype=torch.bfloat16), "int8")


def test_int8_layers_compute_with_their_codes_times_scales():
    """Each layer's weight is ``codes * scales`` (int8, one bf16 scale per output channel): the codes within
    [-127, 127], a row's largest magnitude at 127 and every weight within half a step of its row's scale
    (chapter 09's symmetric rounding); decode rows (torch's int8 kernel) and more rows (oneDNN on the
    weights dequantised to bfloat16) both give that product to bfloat16's rounding, and agree."""
    torch.manual_seed(0)
    weight = torch.randn(24, 32) * torch.linspace(0.1, 3.0, 24)[:, None]  # rows of very different scales
    layer = cpu_linear.Int8Linear(weight)
    assert layer.codes.dtype == torch.int8 and layer.scales.dtype == torch.bfloat16
    assert int(layer.codes.abs().max(dim=1).values.min()) >= 126  # each row's largest weight lands at the top
    scales = layer.scales.float()
    dequant = layer.codes.float() * scales[:, None]  # (N, K)
    assert ((dequant - weight).abs().amax(dim=1) <= 0.51 * scales).all()  # half a step of each row's own scale
    x = torch.randn(cpu_linear.Int8Linear.GEMV_ROWS + 3, 32).to(torch.bfloat16)
    want = x.float() @ dequant.T  # (rows, N)
    small, large = layer(x[:1]).float(), layer(x).float()  # the int8 kernel; oneDNN on the bf16 copy
    for got, ref in ((small, want[:1]), (large, want)):
        assert ((got - ref).abs() <= 2 ** -7 * ref.abs() + 1e-3 * ref.abs().max()).all()  # bf16 rounding
    assert ((small - large[:1]).abs() <= 2 ** -7 * small.abs() + 1e-3 * small.abs().max()).all()
    residual = torch.randn(1, 24).to(torch.bfloat16)
    assert torch.equal(layer(x[:1], residual=residual), residual + layer(x[:1]))


def test_int8_model_runs_int8_products_and_its_engine_gives_its_generate():
    model = _int8_model()
    cache = _filled(model)
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, *_: calls.append(1) if isinstance(mod, cpu_linear.Int8Linear) else None)
    try:
        model.decode_step(torch.tensor([[3]]), cache)
    finally:
        handle.remove()
    assert len(calls) == 4 * model.cfg.n_layers + 1  # every projection and the head
    # one request at a time, each prompt in one step: every product has the rows generate's has (a batch of
    # more than GEMV_ROWS rows would run the bfloat16 path, the same weights rounded in another order)
    prompts = [model.random_prompt(1, n, seed=n)[0].tolist() for n in (5, 9, 3)]
    engine = Engine(model, num_blocks=24, block_size=4, token_budget=16, max_running=1, clock="steps")
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    for p, out in zip(prompts, outs):
        assert out == model.generate(torch.tensor([p]), 6)[0, len(p):].tolist()


def _filled(model):
    cache = model.new_cache(1, 8)
    model.prefill(torch.tensor([[1, 2]]), cache)
    return cache


def test_int8_step_bytes_are_a_quarter_of_float32s_projections():
    fp32 = Transformer(get_model("tiny-2m"))
    int8 = cpu_linear.prepack(copy.deepcopy(fp32).to(torch.bfloat16), "int8")
    cfg = fp32.cfg
    norms = (2 * cfg.n_layers + 1) * cfg.d_model * 2  # bf16 norm weights
    layers = [m for m in int8.modules() if isinstance(m, cpu_linear.Int8Linear)]
    want = sum(m.codes.numel() + m.scales.numel() * 2 for m in layers) + norms
    assert cpu_linear.step_weight_bytes(int8) == want
    assert cpu_linear.step_weight_bytes(fp32) == fp32.param_bytes()
    assert cpu_linear.step_weight_bytes(int8) < 0.3 * fp32.param_bytes()
    untied = Transformer(dataclasses.replace(get_model("tiny-2m"), tied_embeddings=False), dtype=torch.bfloat16)
    packed = cpu_linear.prepack(untied, "int8")  # the unused bf16 output weight is not read by a step
    heads = [m for m in packed.modules() if isinstance(m, cpu_linear.Int8Linear)]
    assert cpu_linear.step_weight_bytes(packed) == sum(m.codes.numel() + m.scales.numel() * 2 for m in heads) + norms


def test_int8_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_linear.prepack(Transformer(get_model("tiny-2m")), "int8")  # a float32 model
    with pytest.raises(ValueError, match="onednn"):
        cpu_linear.prepack(Transformer(get_model("tiny-2m")), "int4")
    with pytest.raises(ValueError, match="bfloat16 activations"):
        cpu_linear.Int8Linear(torch.randn(4, 8))(torch.randn(1, 8))
    with pytest.raises(SystemExit):
        cli.parse_args(["--prepack", "int8"])  # float32 by default: the parser says to add --dtype bfloat16
    packed = cpu_linear.prepack(Transformer(get_model("tiny-2m"), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="already packed as 'onednn'"):
        cpu_linear.prepack(packed, "int8")  # not silently the other format
    assert cpu_linear.packed_format(packed) == "onednn" and cpu_linear.packed_format(_int8_model()) == "int8"
    with pytest.raises(ValueError, match="plain_rows"):
        cpu_linear.prepack(Transformer(get_model("tiny-2m")), plain_rows=4)
    backend = cli._backend(cli.parse_args(["--engine", "continuous", "--dtype", "bfloat16", "--prepack", "int8"]))
    assert isinstance(backend.model.packed_head, cpu_linear.Int8Linear)


def test_a_packed_layer_runs_the_plain_product_for_the_rows_prepack_found_faster():
    """``plain_rows`` (set by prepack where one plain row beats oneDNN's on this CPU): rows up to it run
    ``F.linear`` (bit for bit), more rows the packed product; the residual is added either way."""
    torch.manual_seed(0)
    layer = cpu_linear.PackedLinear(torch.randn(48, 32))
    one, three, residual = torch.randn(1, 32), torch.randn(3, 32), torch.randn(1, 48)
    packed_one = torch.ops.mkldnn._linear_pointwise(one, layer.packed, None, "none", [], "")
    assert torch.equal(layer(one), packed_one)  # plain_rows = 0: always packed
    layer.plain_rows = 1
    assert torch.equal(layer(one), torch.nn.functional.linear(one, layer.weight))
    assert torch.equal(layer(one, residual=residual), residual + torch.nn.functional.linear(one, layer.weight))
    assert torch.equal(layer(three), torch.ops.mkldnn._linear_pointwise(three, layer.packed, None, "none", [], ""))
    assert isinstance(cpu_linear.plain_one_row_is_faster([layer], repeats=3), bool)
    model = cpu_linear.prepack(Transformer(get_model("tiny-2m")))
    rows = {m.plain_rows for m in model.modules() if isinstance(m, cpu_linear.PackedLinear)}
    assert len(rows) == 1 and rows <= {0, 1}  # one choice for the whole model


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_a_float32_packed_projection_adds_the_residual_inside_its_product_to_the_same_bits(rows):
    torch.manual_seed(rows)
    layer = cpu_linear.PackedLinear(torch.randn(40, 24), torch.randn(40))
    x, residual = torch.randn(rows, 24), torch.randn(40, rows).t()  # a non-contiguous residual too
    with torch.no_grad():
        fused = layer(x, residual=residual)
    assert torch.equal(fused, residual + layer(x))
    plain = Transformer(get_model("tiny-2m"))
    model = cpu_linear.prepack(copy.deepcopy(plain), plain_rows=0)
    assert model.layers[0].attention.wo.plain_rows == 0 and model.layers[0].attention.wo.fuses_residual
    prompt = plain.random_prompt(1, 6)
    torch.testing.assert_close(model.prefill(prompt, model.new_cache(1, 6)), plain.prefill(prompt, plain.new_cache(1, 6)),
                               atol=1e-5, rtol=1e-5)


def test_a_packed_layer_with_gradients_on_runs_the_differentiable_product():
    """oneDNN's packed ops have no backward: with gradients on, a packed layer gives the plain product,
    and its input, weight and residual get their gradients."""
    layer = cpu_linear.PackedLinear(torch.nn.Parameter(torch.randn(8, 6)))
    x, residual = torch.randn(2, 6, requires_grad=True), torch.randn(2, 8, requires_grad=True)
    layer(x, residual=residual).sum().backward()
    assert x.grad is not None and residual.grad is not None and layer.weight.grad is not None
    torch.testing.assert_close(x.grad, layer.weight.detach().sum(0).expand(2, 6))


def test_prepack_on_a_packed_model_applies_an_explicit_plain_rows_and_names_the_format():
    model = cpu_linear.prepack(Transformer(get_model("tiny-2m")), plain_rows=0)
    cpu_linear.prepack(model, plain_rows=1)
    assert {m.plain_rows for m in model.modules() if isinstance(m, cpu_linear.PackedLinear)} == {1}
    with pytest.raises(ValueError, match="already packed as 'onednn'"):
        cpu_linear.prepack(model, "int8")  # the format first, not the dtype advice


def test_a_cpu_that_cannot_pack_bf16_runs_the_plain_product(monkeypatch):
    """oneDNN packs bfloat16 only with AVX-512 or AVX-NE-CONVERT (an AVX2-only AMD EPYC refuses it):
    there a bfloat16 PackedLinear keeps no packed copy and gives F.linear's numbers, and prepack works."""
    monkeypatch.setitem(cpu_linear._PACKABLE, torch.bfloat16, False)
    w = torch.randn(24, 16, dtype=torch.bfloat16)
    layer = cpu_linear.PackedLinear(w)
    assert layer.packed is None
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, w))
    r = torch.randn(5, 24, dtype=torch.bfloat16)
    assert torch.equal(layer(x, residual=r), r + F.linear(x, w))
    model = Transformer("tiny-2m", dtype=torch.bfloat16)
    tokens = model.random_prompt(1, 6)
    want = model.forward_no_cache(tokens)
    cpu_linear.prepack(model)
    assert all(m.packed is None for m in model.modules() if isinstance(m, cpu_linear.PackedLinear))
    torch.testing.assert_close(model.forward_no_cache(tokens), want, atol=0, rtol=0)


def test_can_pack_float32_here():
    assert cpu_linear.can_pack(torch.float32)  # every oneDNN build packs float32
