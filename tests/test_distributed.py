"""The launcher: results per rank, a raising rank and a hanging rank end with a clear message and
no process left behind, notebook functions travel by source, a script needs no main guard."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from labsupport.collectives import bus_bandwidth, ring_bytes_sent, ring_chunk_bounds, time_all_reduce
from labsupport.distributed import RankFailed, RankHung, _dumps, launch
from labsupport.tensor_parallel import TensorParallelModel, time_decode_step
from labsupport.transformer import Transformer


def _children() -> set[int]:
    """The live descendants of this test worker, except those under a process it already had: a
    browser another test module started (the planner page's Chromium) spawns helpers of its own at
    any time, and they are not the launcher's. The launcher's zygote (one per process, kept between
    launches on purpose) is not counted, but the ranks it forked are."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE or "_zygote_main" in " ".join(p.cmdline()):
                continue
            ancestors = {a.pid for a in p.parents()}
            if not ancestors & _BEFORE:
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def _children_before():
    """The processes this test worker already had (a pytest-xdist worker may hold notebook kernels or
    servers of other test modules): only the ones a launch adds must be gone afterwards."""
    _BEFORE.clear()
    _BEFORE.update(_children())


class _Left:
    """False when processes a launch added are still alive after the wait; says which they are."""

    def __init__(self, pids: set[int]):
        self.pids = pids

    def __bool__(self) -> bool:
        return not self.pids

    def __repr__(self) -> str:
        names = []
        for pid in sorted(self.pids):
            try:
                names.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}")
            except psutil.Error:
                names.append(f"{pid}: gone")
        return f"processes left: {names}"


def no_children_left(wait_s: float = 30):
    """Whether every process the test added has ended (waiting up to ``wait_s``: a loaded machine
    can take seconds to reap killed ranks); a falsy result names the ones left."""
    deadline = time.monotonic() + wait_s
    while True:
        left = _children() - _BEFORE
        if not left or time.monotonic() >= deadline:
            return _Left(left)
        time.sleep(0.1)


def raises_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for rank 1, which never comes
    return 0


def hangs_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(600)
    return dist.get_rank()


def several_things(model_name):
    """One launch for the domain functions that need a process group (start-up costs seconds)."""
    print(f"hello from rank {dist.get_rank()}")
    model = Transformer(model_name, seed=2)
    prompt = model.random_prompt(2, 6)
    tp = TensorParallelModel(model)
    diff = float((tp.run(prompt) - model.forward_no_cache(prompt)).abs().max())
    return dict(rank=dist.get_rank(), diff=diff, timing=time_all_reduce([10, 1000], repeats=2),
                decode=time_decode_step(model_name, 1, 8, steps=2))


def test_results_per_rank_and_domain_functions(capsys):
    results = launch(several_things, 2, args=("tiny-2m",), backend="gloo")
    printed = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in printed and "[rank 1] hello from rank 1" in printed
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["diff"] < 1e-5
    assert [row["elements"] for row in results[0]["timing"]] == [10, 1000]
    assert all(row["seconds"] > 0 for row in results[0]["timing"])
    assert results[0]["decode"]["world_size"] == 2 and results[0]["decode"]["max_logit_difference"] < 1e-5
    assert no_children_left()


def test_a_rank_that_raises():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(raises_on_rank_one, 2, backend="gloo", timeout=120)
    assert info.value.rank == 1
    assert "rank 1 of 2 failed with ValueError: rank one is broken" in str(info.value)
    assert "raises_on_rank_one" in info.value.remote_traceback  # the rank's own traceback
    assert time.monotonic() - start < 100  # it did not wait for the timeout
    assert no_children_left()


def test_a_rank_that_hangs():
    with pytest.raises(RankHung) as info:
        launch(hangs_on_rank_zero, 2, backend="gloo", timeout=120, call_timeout=2)
    assert info.value.ranks == [0]
    assert "time.sleep" in str(info.value)  # where it was stuck
    assert no_children_left()


def test_a_whole_launch_past_its_timeout():
    with pytest.raises(RankHung) as info:
        launch(hangs_on_rank_zero, 1, backend="gloo", timeout=3)
    assert info.value.ranks == [0] and "after 3 s" in str(info.value)
    assert no_children_left()


def test_a_port_taken_after_it_was_chosen_is_retried(monkeypatch):
    import socket

    import labsupport.distributed as launcher

    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    ports = iter([busy.getsockname()[1]])
    real_free_port = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda: next(ports, None) or real_free_port())
    try:
        assert launch(dist.get_rank, 2, backend="gloo", timeout=60) == [0, 1]
    finally:
        busy.close()
    assert no_children_left()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="backend"):
        launch(several_things, 2, backend="mpi")
    with pytest.raises(ValueError, match="world_size"):
        launch(several_things, 0)
    with pytest.raises(ValueError, match="lambda"):
        launch(lambda: 1, 2)

    def nested():
        return 1

    with pytest.raises(ValueError, match="inside another function"):
        _dumps(nested)


def test_a_notebook_style_script_without_main_guard(tmp_path):
    """A function defined in __main__ (as in a notebook) is sent by source, with the globals it uses."""
    script = tmp_path / "learner.py"
    script.write_text(textwrap.dedent("""
        import math
        import torch.distributed as dist
        from labsupport.distributed import launch

        SCALE = 10

        def helper(r):
            return math.floor(r * SCALE)

        def work(offset):
            return helper(dist.get_rank()) + offset

        print("RESULT", launch(work, 2, args=(1,), backend="gloo"))
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert "RESULT [1, 11]" in done.stdout, done.stdout + done.stderr


def parent_and_environment():
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ  # the zygote's own setting is not the rank's
    return os.getppid(), os.environ.get("LABSUPPORT_TEST_MARK"), os.getcwd(), os.getsid(0) == os.getpid()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote is used on Linux only")
def test_ranks_are_forked_by_one_zygote_in_the_callers_environment_and_folder(tmp_path, monkeypatch):
    import labsupport.distributed as launcher

    monkeypatch.setenv("LABSUPPORT_TEST_MARK", "first")
    monkeypatch.chdir(tmp_path)
    first = launch(parent_and_environment, 2, backend="gloo")
    zygote = launcher._ZYGOTE.process.pid
    assert [row[0] for row in first] == [zygote, zygote]  # forked by the zygote, not started by this process
    assert all(row[1:] == ("first", str(tmp_path), True) for row in first)  # its env, its folder, own session
    monkeypatch.setenv("TEST_MARK_OF_THE_CALLER", "x")  # read by no import: the same zygote serves it
    assert launch(parent_and_environment, 2, backend="gloo")[0][0] == zygote
    monkeypatch.setenv("LABSUPPORT_TEST_MARK", "second")  # an import-time setting: torch was imported without it
    second = launch(parent_and_environment, 2, backend="gloo")
    assert second[0][0] != zygote and second[0][1] == "second" and not psutil.pid_exists(zygote)
    monkeypatch.setenv("LABSUPPORT_LAUNCH", "subprocess")
    assert launch(parent_and_environment, 1, backend="gloo")[0][0] == os.getpid()  # started directly
    assert not launcher._use_zygote("nccl")  # ranks that start CUDA are never forked
    assert no_children_left()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote is used on Linux only")
def test_the_zygote_ends_with_the_process_that_started_it(tmp_path):
    script = tmp_path / "one_launch.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        import torch.distributed as dist
        import labsupport.distributed as launcher

        print(launcher.launch(dist.get_rank, 2, backend="gloo"), launcher._ZYGOTE.process.pid, flush=True)
        os._exit(0)  # no atexit: the zygote must notice its caller is gone on its own
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    ranks, _, pid = done.stdout.strip().rpartition(" ")
    assert ranks == "[0, 1]", done.stdout + done.stderr
    deadline = time.monotonic() + 30
    while psutil.pid_exists(int(pid)) and psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the zygote outlived its caller"
        time.sleep(0.1)


def test_ring_arithmetic():
    assert ring_chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert ring_chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert ring_bytes_sent(1000, 4) == 1500  # 2 (n-1)/n
    assert ring_bytes_sent(1000, 1) == 0
    assert bus_bandwidth(1e9, 1.0, 8) == pytest.approx(1.75e9)
    with pytest.raises(ValueError):
        bus_bandwidth(1e9, 0.0, 8)
