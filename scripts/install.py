"""Create the course's virtual environment and install everything into it.

    python3 scripts/install.py [--venv .venv]

* No CUDA torch available (CI, most laptops): install the CPU torch and the pinned triton from
  requirements-cpu.txt, so pip can never pull a multi-GB CUDA build.
* A CUDA torch already installed for this python (a GPU server): the venv is created with
  ``--system-site-packages`` and torch and triton are left exactly as they are.
Then requirements.txt and the course package (editable) are installed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--venv", default=".venv")
    args = parser.parse_args()
    env_dir = ROOT / args.venv
    python = env_dir / "bin" / "python"

    system_cuda = has_cuda_torch(sys.executable)
    if not python.exists():
        print(f"creating {env_dir} (system packages visible: {system_cuda})", flush=True)
        venv.EnvBuilder(with_pip=True, system_site_packages=system_cuda).create(env_dir)

    if has_cuda_torch(str(python)):
        print("CUDA torch found: leaving torch and triton as they are", flush=True)
    else:
        pip(python, "-r", "requirements-cpu.txt")
    pip(python, "-r", "requirements.txt")
    pip(python, "--no-deps", "-e", ".")
    check = subprocess.run(
        [str(python), "-c", "import torch, triton, labsupport; print('torch', torch.__version__, "
         "'triton', triton.__version__, 'cuda', torch.version.cuda)"],
        capture_output=True, text=True,
    )
    print(check.stdout.strip() or check.stderr.strip())
    if check.returncode:
        sys.exit("install failed: torch, triton or labsupport does not import")


if __name__ == "__main__":
    main()
