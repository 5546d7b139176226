"""The attention kernel's launch configuration fits every GPU the hardware table names.

Triton compiles for any target without a GPU, so these tests compile the reference kernel for
sm_75 (T4), sm_80 (A100), sm_89 (L4) and sm_90 (H100, H200) with the configuration
``kernel_config`` picks for each card, and compare the shared memory the compiler reports with
that card's limit. (Before this test, a T4 got 128x32 tiles whose kernel needs 81,920 bytes
against its 65,536: lab 07 crashed on Colab's free GPU.)
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
    """(gpu name, capability, limit, dtype name, head dim, config) to compile, one per distinct pick."""
    seen, cases = set(), []
    for gpu in GPUS.values():
        for dtype_name, dtype in DTYPES.items():
            if dtype == torch.bfloat16 and gpu.compute_capability < (8, 0):
                continue  # no bf16 on a T4: the labs use fp16 there
            for head_dim in (64, 128) if dtype != torch.float16 else (64, 128, 256):
                config = A.kernel_config(8192, 8192, head_dim, dtype, interpreter=False,
                                         shared_memory=gpu.shared_memory_per_block)
                key = (gpu.compute_capability, gpu.shared_memory_per_block, dtype_name, head_dim, config)
                if key not in seen:
                    seen.add(key)
                    cases.append((gpu.name, *key))
    return cases


COMPILE = r"""
import json, sys, torch
from labsupport import attention as A
out = []
for name, cc, limit, dtype, d, cfg in json.loads(sys.stdin.read()):
    c = A.KernelConfig(*cfg)
    out.append(A.compiled_shared_memory(c, d, getattr(torch, dtype), tuple(cc)))
hopper = A.compile_for(A.KernelConfig(128, 64, 8, 3), 128, torch.bfloat16, (9, 0))
ampere = A.compile_for(A.KernelConfig(128, 64, 8, 3), 128, torch.bfloat16, (8, 0))
print(json.dumps(out))
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
    run = subprocess.run([sys.executable, "-c", COMPILE], input=payload, capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    return list(zip(cases, json.loads(lines[-2]))), json.loads(lines[-1])


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


def test_on_hopper_the_kernel_uses_wgmma(compiled):
    """Chapter 07 explains the measured H200 results by the instructions Triton emits: Hopper's
    asynchronous wgmma for sm_90, Ampere's mma.sync for sm_80. Keep that statement true."""
    ptx = compiled[1]
    assert ptx["hopper_wgmma"] > 0 and ptx["hopper_mma_sync"] == 0 and ptx["ampere_mma_sync"] > 0
