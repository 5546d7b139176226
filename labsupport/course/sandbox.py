"""Where a graded notebook's kernel runs: a bubblewrap sandbox (the default where ``bwrap`` works), a
container image the instructor names (``--container IMAGE``), or, loudly, nowhere (``--no-sandbox``).

In the bubblewrap sandbox the kernel has no network (``--unshare-net``), sees the whole file system
read-only (the course, the submissions, the grades file) except its own scratch folder and the
folder of its connection sockets, has a private ``/tmp``, ``/dev`` and process namespace (it sees
only its own processes, so it cannot read the grader's command line or signal the grader or another
kernel, and every process it starts dies with it), no capabilities (even when the grader runs as
root) and an address-space limit (``prlimit --as``; a kernel past it gets MemoryError, not the
machine's swap). The kernel talks to the grader over ZeroMQ's ``ipc`` transport (Unix sockets in a
folder bound into the sandbox), since it has no TCP to localhost.

A container runs the kernel with ``docker run`` or ``podman run`` (whichever is installed; podman
first): no network, no capabilities, a read-only root and a private ``/tmp``, the same memory limit
(a cgroup limit: past it the kernel is killed, not given MemoryError), the scratch and socket
folders mounted at the same paths and nothing else of the host's, and ``python`` of the image as the
kernel (the image must have ipykernel and the course package, at the commit the grader runs). The
kernel runs as the grader's own uid under a rootful Docker (the scratch folders are private to it);
under podman or a rootless Docker the container's root is the grader's user already.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import labsupport

MEMORY_LIMIT = 8 * 2**30  # bytes of address space a sandboxed kernel may map, by default (torch maps ~2 GiB)
TMP_LIMIT = 2 * 2**30  # bytes the sandbox's private /tmp (memory) may hold
FILE_LIMIT = 2 * 2**30  # bytes of the largest file a sandboxed kernel may write (RLIMIT_FSIZE)
PROCESS_LIMIT = 1024  # processes and threads (RLIMIT_NPROC; not enforced when the grader runs as root)


@dataclass
class Sandbox:
    kind: str  # "bwrap" or "container"
    memory: int = MEMORY_LIMIT
    image: str = ""
    engine: str = ""  # docker or podman (container only)
    read_only: list[str] = field(default_factory=list)  # not used by bwrap (all of / is read-only)
    user: str = ""  # container only: "uid:gid" the kernel runs as (rootful docker; see choose)

    @property
    def label(self) -> str:
        return "bwrap" if self.kind == "bwrap" else f"container {self.image} ({self.engine})"

    def wrap(self, argv: list[str], writable: list[str], cwd: str) -> list[str]:
        """``argv`` (the kernel's command) run inside the sandbox, ``writable`` folders bound read-write."""
        if self.kind == "bwrap":
            sized = ["--size", str(TMP_LIMIT)] if bwrap_sizes_tmpfs() else []  # bubblewrap 0.5 and later
            outer = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", *sized, "--tmpfs", "/tmp",
                     "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                     "--unsetenv", "JPY_PARENT_PID"]  # ipykernel would watch a pid it cannot see
            for folder in _under_private_tmp():
                outer += ["--ro-bind", folder, folder]
            for folder in writable:
                outer += ["--bind", folder, folder]
            outer += ["--chdir", cwd, "--"]
            limits = [f"--as={self.memory}", f"--fsize={FILE_LIMIT}", f"--nproc={PROCESS_LIMIT}"]
            return outer + ["prlimit", *limits, "--"] + argv
        outer = [self.engine, "run", "--rm", "-i", "--network", "none", f"--memory={self.memory}",
                 "--pids-limit", "512", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                 "--read-only", "--tmpfs", "/tmp", "-e", "IPYTHONDIR", "-e", "LABSUPPORT_GRADING",
                 "-e", "TRITON_INTERPRET", "-e", "CUDA_VISIBLE_DEVICES", "-e", "MPLBACKEND"]
        if self.user:  # the grader's own uid: its private folders are 0700, and root without capabilities
            outer += ["--user", self.user, "-e", "HOME=/tmp"]  # cannot enter them
        for folder in writable:
            outer += ["-v", f"{folder}:{folder}"]
        outer += ["-w", cwd, self.image]
        return outer + ["python", *argv[1:]]  # the image's own Python runs the kernel


def _under_private_tmp() -> list[str]:
    """What the kernel needs read-only that the sandbox's private ``/tmp`` would hide: the Python
    environment and the course checkout, when they live under ``/tmp`` (a clone in ``/tmp/x`` for a
    test run, a CI checkout there)."""
    needed = {sys.prefix, sys.base_prefix, str(Path(labsupport.__file__).resolve().parents[1])}
    needed.update(entry for entry in sys.path if entry and Path(entry).is_dir())
    tmp = Path("/tmp").resolve()
    inside = sorted(p for p in {str(Path(n).resolve()) for n in needed} if Path(p).is_relative_to(tmp))
    # an outer folder covers the ones inside it
    return [p for p in inside if not any(p != q and Path(p).is_relative_to(q) for q in inside)]


@functools.lru_cache(maxsize=1)
def bwrap_sizes_tmpfs() -> bool:
    """Whether this bwrap can bound the size of a tmpfs (``--size``)."""
    try:
        done = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--size" in done.stdout + done.stderr


@functools.lru_cache(maxsize=1)
def bwrap_problem() -> str:
    """Why bubblewrap cannot sandbox a kernel here ("" when it can)."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (apt-get install bubblewrap)"
    if shutil.which("prlimit") is None:
        return "prlimit is not installed (util-linux)"
    try:
        done = subprocess.run(["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                               "--unshare-all", "--die-with-parent", "--cap-drop", "ALL", "true"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap did not run ({exc})"
    if done.returncode:
        return f"bwrap cannot create a sandbox here ({done.stderr.strip()[:200] or done.returncode}); " \
               f"user namespaces may be disabled"
    return ""


def container_engine() -> str:
    """docker or podman, whichever is installed ("" if neither)."""
    return next((name for name in ("podman", "docker") if shutil.which(name)), "")


def _docker_rootless() -> bool:
    """Whether the Docker daemon runs rootless (its root is the grader's user, as with rootless podman);
    RuntimeError when it does not answer."""
    try:
        done = subprocess.run(["docker", "info", "--format", "{{json .SecurityOptions}}"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"--container: `docker info` did not run ({exc})") from None
    if done.returncode:
        why = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise RuntimeError(f"--container: docker does not answer ({why[-1][:200] if why else done.returncode}); "
                           f"is the Docker daemon running, and may you use it?")
    return "rootless" in done.stdout


def choose(no_sandbox: bool = False, container: str | None = None, memory: int = MEMORY_LIMIT) -> tuple[Sandbox | None, str]:
    """The sandbox to grade in, and why there is none (``""`` when there is one)."""
    if container:
        engine = container_engine()
        if not engine:
            raise RuntimeError("--container needs docker or podman, and neither is installed")
        user = ""
        if engine == "docker" and not _docker_rootless() and os.getuid() != 0:  # asks the daemon first
            user = f"{os.getuid()}:{os.getgid()}"
        return Sandbox("container", memory=memory, image=container, engine=engine, user=user), ""
    if no_sandbox:
        return None, "--no-sandbox was given"
    problem = bwrap_problem()
    if problem:
        return None, problem
    return Sandbox("bwrap", memory=memory), ""


def environment_for_kernel() -> dict[str, str]:
    """The grader's environment minus what a kernel has no business reading (tokens, keys)."""
    secret = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL", "AUTH")
    return {k: v for k, v in os.environ.items() if not any(s in k.upper() for s in secret)}
