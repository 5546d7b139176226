"""grade --container: the command each kernel runs under, the checks before grading, and a notebook
graded in a real container.

Building an image takes minutes (scripts/grading/build_image.sh), more than the suite can pay, so the
tests that run a container need one named by LABSUPPORT_TEST_IMAGE and are skipped without it; the
README's "Grading in containers" gives the manual check, and scripts/grading/container_check.py the
comparison with bubblewrap on a whole folder. Everything around the run is tested here on every
machine; the image check's messages need podman (.ci/run installs it).
"""

from __future__ import annotations

import csv
import os
import resource
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

from labsupport.course.cli import main
from labsupport.course.sandbox import (
    FILE_LIMIT,
    PROCESS_LIMIT,
    TMP_LIMIT,
    Sandbox,
    bwrap_problem,
    choose,
    container_engine,
)

ROOT = Path(__file__).resolve().parents[2]
ARGV = ["/venv/bin/python", "-c", "main", "-f", "/k/connection.json"]
IMAGE = os.environ.get("LABSUPPORT_TEST_IMAGE", "")
needs_podman = pytest.mark.skipif(shutil.which("podman") is None,
                                  reason="podman is not installed (apt-get install podman; .ci/run does)")
needs_image = pytest.mark.skipif(not IMAGE, reason="needs an image: LABSUPPORT_TEST_IMAGE=IMAGE, built by "
                                                   "scripts/grading/build_image.sh (minutes: not part of make test)")


def _options(argv: list[str], image: str) -> tuple[list[str], list[str]]:
    at = argv.index(image)
    return argv[:at], argv[at + 1:]


def _values(options: list[str], flag: str) -> list[str]:
    return [options[i + 1] for i, option in enumerate(options) if option == flag]


def test_a_container_runs_the_kernel_with_bubblewraps_limits_and_no_network(monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")  # changes how numbers are computed: passed on
    monkeypatch.setenv("LABSUPPORT_PRESET", "cpu")
    monkeypatch.setenv("LABSUPPORT_API_TOKEN", "secret")  # a secret: never
    box = Sandbox("container", memory=2**30, image="course-grader:1", engine="podman")
    assert box.label == "container course-grader:1 (podman)"
    options, command = _options(box.wrap(ARGV, ["/k", "/work"], "/work", name="labsupport-kernel-abc"),
                                "course-grader:1")
    assert options[:4] == ["podman", "run", "--rm", "-i"]
    assert _values(options, "--network") == ["none"] and "--read-only" in options
    assert _values(options, "--cap-drop") == ["ALL"] and _values(options, "--security-opt") == ["no-new-privileges"]
    assert "--memory=1073741824" in options and _values(options, "--tmpfs") == [f"/tmp:size={TMP_LIMIT}"]
    ulimits = dict(value.split("=") for value in _values(options, "--ulimit"))
    assert ulimits["fsize"] == f"{FILE_LIMIT}:{FILE_LIMIT}" and ulimits["nproc"] == f"{PROCESS_LIMIT}:{PROCESS_LIMIT}"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY:  # never more than the grader may grant: the container would not start
        assert ulimits["nofile"] == f"{soft}:{hard}"
    assert _values(options, "-v") == ["/k:/k", "/work:/work"] and _values(options, "-w") == ["/work"]
    assert _values(options, "--name") == ["labsupport-kernel-abc"]
    passed = set(_values(options, "-e"))
    assert {"IPYTHONDIR", "LABSUPPORT_GRADING", "LABSUPPORT_LEDGER", "TRITON_INTERPRET", "OPENBLAS_CORETYPE",
            "LABSUPPORT_PRESET"} <= passed
    assert not passed & {"PATH", "HOME", "LABSUPPORT_API_TOKEN", "VIRTUAL_ENV"}
    # the image's Python, under the same address-space limit as in bubblewrap
    assert command == ["prlimit", "--as=1073741824", "--", "python", *ARGV[1:]]
    assert "--user" not in options  # podman's (and a rootless Docker's) root is the grader's user


def test_a_rootful_docker_runs_the_kernel_as_the_graders_user():
    boxed = Sandbox("container", image="course:abc", engine="docker", user="1000:1000").wrap(ARGV, ["/k"], "/k")
    options, _ = _options(boxed, "course:abc")
    assert _values(options, "--user") == ["1000:1000"] and "HOME=/tmp" in _values(options, "-e")
    assert "--name" not in options  # no name asked for


def test_container_needs_an_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither podman nor docker
    with pytest.raises(RuntimeError, match="needs podman or docker, and neither is installed"):
        choose(container="course-grader:1")


@needs_podman
def test_grading_stops_before_it_starts_when_the_image_is_missing(tmp_path, capsys):
    (tmp_path / "ann_04_roofline.ipynb").write_text("not json")
    image = "localhost/labsupport-test-no-such-image:0"
    assert main(["grade", str(tmp_path), "--container", image, "--csv", str(tmp_path / "g.csv")]) == 2
    err = capsys.readouterr().err
    assert f"podman has no image {image}" in err, err
    assert f"bash scripts/grading/build_image.sh {image}" in err and "rootless podman" in err
    assert not (tmp_path / "g.csv").exists()


def test_a_docker_without_its_daemon_stops_grading_before_it_starts(tmp_path, capsys):
    if container_engine() != "docker" or subprocess.run(["docker", "info"], capture_output=True,
                                                        timeout=60).returncode == 0:
        pytest.skip("needs docker without a running daemon (podman is used first where installed)")
    (tmp_path / "ann_04_roofline.ipynb").write_text("not json")
    assert main(["grade", str(tmp_path), "--container", "course:abc", "--csv", str(tmp_path / "g.csv")]) == 2
    err = capsys.readouterr().err
    assert "docker does not answer" in err and "Docker daemon" in err
    assert not (tmp_path / "g.csv").exists()


# -- with an image (LABSUPPORT_TEST_IMAGE) -----------------------------------------------------------

EXERCISE = "04-roofline-019"  # lab 04's exercise cell (as in test_grade_sandbox)
WRONG = "def arithmetic_intensity(m, k, n, dtype_bytes):\n    return 1.0\n"
# ignores the signals a shutdown sends, and sleeps past the notebook's time limit
STUBBORN = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(10**6)\n" + WRONG)


def _lab04(path: Path, exercise: str) -> None:
    nb = nbformat.read(str(ROOT / "labs" / "04_roofline.ipynb"), as_version=4)
    next(c for c in nb.cells if c.get("id") == EXERCISE).source = exercise
    nbformat.write(nb, str(path))


def _kernels_left() -> list[str]:
    done = subprocess.run(["podman", "ps", "-a", "--filter", "name=labsupport-kernel", "--format", "{{.Names}}"],
                          capture_output=True, text=True, timeout=120)
    return done.stdout.split()


@needs_image
@needs_podman
@pytest.mark.notebook
def test_notebooks_graded_in_a_container_score_as_in_bubblewrap(tmp_path):
    folder = tmp_path / "class"
    folder.mkdir()
    shutil.copy(ROOT / "solutions" / "04_roofline.ipynb", folder / "solved_04_roofline.ipynb")
    _lab04(folder / "wrong_04_roofline.ipynb", WRONG)
    _lab04(folder / "stubborn_04_roofline.ipynb", STUBBORN)
    before = _kernels_left()
    scores = {}
    for label, extra in (("container", ["--container", IMAGE]), ("bwrap", [] if not bwrap_problem() else None)):
        if extra is None:
            continue
        out = tmp_path / f"{label}.csv"
        assert main(["grade", str(folder), "--csv", str(out), "--timeout", "20", "--notebook-timeout", "150",
                     *extra]) == 0
        with open(out, newline="") as f:
            rows = {Path(r["notebook"]).name.split("_")[0]: r for r in csv.DictReader(f)}
        scores[label] = {name: (r["points"], r["status"]) for name, r in rows.items()}
        assert all(r["sandbox"].startswith(label) for r in rows.values())
    assert scores["container"]["solved"] == ("5", "passed") and scores["container"]["wrong"] == ("0", "failed")
    assert scores["container"]["stubborn"] == ("0", "timeout")
    if "bwrap" in scores:
        assert scores["container"] == scores["bwrap"]
    # the stubborn kernel ignored its shutdown; its container was removed all the same
    assert _kernels_left() == before == []


@needs_image
@needs_podman
def test_an_image_of_another_course_version_is_refused(tmp_path, monkeypatch, capsys):
    import labsupport.course.shard as shard

    real = shard.course_fingerprint()
    monkeypatch.setattr(shard, "course_fingerprint", lambda: {**real, "code_sha256": "0" * 64})
    (tmp_path / "ann_04_roofline.ipynb").write_text("not json")
    assert main(["grade", str(tmp_path), "--container", IMAGE, "--csv", str(tmp_path / "g.csv")]) == 2
    err = capsys.readouterr().err
    assert f"{IMAGE} holds another version of the course" in err and "code 000000000000" in err
    assert "its checks would score differently" in err and not (tmp_path / "g.csv").exists()
