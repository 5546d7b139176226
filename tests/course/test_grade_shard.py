"""grade --shard K/N and grade-merge: a class graded on several machines, merged into the report and
CSV one machine writes; the batch scripts of scripts/grading/."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

from labsupport.course.cli import main
from labsupport.course.sandbox import bwrap_problem
from labsupport.course.shard import Shard, ShardError, deal, parse_shard

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "grading"


# -- which shard, which notebooks (no kernels) --------------------------------------------------

@pytest.mark.parametrize("text, shard", [("0/1", Shard(0, 1)), ("2/3", Shard(2, 3)), (" 1 / 4 ", Shard(1, 4))])
def test_a_shard_is_k_of_n_counted_from_zero(text, shard):
    assert parse_shard(text, environ={}) == shard
    assert shard.filename == f"shard-{shard.index}-of-{shard.count}.json"


@pytest.mark.parametrize("text, message", [
    ("3/3", "counted from 0, so a split into 3 has shards 0/3 to 2/3"),
    ("5/3", "counted from 0"),
    ("0/0", "must be 1 or more"),
    ("1-3", "give K/N"), ("a/b", "give K/N"), ("-1/3", "give K/N"), ("3", "give K/N"), ("", "give K/N"),
])
def test_a_bad_shard_says_what_to_give(text, message):
    with pytest.raises(ShardError, match=message):
        parse_shard(text, environ={})


def test_auto_reads_a_slurm_array():
    slurm = {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "0",
             "SLURM_ARRAY_TASK_MAX": "3"}
    assert parse_shard("auto", slurm) == Shard(2, 4)
    # auto/N: the task id is the shard, so `sbatch --array=3` grades shard 3 of 8 again
    rerun = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "1", "SLURM_ARRAY_TASK_MIN": "3",
             "SLURM_ARRAY_TASK_MAX": "3"}
    assert parse_shard("auto/8", rerun) == Shard(3, 8)
    with pytest.raises(ShardError, match=r"is not --array=0-0, so its task ids are not the shards"):
        parse_shard("auto", rerun)
    with pytest.raises(ShardError, match="SLURM_ARRAY_TASK_ID=9 is not a shard 0 to 7"):
        parse_shard("auto/8", {**rerun, "SLURM_ARRAY_TASK_ID": "9"})
    with pytest.raises(ShardError, match="is not a whole number"):
        parse_shard("auto", {**slurm, "SLURM_ARRAY_TASK_ID": "x"})


def test_auto_reads_a_kubernetes_indexed_job_given_its_completions():
    assert parse_shard("auto/5", {"JOB_COMPLETION_INDEX": "4"}) == Shard(4, 5)
    with pytest.raises(ShardError, match=r"give them as --shard auto/N, N being the Job's spec.completions"):
        parse_shard("auto", {"JOB_COMPLETION_INDEX": "4"})
    with pytest.raises(ShardError, match="JOB_COMPLETION_INDEX=5 is not 0 to 4"):
        parse_shard("auto/5", {"JOB_COMPLETION_INDEX": "5"})


def test_auto_without_a_batch_system_names_the_variables():
    for text in ("auto", "auto/3"):
        with pytest.raises(ShardError) as err:
            parse_shard(text, environ={"HOME": "/root"})
        for name in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "JOB_COMPLETION_INDEX", "--shard K/N"):
            assert name in str(err.value)


def test_every_submission_is_in_exactly_one_shard_whatever_the_listing_order():
    paths = [Path(f"class/{name}_{lab}.ipynb") for name in ("zoe", "al", "Bea", "émile", "d", "c3", "c10")
             for lab in ("04_roofline", "05_phases")] + [Path("other/al_04_roofline.ipynb")]
    shuffled = paths[:]
    random.Random(7).shuffle(shuffled)
    for count in range(1, 9):
        shares = [deal(paths, Shard(k, count)) for k in range(count)]
        dealt = [p for share in shares for _, p in share]
        assert sorted(dealt) == sorted(paths) and len(dealt) == len(paths)  # each exactly once
        sizes = [len(s) for s in shares]
        assert max(sizes) - min(sizes) <= 1
        for share in shares:  # positions are places in the list given, in order
            assert all(paths[i] == p for i, p in share) and [i for i, _ in share] == sorted(i for i, _ in share)
        # another machine listing the folder in another order deals the same notebooks to each shard
        again = [{p for _, p in deal(shuffled, Shard(k, count))} for k in range(count)]
        assert again == [{p for _, p in share} for share in shares]
    assert deal(paths[:2], Shard(5, 8)) == []  # more shards than notebooks: some are empty


# -- a small class, graded on one machine and on three --------------------------------------------

def _notebook(path: Path, *cells: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, str(path))


def _class(folder: Path) -> list[str]:
    """Seven submissions, four of which start a kernel (two of the fastest labs); the same file name in
    two folders; a file that is not a notebook, one of no lab, one missing."""
    for group in ("g1", "g2"):
        (folder / group).mkdir(parents=True)
    shutil.copy(ROOT / "solutions" / "04_roofline.ipynb", folder / "g1" / "alice_04_roofline.ipynb")
    shutil.copy(ROOT / "labs" / "04_roofline.ipynb", folder / "g2" / "alice_04_roofline.ipynb")
    shutil.copy(ROOT / "labs" / "00_first_kernel.ipynb", folder / "bob_00_first_kernel.ipynb")
    shutil.copy(ROOT / "solutions" / "00_first_kernel.ipynb", folder / "carol_00_first_kernel.ipynb")
    (folder / "dave_04_roofline.ipynb").write_text("this is not json")
    _notebook(folder / "erin_notes.ipynb", "print('my notes')")
    return [str(folder), str(folder / "zed_05_phases.ipynb")]  # zed's is missing


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _table(out: str) -> str:
    """What grade or grade-merge printed, without its last line (which names the CSV)."""
    return out.rstrip("\n").rsplit("\n", 1)[0]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The class graded once whole and once as three shards (in reverse order, one with two jobs), then
    merged; every run through the command line, in the bubblewrap sandbox where it works."""
    base = tmp_path_factory.mktemp("sharded")
    paths = _class(base / "class")
    runs = {}

    def run(*argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
        return code, out.getvalue(), err.getvalue()

    runs["single"] = run("grade", *paths, "--csv", str(base / "single.csv"))
    for k in (2, 1, 0):
        runs[k] = run("grade", *paths, "--shard", f"{k}/3", "--shard-dir", str(base / "shards"),
                      *(["--jobs", "2"] if k == 1 else []))
    files = [str(base / "shards" / f"shard-{k}-of-3.json") for k in (1, 2, 0)]
    runs["merge"] = run("grade-merge", *files, "--csv", str(base / "merged.csv"))
    return base, runs


def test_sharded_then_merged_is_the_single_machine_run(sharded):
    base, runs = sharded
    assert runs["single"][0] == 0 and runs["merge"][0] == 0, runs["merge"][2]
    assert (base / "merged.csv").read_bytes() == (base / "single.csv").read_bytes()
    assert _table(runs["merge"][1]) == _table(runs["single"][1])
    rows = _rows(base / "merged.csv")
    assert len({r["notebook"] for r in rows}) == 7
    by_student = {(r["student"], r["check"]): (r["points"], r["status"]) for r in rows}
    # the same file name in two folders, graded in two shards: told apart as on one machine
    assert by_student[("g1/alice", "check_arithmetic_intensity")] == ("5", "passed")
    assert by_student[("g2/alice", "check_arithmetic_intensity")] == ("0", "not done")
    assert by_student[("carol", "check_vector_add")] == ("10", "passed")
    assert by_student[("bob", "check_vector_add")] == ("0", "not done")
    assert by_student[("dave", "-")] == ("0", "not a notebook")
    assert by_student[("zed", "-")] == ("0", "missing")


def test_each_shard_graded_only_its_share_and_wrote_a_shard_file(sharded):
    base, runs = sharded
    graded = []
    for k in range(3):
        code, out, err = runs[k]
        assert code == 0, err
        assert f"shard {k}/3" in err and f"written to {base / 'shards' / f'shard-{k}-of-3.json'}" in out
        data = json.loads((base / "shards" / f"shard-{k}-of-3.json").read_text())
        assert data["complete"] and data["shard"] == {"index": k, "count": 3}
        assert data["course"]["lab_checks_sha256"] and data["course"]["code_sha256"]
        assert data["options"]["timeout"] == 600 and data["submissions"]["count"] == 7
        graded += [entry["path"] for entry in data["notebooks"]]
    assert len(graded) == len(set(graded)) == 7
    assert runs[1][2].count("grading 2 notebook(s) (shard 1/3: 2 of 7), 2 at a time") == 1


# -- the merge refuses what is not one whole run (shards of notebooks that start no kernel) ------

@pytest.fixture
def cheap(tmp_path):
    """Three shards of five submissions that are not notebooks (graded without a kernel)."""
    folder = tmp_path / "class"
    folder.mkdir()
    for name in ("ann", "ben", "cat", "dan", "eve"):
        (folder / f"{name}_04_roofline.ipynb").write_text("not json")
    shards = tmp_path / "shards"
    for k in range(3):
        assert main(["grade", str(folder), "--shard", f"{k}/3", "--shard-dir", str(shards), "--no-sandbox"]) == 0
    return tmp_path, folder, shards


def _merge_error(capsys, *argv) -> str:
    capsys.readouterr()
    assert main(["grade-merge", *argv]) == 2
    return capsys.readouterr().err


def test_a_folder_of_shards_merges(cheap, capsys):
    tmp, _, shards = cheap
    assert main(["grade-merge", str(shards), "--csv", str(tmp / "g.csv")]) == 0
    assert [r["student"] for r in _rows(tmp / "g.csv")] == ["ann", "ben", "cat", "dan", "eve"]
    assert "merging 3 shard(s) of 5 notebook(s)" in capsys.readouterr().err
    assert "already exists" in _merge_error(capsys, str(shards), "--csv", str(tmp / "g.csv"))


def test_a_missing_shard_is_named(cheap, capsys):
    tmp, _, shards = cheap
    (shards / "shard-1-of-3.json").unlink()
    err = _merge_error(capsys, str(shards), "--csv", str(tmp / "g.csv"))
    assert "shard 1/3 is missing (no shard-1-of-3.json among the files given)" in err and "--shard 1/3" in err
    assert not (tmp / "g.csv").exists()


def test_a_shard_given_twice_is_named(cheap, capsys):
    tmp, _, shards = cheap
    copy = tmp / "copy.json"
    shutil.copy(shards / "shard-2-of-3.json", copy)
    err = _merge_error(capsys, str(shards), str(copy), "--csv", str(tmp / "g.csv"))
    assert f"shard 2/3 is given 2 times: {shards / 'shard-2-of-3.json'}, {copy}" in err


def test_shards_of_different_splits_courses_options_or_classes_are_refused(cheap, capsys):
    tmp, folder, shards = cheap
    other = tmp / "other"
    assert main(["grade", str(folder), "--shard", "0/2", "--shard-dir", str(other), "--no-sandbox"]) == 0
    err = _merge_error(capsys, str(shards / "shard-0-of-3.json"), str(other / "shard-0-of-2.json"))
    assert "is shard 0/3 but" in err and "is shard 0/2: they come from splits into different numbers" in err

    assert main(["grade", str(folder), "--shard", "1/3", "--shard-dir", str(other), "--no-sandbox",
                 "--timeout", "60"]) == 0
    err = _merge_error(capsys, str(shards / "shard-0-of-3.json"), str(other / "shard-1-of-3.json"),
                       str(shards / "shard-2-of-3.json"))
    assert "different options: timeout (600 and 60)" in err

    (folder / "fay_04_roofline.ipynb").write_text("not json")  # a late submission
    assert main(["grade", str(folder), "--shard", "2/3", "--shard-dir", str(other), "--no-sandbox"]) == 0
    err = _merge_error(capsys, str(shards / "shard-0-of-3.json"), str(shards / "shard-1-of-3.json"),
                       str(other / "shard-2-of-3.json"))
    assert "were given different submissions (5 and 6 notebooks" in err
    assert f"only the second has {folder / 'fay_04_roofline.ipynb'})" in err and "only the first" not in err

    damaged = json.loads((shards / "shard-1-of-3.json").read_text())
    damaged["course"]["lab_checks_sha256"] = "0" * 64  # as written by a checkout with other checks
    (shards / "shard-1-of-3.json").write_text(json.dumps(damaged))
    err = _merge_error(capsys, str(shards))
    assert "different course versions: lab_checks_sha256" in err and "one checkout or image" in err


def test_an_unfinished_shard_is_refused(cheap, capsys):
    tmp, _, shards = cheap
    data = json.loads((shards / "shard-0-of-3.json").read_text())
    data["complete"] = False  # as a shard killed while grading leaves it
    (shards / "shard-0-of-3.json").write_text(json.dumps(data))
    err = _merge_error(capsys, str(shards), "--csv", str(tmp / "g.csv"))
    assert "shard 0/3 did not finish" in err and "Grade shard 0/3 again, with --overwrite" in err


def test_files_that_are_not_shard_files_are_refused(cheap, capsys):
    tmp, _, shards = cheap
    (tmp / "grades.csv").write_text("notebook,student\n")
    (tmp / "other.json").write_text(json.dumps({"labs": {}}))
    for path in (tmp / "grades.csv", tmp / "other.json"):
        err = _merge_error(capsys, str(shards / "shard-0-of-3.json"), str(path))
        assert f"{path} is not a shard file written by `python -m labsupport grade --shard K/N`" in err
    assert "no such file" in _merge_error(capsys, str(tmp / "nowhere.json"))
    assert "holds no shard files" in _merge_error(capsys, str(tmp / "class"))


def test_an_empty_shard_writes_an_empty_shard_file(tmp_path, capsys):
    folder = tmp_path / "class"
    folder.mkdir()
    (folder / "ann_04_roofline.ipynb").write_text("not json")
    for k in range(3):
        assert main(["grade", str(folder), "--shard", f"{k}/3", "--shard-dir", str(tmp_path / "s"),
                     "--no-sandbox"]) == 0
    assert "shard 2/3: no notebooks in this shard" in capsys.readouterr().out
    empty = json.loads((tmp_path / "s" / "shard-2-of-3.json").read_text())
    assert empty["complete"] and empty["notebooks"] == [] and empty["expected"] == 0
    assert main(["grade-merge", str(tmp_path / "s"), "--csv", str(tmp_path / "g.csv")]) == 0
    assert [r["status"] for r in _rows(tmp_path / "g.csv")] == ["not a notebook"]


def test_grade_with_shard_refuses_a_csv_and_an_existing_shard_file(cheap, capsys):
    tmp, folder, shards = cheap
    capsys.readouterr()
    assert main(["grade", str(folder), "--shard", "0/3", "--csv", str(tmp / "g.csv")]) == 2
    assert "give it to `python -m labsupport grade-merge`" in capsys.readouterr().err
    assert main(["grade", str(folder), "--shard", "0/3", "--shard-dir", str(shards), "--no-sandbox"]) == 2
    assert "shard-0-of-3.json already exists" in capsys.readouterr().err
    assert main(["grade", str(folder), "--shard", "0/3", "--shard-dir", str(shards), "--no-sandbox",
                 "--overwrite"]) == 0
    assert (shards / "shard-0-of-3.json.bak").exists()
    assert main(["grade", str(folder), "--shard", "3/3"]) == 2
    assert "shards are counted from 0" in capsys.readouterr().err


# -- the batch scripts ---------------------------------------------------------------------------

@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_the_shell_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_slurm_array_script_grades_its_shard(tmp_path):
    """The array task script, run as Slurm would run task 1 of 2 (its variables set), then the merge."""
    folder = tmp_path / "class"
    folder.mkdir()
    for name in ("ann", "ben", "cat"):
        (folder / f"{name}_04_roofline.ipynb").write_text("not json")
    env = {**os.environ, "PYTHON": sys.executable, "SHARDS": "2", "GRADE_ARGS": "--no-sandbox",
           "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "1"}
    for k in (0, 1):
        done = subprocess.run(["bash", str(SCRIPTS / "slurm_grade_array.sh"), str(folder), str(tmp_path / "out")],
                              env={**env, "SLURM_ARRAY_TASK_ID": str(k)}, capture_output=True, text=True,
                              cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out" / "shards").iterdir()) == ["shard-0-of-2.json",
                                                                               "shard-1-of-2.json"]
    assert main(["grade-merge", str(tmp_path / "out" / "shards"), "--csv", str(tmp_path / "g.csv")]) == 0
    assert [r["student"] for r in _rows(tmp_path / "g.csv")] == ["ann", "ben", "cat"]


def test_the_kubernetes_manifests_are_an_indexed_job_and_its_merge():
    shards = list(yaml.safe_load_all((SCRIPTS / "k8s_grade_job.yaml").read_text()))
    job = next(d for d in shards if d and d["kind"] == "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    container = spec["template"]["spec"]["containers"][0]
    command = " ".join(container["command"] + container.get("args", []))
    assert "-m labsupport grade" in command and f"--shard auto/{spec['completions']}" in command
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    merge = next(d for d in yaml.safe_load_all((SCRIPTS / "k8s_merge_job.yaml").read_text()) if d)
    merge_command = " ".join(merge["spec"]["template"]["spec"]["containers"][0]["command"])
    assert "-m labsupport grade-merge" in merge_command
    # both run as the image's non-root user, with the results volume made writable for it
    for pod in (spec["template"]["spec"], merge["spec"]["template"]["spec"]):
        context = pod["securityContext"]
        assert context["runAsNonRoot"] and context["runAsUser"] == context["fsGroup"] == 1000
    assert "useradd --create-home --uid 1000 grader" in (SCRIPTS / "Dockerfile").read_text()


def test_require_sandbox_stops_where_bubblewrap_cannot_work(tmp_path, monkeypatch, capsys):
    (tmp_path / "ann_04_roofline.ipynb").write_text("not json")
    monkeypatch.setenv("PATH", str(tmp_path / "no-bwrap-here"))  # no bwrap on the PATH
    bwrap_problem.cache_clear()
    try:
        assert main(["grade", str(tmp_path), "--require-sandbox", "--csv", str(tmp_path / "g.csv")]) == 2
        assert "--require-sandbox: no sandbox here (bwrap is not installed" in capsys.readouterr().err
        assert not (tmp_path / "g.csv").exists()
        # an explicit --no-sandbox is no fallback: it grades, every row saying UNSANDBOXED
        assert main(["grade", str(tmp_path), "--require-sandbox", "--no-sandbox", "--csv",
                     str(tmp_path / "g.csv")]) == 0
        assert _rows(tmp_path / "g.csv")[0]["sandbox"].startswith("UNSANDBOXED")
    finally:
        bwrap_problem.cache_clear()


def test_the_dockerfile_installs_the_course_for_kernels_and_graders():
    text = (SCRIPTS / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", text)  # continuation lines joined
    instructions = [line.split()[0] for line in logical.splitlines() if line.strip() and not line.startswith("#")]
    known = {"FROM", "RUN", "COPY", "WORKDIR", "USER", "ENV", "ARG", "LABEL"}
    assert instructions[0] == "FROM" and set(instructions) <= known, instructions
    for needed in ("bubblewrap", "util-linux", "-r requirements-cpu.txt", "-r requirements.txt",
                   "import labsupport.checks, ipykernel"):
        assert needed in logical
    for name in ("requirements-cpu.txt", "requirements.txt"):
        assert (ROOT / name).exists()


def test_a_negative_shard_reaches_the_shard_message(tmp_path, capsys):
    """argparse alone would read ``-1/2`` as an option and say only "expected one argument"."""
    assert main(["grade", str(tmp_path), "--shard", "-1/2"]) == 2
    err = capsys.readouterr().err
    assert "--shard '-1/2': give K/N" in err and "expected one argument" not in err
