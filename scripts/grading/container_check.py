"""Grade one folder of notebooks in bubblewrap and in containers, and check that the scores agree.

The manual check behind the README's "Grading in containers" (an image build takes minutes, so it is
not part of ``make test``). It writes a folder of submissions (every solution notebook, every fresh
learner notebook, and lab 04's planted cheats and wrong answers from
``tests/course/test_grade_sandbox.py``, plus a notebook past the memory limit and one that hangs),
grades it with ``python -m labsupport grade`` in bubblewrap, then with ``--container IMAGE`` as this
user (rootful podman when that is root) and, with ``--user NAME``, as that ordinary user (rootless
podman, with the image loaded into that user's store), compares the CSVs row for row and writes what
was run (commands, versions, timings, machine, date) and what differed to ``--out``:

    bash scripts/grading/build_image.sh course-grader:test
    .venv/bin/python scripts/grading/container_check.py course-grader:test --user grader

``--runtime runc`` grades with podman's runc instead of its default OCI runtime (crun 1.8 refuses a
machine whose cgroups are mixed v1 and v2), through a ``CONTAINERS_CONF`` file of its own.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "course"))
from test_grade_sandbox import CHEATS, CHECK_CELL, EXERCISE, HARMFUL, HONEST, MARKER  # noqa: E402

# compared row for row; `sandbox` names the sandbox, so it differs by design
COMPARED = ("student", "lab", "check", "points", "max_points", "status", "flags", "detail", "learner_cells", "ignored")
EXTRA = {  # lab 04 exercise cells that test the limits both sandboxes set
    "memory": "big = bytearray(12 * 2**30)  # past the 8 GiB the kernel may map\n" + HONEST["good"],
    "bigfile": ("with open('big.bin', 'wb') as f:\n    f.write(b'0' * (2**31 + 2**20))  # one file past 2 GiB\n"
                + HONEST["good"]),
}
HANG = "import time\ntime.sleep(10**6)\n" + HONEST["good"]


def _lab04(path: Path, exercise: str, check_cell: str | None = None) -> None:
    nb = nbformat.read(str(ROOT / "labs" / "04_roofline.ipynb"), as_version=4)
    for cell in nb.cells:
        if cell.get("id") == EXERCISE:
            cell.source = exercise
        elif check_cell is not None and cell.get("id") == CHECK_CELL:
            cell.source = check_cell
    nbformat.write(nb, str(path))


def make_submissions(folder: Path, csv_path: Path) -> tuple[Path, Path]:
    """The main folder (solutions, fresh labs, lab 04's cheats and limits) and one with a hung cell."""
    main, hung = folder / "class", folder / "hung"
    main.mkdir(parents=True)
    hung.mkdir()
    for lab in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        shutil.copy(lab, main / f"solved_{lab.name}")
        shutil.copy(ROOT / "labs" / lab.name, main / f"fresh_{lab.name}")
    for name, source in {**CHEATS, **HARMFUL, **HONEST, **EXTRA}.items():
        source = source.replace("FOLDER", repr(str(main))).replace("CSV", repr(str(csv_path)))
        _lab04(main / f"{name}_04_roofline.ipynb", source,
               "print('PASSED check_arithmetic_intensity')" if name == "edited" else None)
    _lab04(hung / "hang_04_roofline.ipynb", HANG)
    return main, hung


def _version(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not run ({exc})"
    return (done.stdout.strip() or done.stderr.strip()).splitlines()[0] if done.returncode == 0 else \
        f"exit {done.returncode}: {done.stderr.strip()[-300:]}"


def grade(label: str, argv: list[str], env: dict, cwd: Path, as_user: str | None = None) -> dict:
    """Run one grading command; its wall time, exit code and per-notebook seconds."""
    # runuser keeps this environment (the kernels' numbers depend on some of it, OPENBLAS_* for one);
    # podman finds the user's own store from HOME, and its runtime folder without root's XDG_RUNTIME_DIR
    home = Path(f"~{as_user}").expanduser() if as_user else None
    command = argv if as_user is None else ["runuser", "-u", as_user, "--", "env", "-u", "XDG_RUNTIME_DIR",
                                            f"HOME={home}", *argv]
    print(f"== {label}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=4 * 3600)
    seconds = time.perf_counter() - start
    print(done.stderr[-2000:], flush=True)
    per_notebook = {Path(m.group(1)).name: int(m.group(2))
                    for m in re.finditer(r"^  (\S+\.ipynb): .*\[(\d+) s\]$", done.stderr, re.M)}
    notes = [line for line in done.stderr.splitlines() if line.startswith("grade: ")]
    return {"label": label, "command": command, "user": as_user or _whoami(), "exit": done.returncode,
            "wall_s": round(seconds, 1), "notebook_s": per_notebook, "grader_notes": notes,
            "stderr_tail": done.stderr[-1500:] if done.returncode else ""}


def _whoami() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def read_rows(path: Path) -> dict[tuple[str, str], dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return {(Path(r["notebook"]).name, r["check"]): r for r in csv.DictReader(f)}


def compare(reference: dict, other: dict) -> dict:
    """Rows keyed by (notebook, check): how many agree on every compared column, and each that does not."""
    differences = []
    for key in sorted(set(reference) | set(other)):
        a, b = reference.get(key), other.get(key)
        if a is None or b is None:
            differences.append({"row": list(key), "only_in": "reference" if b is None else "container"})
            continue
        fields = {f: [a[f], b[f]] for f in COMPARED if a[f] != b[f]}
        if fields:
            differences.append({"row": list(key), "fields": fields})
    scores = all(reference.get(k, {}).get("points") == other.get(k, {}).get("points") and
                 reference.get(k, {}).get("status") == other.get(k, {}).get("status")
                 for k in set(reference) | set(other))
    return {"rows": len(reference), "rows_container": len(other), "scores_equal": scores,
            "rows_identical": len(set(reference) | set(other)) - len(differences), "differences": differences}


def machine() -> dict:
    meminfo = Path("/proc/meminfo").read_text().split()
    return {"host": platform.node(), "kernel": platform.release(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "memory_gib": round(int(meminfo[1]) / 2**20, 1),
            "os": _version(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
            "cgroups": "v2" if Path("/sys/fs/cgroup/cgroup.controllers").exists() else "v1 (hybrid)"
            if Path("/sys/fs/cgroup/unified").exists() else "v1",
            "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("image", help="the image to grade in (scripts/grading/build_image.sh builds one)")
    parser.add_argument("--user", help="also grade as this ordinary user, with rootless podman (the image is "
                                       "loaded into that user's store first)")
    parser.add_argument("--runtime", help="podman's OCI runtime to use (such as runc), through CONTAINERS_CONF")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "results" / "grading_container.json"))
    parser.add_argument("--work", help="the folder to grade in (default: a new one in /tmp, world-readable)")
    args = parser.parse_args(argv)

    python = sys.executable
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="container-check-"))
    work.mkdir(parents=True, exist_ok=True)
    main_folder, hung_folder = make_submissions(work / "submissions", work / f"{MARKER}.csv")
    env = {**os.environ}
    if args.runtime:
        conf = work / "containers.conf"
        conf.write_text(f'[engine]\nruntime = "{args.runtime}"\n')
        env["CONTAINERS_CONF"] = str(conf)
    runs, results = [], {}
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()

    def run_all(label: str, extra: list[str], as_user: str | None = None) -> None:
        out = work / label
        out.mkdir()
        if as_user:
            shutil.chown(out, as_user)
        for part, folder, options in (("class", main_folder, []), ("hung", hung_folder, ["--timeout", "30"])):
            csv_path = out / f"{MARKER}-{part}.csv"  # the marker the cheats look for in the grader's command line
            command = [python, "-m", "labsupport", "grade", str(folder), "--csv", str(csv_path), "--jobs",
                       str(args.jobs), *options, *extra]
            runs.append(grade(f"{label}/{part}", command, env, out, as_user))
            results[f"{label}/{part}"] = read_rows(csv_path) if csv_path.exists() else {}

    run_all("bwrap", ["--require-sandbox"])
    run_all("podman", ["--container", args.image])
    if args.user:
        load = time.perf_counter()
        subprocess.run(f"podman save {args.image} | runuser -u {args.user} -- podman load",
                       shell=True, check=True, capture_output=True, env=env)
        runs.append({"label": f"podman save | podman load ({args.user})", "wall_s": round(time.perf_counter() - load, 1)})
        shutil.chown(work, args.user)
        run_all(f"podman-{args.user}", ["--container", args.image], as_user=args.user)

    comparisons = {}
    for label in results:
        if not label.startswith("bwrap/"):
            part = label.split("/")[1]
            comparisons[label] = compare(results[f"bwrap/{part}"], results[label])
    inspect = subprocess.run(["podman", "image", "inspect", args.image, "--format",
                              "{{.Id}} {{.Size}} {{json .Config.Labels}}"], capture_output=True, text=True, env=env)
    image_id, size, labels = (inspect.stdout.strip().split(" ", 2) + ["", "", "{}"])[:3]
    report = {
        "what": "the same submissions graded in bubblewrap and in podman containers, compared row for row",
        "date": started.isoformat(timespec="seconds"),
        "machine": {**machine(), "load_average_before": load_before},
        "versions": {
            "python": platform.python_version(), "podman": _version(["podman", "--version"]),
            "podman_runtime": args.runtime or _version(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"]),
            "runtime_version": _version([args.runtime or "crun", "--version"]),
            "bubblewrap": _version(["bwrap", "--version"]),
            "labsupport_commit": _version(["git", "-C", str(ROOT), "rev-parse", "HEAD"]),
        },
        "image": {"name": args.image, "id": image_id[:12], "size_mb": round(int(size or 0) / 1e6),
                  "labels": json.loads(labels or "{}")},
        "submissions": {"class": sorted(p.name for p in main_folder.iterdir()),
                        "hung": sorted(p.name for p in hung_folder.iterdir())},
        "runs": runs,
        "comparisons": comparisons,
        "all_scores_equal": bool(comparisons) and all(c["scores_equal"] for c in comparisons.values()),
    }
    Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for label, c in comparisons.items():
        print(f"{label}: {c['rows']} rows in bwrap, {c['rows_container']} in the container; scores equal: "
              f"{c['scores_equal']}; rows identical in every compared column: {c['rows_identical']}")
    print(f"written to {args.out}")
    return 0 if report["all_scores_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
