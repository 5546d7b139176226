"""The kernels' launch configurations fit every GPU the hardware table names.

Triton compiles for any target without a GPU, so these tests compile the reference attention kernel
for sm_75 (T4), sm_80 (A100), sm_89 (L4) and sm_90 (H100, H200) with the configuration
``kernel_config`` picks for each card, and compare the shared memory the compiler reports with
that card's limit. (Before this test, a T4 got 128x32 tiles whose kernel needs 81,920 bytes
against its 65,536: lab 07 crashed on Colab's free GPU.) bf16 is compiled only where its pick
differs from fp16's: the same tiles of 2-byte elements take the same shared memory.

The decode kernels no GPU has run yet (split-KV paged decode and its combine, the mixed-batch paged
attention, the slot write, the int8 matrix-vector and split-K kernels) are compiled too, for
sm_90 in bf16 and, where a T4 would run them, sm_75 in fp16, with the tiles the course picks on
those cards: the interpreter accepts a ``tl.dot`` of any shape and never counts shared memory, a
GPU compiler does both.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from labsupport import attention as A
from labsupport.hardware import GPUS

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _cases():
    """(gpu name, capability, limit, dtype name, head dim, config) to compile, one per distinct pick
    (a bf16 pick equal to the fp16 one on the same card is the fp16 case's twin)."""
    seen, cases = set(), []
    for gpu in GPUS.values():
        for dtype_name, dtype in DTYPES.items():
            if dtype == torch.bfloat16 and gpu.compute_capability < (8, 0):
                continue  # no bf16 on a T4: the labs use fp16 there
            for head_dim in (64, 128) if dtype != torch.float16 else (64, 128, 256):
                config = A.kernel_config(8192, 8192, head_dim, dtype, interpreter=False,
                                         shared_memory=gpu.shared_memory_per_block)
                key = (gpu.compute_capability, gpu.shared_memory_per_block, dtype_name, head_dim, config)
                twin = (*key[:2], "float16", *key[3:])
                if key not in seen and not (dtype == torch.bfloat16 and twin in seen):
                    seen.add(key)
                    cases.append((gpu.name, *key))
    return cases


# The decode kernels, compiled with the tiles they launch with: (name, module, kernel, capability,
# element type, pointer types, constexprs, warps, stages). Llama 3.1 8B's attention (32 query heads, 8
# KV heads, head dim 128, 16-token pages) and its projections (groups of 128).
_ATTN = dict(HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=64, IEEE=False)
DECODE_KERNELS = [
    ("split-KV decode", "flash_decoding", "split_kv_decode_kernel", (9, 0), "bf16",
     {"bt_ptr": "*i32", "len_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_m_ptr": "*fp32", "mid_l_ptr": "*fp32"},
     dict(H=32, GROUP=4, GROUP_PAD=16, NUM_SPLITS=8, **_ATTN), 4, 3),
    ("split-KV decode", "flash_decoding", "split_kv_decode_kernel", (7, 5), "fp16",
     {"bt_ptr": "*i32", "len_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_m_ptr": "*fp32", "mid_l_ptr": "*fp32"},
     dict(H=32, GROUP=4, GROUP_PAD=16, NUM_SPLITS=8, **_ATTN), 4, 3),
    ("split combine", "flash_decoding", "combine_splits_kernel", (9, 0), "bf16",
     {"mid_o_ptr": "*fp32", "mid_m_ptr": "*fp32", "mid_l_ptr": "*fp32"},
     dict(H=32, HEAD_DIM=128, D_PAD=128, NUM_SPLITS=8, SPLITS_PAD=8), 4, 3),
    ("mixed-batch paged attention", "batch_attention", "paged_attention_kernel", (9, 0), "bf16",
     {"bt_ptr": "*i32", "len_ptr": "*i32", "cu_ptr": "*i32", "tile_seq_ptr": "*i32", "tile_first_ptr": "*i32"},
     dict(GROUP=4, BLOCK_Q=4, BLOCK_M=16, **_ATTN), 4, 3),
    ("slot write", "batch_attention", "store_kv_kernel", (9, 0), "bf16", {"slot_ptr": "*i64"},
     dict(KV_HEADS=8, HEAD_DIM=128, ROW_PAD=1024, BLOCK_T=16), 4, 3),
    ("int8 matrix-vector", "int8_matmul", "int8_gemv_kernel", (9, 0), "bf16", {"w_ptr": "*i8", "s_ptr": "*fp32"},
     dict(M_PAD=4, BLOCK_N=16, BLOCK_K=128, SPLIT_K=1), 4, 4),
    ("int8 split-K tiles, H200's 64 rows", "int8_matmul", "int8_matmul_splitk_kernel", (9, 0), "bf16",
     {"w_ptr": "*i8", "s_ptr": "*fp32", "out_ptr": "*fp32"},
     dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, SPLIT_K=4, IEEE=False), 4, 6),
    ("int8 split-K tiles, T4's 64 rows", "int8_matmul", "int8_matmul_splitk_kernel", (7, 5), "fp16",
     {"w_ptr": "*i8", "s_ptr": "*fp32", "out_ptr": "*fp32"},
     dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, SPLIT_K=4, IEEE=False), 4, 4),
]
SHARED = {tuple(g.compute_capability): g.shared_memory_per_block for g in GPUS.values()}


COMPILE = r"""
import json, sys, torch
from labsupport import attention as A
out = []
for name, cc, limit, dtype, d, cfg in json.loads(sys.stdin.read()):
    c = A.KernelConfig(*cfg)
    out.append(A.compiled_shared_memory(c, d, getattr(torch, dtype), tuple(cc)))
hopper = A.compile_for(A.KernelConfig(128, 64, 8, 3), 128, torch.bfloat16, (9, 0))
ampere = A.compile_for(A.KernelConfig(128, 64, 8, 3), 128, torch.bfloat16, (8, 0))
import importlib, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
decode = []
for name, module, kernel, cc, elem, types, consts, warps, stages in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module("labsupport." + module), kernel)
    sig = {a: "constexpr" if a in consts else types.get(a, "*" + elem if a.endswith("_ptr") else
                                                       "fp32" if a == "sm_scale" else "i32") for a in fn.arg_names}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", cc[0] * 10 + cc[1], 32),
                       options={"num_warps": warps, "num_stages": stages})
    decode.append(int(k.metadata.shared))
print(json.dumps(out))
print(json.dumps(decode))
print(json.dumps({"hopper_wgmma": hopper.asm["ptx"].count("wgmma.mma_async"),
                  "hopper_mma_sync": hopper.asm["ptx"].count("mma.sync"),
                  "ampere_mma_sync": ampere.asm["ptx"].count("mma.sync")}))
"""


@pytest.fixture(scope="module")
def compiled():
    cases = _cases()
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    payload = json.dumps([[n, list(cc), lim, dt, d, [c.block_m, c.block_n, c.num_warps, c.num_stages]]
                          for n, cc, lim, dt, d, c in cases])
    run = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(DECODE_KERNELS)], input=payload,
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    return list(zip(cases, json.loads(lines[-3]))), json.loads(lines[-1]), json.loads(lines[-2])


def test_every_gpu_in_the_table_has_its_limits():
    for gpu in GPUS.values():
        assert gpu.compute_capability >= (7, 5) and gpu.shared_memory_per_block >= 64 * 1024, gpu.name


def test_picked_configurations_compile_within_each_gpus_shared_memory(compiled):
    for (name, cc, limit, dtype, d, config), shared in compiled[0]:
        assert shared <= limit, f"{name} (sm_{cc[0]}{cc[1]}), {dtype}, head dim {d}: {config} needs {shared} B > {limit}"
        # the bound kernel_config plans with really is an upper bound of what the compiler uses
        assert shared <= A.shared_memory_bound(config, d, DTYPES[dtype].itemsize), (name, dtype, d, config, shared)


def test_t4_gets_a_configuration_that_fits_and_hopper_keeps_the_large_one():
    t4, h100 = GPUS["T4"], GPUS["H100 SXM"]
    c = A.kernel_config(4096, 4096, 128, torch.float16, interpreter=False, shared_memory=t4.shared_memory_per_block)
    assert (c.block_m, c.block_n, c.num_stages) == (64, 32, 2)
    c = A.kernel_config(4096, 4096, 128, torch.bfloat16, interpreter=False,
                        shared_memory=h100.shared_memory_per_block)
    assert c == A.KernelConfig(128, 64, 8, 3)


def test_the_ladder_shrinks_and_ends_at_the_smallest_tiles():
    bounds = [A.shared_memory_bound(c, 128, 2) for c in A.GPU_CONFIGS]
    assert bounds == sorted(bounds, reverse=True) and len(set(bounds)) == len(bounds)
    assert A.smaller_configs(A.GPU_CONFIGS[0]) == list(A.GPU_CONFIGS[1:])
    four = A.smaller_configs(A.KernelConfig(128, 64, 4, 3))  # a small head's choice keeps 4 warps
    assert four[0] == A.KernelConfig(128, 64, 4, 2) and all(c.num_warps == 4 for c in four)
    assert A.smaller_configs(A.GPU_CONFIGS[-1]) == []
    # a configuration too large for anything still gets the smallest tiles, not an error
    assert A.kernel_config(64, 64, 256, torch.float32, interpreter=False, shared_memory=1) == A.GPU_CONFIGS[-1]


class _OutOfResources(Exception):
    """Stands in for triton.runtime.errors.OutOfResources (matched by name)."""


_OutOfResources.__name__ = "OutOfResources"


def test_a_launch_that_runs_out_of_resources_steps_down_and_says_so(monkeypatch):
    """The fallback path, driven through the interpreter: the first two launches fail as a GPU's
    would when the compiled kernel needs more shared memory than the card has."""
    monkeypatch.setattr(A, "kernel_config", lambda *a, **k: A.GPU_CONFIGS[0])
    monkeypatch.setattr(A, "_stepped_down", {})
    real = A.flash_attention_forward_kernel
    tried, failures = [], [2]

    class Failing:
        def __getitem__(self, grid):
            def launch(*args, BLOCK_M, BLOCK_N, num_stages, **kwargs):
                tried.append((BLOCK_M, BLOCK_N, num_stages))
                if failures[0]:
                    failures[0] -= 1
                    raise _OutOfResources("out of resource: shared memory, Required: 163840, Hardware limit: 65536")
                return real[grid](*args, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_stages=num_stages, **kwargs)
            return launch

    monkeypatch.setattr(A, "flash_attention_forward_kernel", Failing())
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = A.__dict__["flash_attention_reference"].__wrapped__(q, k, v, True)
    assert tried[:3] == [(128, 64, 3), (128, 64, 2), (64, 64, 2)]
    steps = [str(w.message) for w in caught if "does not fit this GPU" in str(w.message)]
    assert len(steps) == 2 and "using 128x64 tiles, 8 warps, 2 stages" in steps[0], steps
    torch.testing.assert_close(out, A.attention_spec(q, k, v, True)[0], atol=1e-4, rtol=1e-4)
    tried.clear()
    A.__dict__["flash_attention_reference"].__wrapped__(q, k, v, True)  # remembered: starts where it stepped to
    assert tried == [(64, 64, 2)]


def test_an_explicit_configuration_that_does_not_fit_is_not_replaced(monkeypatch):
    class Failing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise _OutOfResources("out of resource: shared memory")
            return launch

    monkeypatch.setattr(A, "flash_attention_forward_kernel", Failing())
    q = torch.randn(1, 1, 16, 32)
    with pytest.raises(Exception, match="out of resource"):
        A.__dict__["flash_attention_reference"].__wrapped__(q, q, q, config=A.GPU_CONFIGS[0])


def test_the_decode_kernels_compile_for_the_gpus_they_run_on(compiled):
    for (name, _, _, cc, elem, _, consts, _, _), shared in zip(DECODE_KERNELS, compiled[2]):
        limit = SHARED[cc]
        assert shared <= limit, f"{name} (sm_{cc[0]}{cc[1]}, {elem}, {consts}) needs {shared} B of {limit}"
    assert len(compiled[2]) == len(DECODE_KERNELS)


def test_on_hopper_the_kernel_uses_wgmma(compiled):
    """Chapter 07 explains the measured H200 results by the instructions Triton emits: Hopper's
    asynchronous wgmma for sm_90, Ampere's mma.sync for sm_80. Keep that statement true."""
    ptx = compiled[1]
    assert ptx["hopper_wgmma"] > 0 and ptx["hopper_mma_sync"] == 0 and ptx["ampere_mma_sync"] > 0
