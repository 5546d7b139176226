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
first): no network, no capabilities, a read-only root and a private ``/tmp`` of the same size, the
scratch and socket folders mounted at the same paths and nothing else of the host's, the limits of
bubblewrap's kernel (``prlimit --as`` in the image, and the engine's ``--ulimit`` for the largest file
and the processes) plus the engine's cgroup limits on memory and processes where it can set them, a
name of its own (it is removed when the kernel is shut down, even if the kernel ignored that), and
``python`` of the image as the kernel. Before grading, :func:`choose` runs the image once: it must
answer with ipykernel and the course package at the grader's own code and ``lab_checks.json`` (a
different version grades with different checks), or grading stops and says so
(``scripts/grading/build_image.sh`` builds one). The kernel runs as the grader's own uid under a
rootful Docker (the scratch folders are private to it); under podman or a rootless Docker the
container's root is the grader's user already.
"""

from __future__ import annotations

import functools
import json
import os
import resource
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
    note: str = ""  # container only: a limit the engine cannot set here (the grader says it before grading)

    @property
    def label(self) -> str:
        return "bwrap" if self.kind == "bwrap" else f"container {self.image} ({self.engine})"

    def wrap(self, argv: list[str], writable: list[str], cwd: str, name: str = "") -> list[str]:
        """``argv`` (the kernel's command) run inside the sandbox, ``writable`` folders bound read-write;
        a container is called ``name`` (see :meth:`stop`)."""
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
                 "--read-only", "--tmpfs", f"/tmp:size={TMP_LIMIT}", *_container_ulimits()]
        for variable in _container_variables():  # -e NAME: the value the engine's client was started with
            outer += ["-e", variable]
        if name:
            outer += ["--name", name]
        if self.user:  # the grader's own uid: its private folders are 0700, and root without capabilities
            outer += ["--user", self.user, "-e", "HOME=/tmp"]  # cannot enter them
        for folder in writable:
            outer += ["-v", f"{folder}:{folder}"]
        outer += ["-w", cwd, self.image]
        # the image's own Python runs the kernel, under bubblewrap's address-space limit: a kernel past
        # it gets MemoryError, as there (the cgroup's limit, where the engine sets one, kills it)
        return outer + ["prlimit", f"--as={self.memory}", "--", "python", *argv[1:]]

    def stop(self, name: str) -> None:
        """Remove the container ``name`` if it is still there: a kernel that outlived its shutdown
        (ignoring SIGTERM, or the engine's client killed) would go on running. Nothing for bubblewrap,
        whose kernel dies with the grader's process."""
        if self.kind != "container" or not name:
            return
        force = ["rm", "--force", "--time", "0"] if self.engine == "podman" else ["rm", "--force"]
        try:
            subprocess.run([self.engine, *force, name], capture_output=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            pass


# What a container's kernel is given of the environment a kernel gets (bubblewrap's gets all of it,
# but the host's paths, PATH and HOME among them, mean nothing in an image): the kernel's own
# folders and the grading flag, the course's settings, and what changes how numbers are computed.
CONTAINER_VARIABLES = ("IPYTHONDIR", "LABSUPPORT_GRADING", "LABSUPPORT_LEDGER", "TRITON_INTERPRET",
                       "CUDA_VISIBLE_DEVICES", "MPLBACKEND", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED")
CONTAINER_PREFIXES = ("LABSUPPORT_", "OPENBLAS_")


def _container_variables() -> list[str]:
    named = [name for name in environment_for_kernel() if name.startswith(CONTAINER_PREFIXES)]
    return list(dict.fromkeys([*CONTAINER_VARIABLES, *sorted(named)]))


def _container_ulimits() -> list[str]:
    """``--ulimit`` options for a container's kernel: bubblewrap's limits on one file's size and on
    processes, and the grader's own open-file limit (an engine's default, podman's 1048576 for root,
    can be more than this process may grant, and the container then fails to start)."""
    limits = ["--ulimit", f"fsize={FILE_LIMIT}:{FILE_LIMIT}", "--ulimit", f"nproc={PROCESS_LIMIT}:{PROCESS_LIMIT}"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY:
        limits += ["--ulimit", f"nofile={hard if soft == resource.RLIM_INFINITY else soft}:{hard}"]
    return limits


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


def _podman_note() -> str:
    """What rootless podman cannot enforce here ("" when it can), RuntimeError when it does not answer."""
    try:
        done = subprocess.run(["podman", "info", "--format", "{{.Host.Security.Rootless}} {{.Host.CgroupsVersion}}"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"--container: `podman info` did not run ({exc})") from None
    if done.returncode:
        why = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise RuntimeError(f"--container: podman does not answer ({why[-1][:300] if why else done.returncode})")
    rootless, _, cgroups = done.stdout.strip().partition(" ")
    if rootless == "true" and cgroups == "v1":
        return ("rootless podman on cgroup v1 ignores the memory and process-count cgroup limits (--memory, "
                "--pids-limit); the kernel's address-space limit (prlimit --as) and RLIMIT_NPROC still hold")
    return ""


# Run once in the image before grading: what a kernel needs, and which course it holds.
IMAGE_PROBE = ("import json, ipykernel, labsupport.checks; from labsupport.course.shard import course_fingerprint; "
               "print(json.dumps(course_fingerprint()))")


def check_image(box: Sandbox) -> None:
    """Stop (RuntimeError, saying what to do) unless ``box``'s image is there, starts under the grader's
    options and holds the grader's own course: its code and ``lab_checks.json`` (the checks the kernel
    imports come from the image, so another version scores differently)."""
    from .shard import course_fingerprint

    build = f"bash scripts/grading/build_image.sh {box.image}"
    try:
        there = subprocess.run([box.engine, "image", "inspect", box.image], capture_output=True, text=True,
                               timeout=120)
        if there.returncode:
            raise RuntimeError(f"--container: {box.engine} has no image {box.image} (`{box.engine} images` lists "
                               f"the ones it has; each user of a rootless podman has their own). Build it from "
                               f"this commit: {build}")
        ran = subprocess.run(box.wrap(["python", "-c", IMAGE_PROBE], [], "/tmp"), capture_output=True, text=True,
                             timeout=600, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"--container: {box.engine} did not run ({exc})") from None
    lines = ran.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if ran.returncode == 0 and lines else None
    except ValueError:
        found = None
    if not isinstance(found, dict):
        lines = (ran.stderr.strip() or ran.stdout.strip()).splitlines()
        why = f"{box.engine} run exited {ran.returncode}: {lines[-1][:300] if lines else 'no output'}"
        if ran.returncode in (125, 126) and "Error" in ran.stderr:  # the engine's own error, not the image's
            hint = ("; crun refuses cgroups mixed v1 and v2: install runc and set runtime = \"runc\" under [engine] "
                    "in containers.conf (or in a file named by CONTAINERS_CONF)" if "hybrid mode" in ran.stderr else "")
            raise RuntimeError(f"--container: {box.engine} cannot start a container of {box.image} with the "
                               f"grader's options ({why}){hint}")
        needs = "`prlimit` and `python` on its PATH" if ran.returncode == 127 else \
            "`python` with ipykernel and the course package"
        raise RuntimeError(f"--container: a kernel cannot start in {box.image} ({why}). The image needs {needs}; "
                           f"{build} makes one")
    mine = course_fingerprint()
    keys = ("code_sha256", "lab_checks_sha256")
    if any(found.get(k) != mine[k] for k in keys):
        def short(f: dict) -> str:
            return (f"labsupport {f.get('labsupport', '?')}, code {str(f.get('code_sha256', '?'))[:12]}, "
                    f"lab_checks.json {str(f.get('lab_checks_sha256', '?'))[:12]}")
        raise RuntimeError(f"--container: {box.image} holds another version of the course ({short(found)}) than this "
                           f"grader ({short(mine)}{', commit ' + mine['commit'][:12] if mine.get('commit') else ''}); "
                           f"its checks would score differently. Build it from this commit: {build}")


def choose(no_sandbox: bool = False, container: str | None = None, memory: int = MEMORY_LIMIT) -> tuple[Sandbox | None, str]:
    """The sandbox to grade in, and why there is none (``""`` when there is one). With ``container``,
    the engine and the image are checked first (:func:`check_image`): RuntimeError says what is wrong."""
    if container:
        engine = container_engine()
        if not engine:
            raise RuntimeError("--container needs podman or docker, and neither is installed (apt-get install podman)")
        user = note = ""
        if engine == "docker" and not _docker_rootless() and os.getuid() != 0:  # asks the daemon first
            user = f"{os.getuid()}:{os.getgid()}"
        if engine == "podman":
            note = _podman_note()
        box = Sandbox("container", memory=memory, image=container, engine=engine, user=user, note=note)
        check_image(box)
        return box, ""
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
