"""Setup decisions: which machines can run the course, and never a CUDA torch where there is no GPU.

The course package itself is what a lab's first cell pip-installs on Colab: it must not pull or
upgrade anything Colab pins (torch, triton, Jupyter's own packages).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("course_install", ROOT / "scripts" / "install.py")
install = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(install)


def test_linux_with_a_recent_python_is_supported():
    assert install.unsupported_platform("Linux", (3, 11)) is None


@pytest.mark.parametrize("system", ["Darwin", "Windows"])
def test_other_systems_are_sent_to_colab(system):
    message = install.unsupported_platform(system, (3, 12))
    assert "Linux only" in message and "Colab" in message


def test_an_old_python_is_refused_with_advice():
    assert "3.9 is too old" in install.unsupported_platform("Linux", (3, 9))


def test_a_cuda_torch_in_the_dry_run_switches_to_the_cpu_index():
    cuda = "Collecting torch==2.13.0\nWould install nvidia-cublas-cu12-12.8 torch-2.13.0 triton-3.6.0\n"
    cpu = "Would install filelock-3.1 torch-2.13.0+cpu triton-3.6.0\n"
    assert install.pip_would_fetch_cuda(cuda) and not install.pip_would_fetch_cuda(cpu)
    assert not install.pip_would_fetch_cuda("Requirement already satisfied: nvidia-nccl-cu12\n")


@pytest.mark.skipif(tomllib is None, reason="tomllib needs Python 3.11")
def test_the_course_package_installs_nothing_colab_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("<")[0].strip().lower() for dep in project["dependencies"]}
    assert names == {"numpy", "matplotlib", "tqdm"}
    assert not names & {"torch", "triton", "ipykernel", "jupyter-client", "nbclient", "tornado", "pyzmq"}
    assert {"nbformat", "nbclient", "ipykernel"} <= {
        dep.split(">")[0].strip() for dep in project["optional-dependencies"]["grade"]
    }


def test_a_failed_dry_run_shows_pips_error(monkeypatch, capsys):
    import subprocess

    def failing(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: Could not find a version (offline)")

    monkeypatch.setattr(install.subprocess, "run", failing)
    assert install.cpu_torch_args(Path("python")) == ["--extra-index-url", install.CPU_INDEX]
    out = capsys.readouterr().out
    assert "dry run failed" in out and "offline" in out and "would fetch a CUDA build" not in out
