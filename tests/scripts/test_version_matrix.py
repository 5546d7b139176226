"""The version matrix: the pinned combination (the default) and the newest Triton and numpy
(`make test-matrix`); the README lists what is tested."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pins(name: str) -> dict[str, str]:
    """{package: exact version or specifier} from a requirements file."""
    found = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.match(r"([A-Za-z0-9_-]+)\s*(.*)", line)
        if match:
            found[match.group(1).lower()] = match.group(2).strip()
    return found


def version(spec: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.search(r"==\s*([\d.]+)", spec).group(1).split("."))


def test_the_two_combinations_differ_where_they_should():
    default, latest = pins("requirements-cpu.txt"), pins("requirements-latest.txt")
    assert default["torch"] == latest["torch"] == "==2.13.0"  # the CPU wheel both use
    assert default["triton"] == "==3.6.0" and "<2.4" in default["numpy"]  # 3.6's interpreter needs numpy < 2.4
    assert version(latest["triton"]) > version(default["triton"])
    assert version(latest["numpy"]) >= (2, 4)  # past the default's upper pin
    assert "numpy" in pins("requirements.txt") and "<2.4" not in pins("requirements.txt")["numpy"], (
        "the triton-3.6 numpy pin belongs in requirements-cpu.txt, or the latest venv cannot install")


def test_readme_lists_the_tested_combinations():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Tested combinations", 1)[1].split("\n## ", 1)[0]
    for name in ("requirements-cpu.txt", "requirements-latest.txt"):
        for package in ("torch", "triton", "numpy"):
            spec = pins(name)[package]
            shown = spec.removeprefix("==") if spec.startswith("==") else spec
            assert f"{package} {shown}" in section, f"README's tested combinations miss {package} {shown} ({name})"


def test_make_test_matrix_runs_both_venvs_and_ci_runs_the_latest():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ntest-matrix:", 1)[1].split("\n\n", 1)[0]
    assert "$(call matrix_run,$(VENV))" in recipe and "$(call matrix_run,$(VENV_LATEST))" in recipe
    assert "--cpu-requirements requirements-latest.txt" in makefile
    assert "make test-latest" in (ROOT / ".ci" / "run").read_text()
