"""Grading a large class on several machines: ``grade --shard K/N`` and ``grade-merge``.

Every machine is given the same submissions (the same paths, on a shared file system or the same
volume) and grades only its share of them: the notebooks are put in a fixed order (their paths
sorted as text, so neither the argument order nor a machine's directory listing changes it) and
dealt round-robin, the i-th of the sorted list to shard ``i mod N``. Each submission is in exactly
one shard, and the shards' sizes differ by one at most.

A shard writes what it graded to a shard file, ``shard-K-of-N.json``: every row with all the CSV's
columns, each notebook's place in the order a single-machine run grades them (so the merge writes
the rows in that order), the course it was graded with (the package version, the git commit where
there is one, and digests of ``lab_checks.json`` and of the package's code), the options that change
a score, and a digest of the whole list of submissions it was given. The file is rewritten after
every notebook and marked complete only at the end.

``grade-merge`` reads the shard files and refuses a set that is not one whole run: a file that is not
a shard file, a shard that did not finish, shards of different splits, courses, options or lists of
submissions, a shard given twice or missing. It then writes the same table and the same CSV that
``grade`` writes when one machine grades everything.

This module needs no notebook runner (nbformat, nbclient, ipykernel), so the merge runs where the
package is installed without the ``grade`` extra.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import labsupport

from .files import each_once, write_atomically
from .report import Row, escape_surrogates

FORMAT = "labsupport-grade-shard"
FORMAT_VERSION = 1
PACKAGE = Path(labsupport.__file__).resolve().parent
COURSE_ROOT = PACKAGE.parent
ROW_FIELDS = [f.name for f in dataclasses.fields(Row)]
SHARD_NAME = re.compile(r"shard-(\d+)-of-(\d+)\.json")
# the options that change a score: shards graded with different ones are not one run (--jobs is not one)
SCORING_OPTIONS = ("lab", "timeout", "notebook_timeout", "memory", "as_is", "all_cells", "sandbox")


class ShardError(Exception):
    """A bad --shard, or shard files that do not make one whole run; the message says what to do."""


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def filename(self) -> str:
        return f"shard-{self.index}-of-{self.count}.json"


# -- which shard --------------------------------------------------------------------------------

AUTO_HELP = ("--shard auto reads the shard from the batch system: SLURM_ARRAY_TASK_ID and "
             "SLURM_ARRAY_TASK_COUNT in a Slurm job array (sbatch --array=0-(N-1)), or JOB_COMPLETION_INDEX "
             "in a Kubernetes indexed Job, which does not export its number of completions (give them as "
             "--shard auto/N; auto/N also takes the shard from SLURM_ARRAY_TASK_ID, whatever the array's size)")


def parse_shard(text: str, environ: Mapping[str, str] | None = None) -> Shard:
    """``K/N`` (shard K of N, counted from 0), ``auto`` or ``auto/N`` (from the batch system's
    variables, see :data:`AUTO_HELP`)."""
    environ = os.environ if environ is None else environ
    raw = str(text).strip()
    match = re.fullmatch(r"(auto|\d+)\s*/\s*(\d+)|auto", raw)
    if not match:
        raise ShardError(f"--shard {text!r}: give K/N (this machine grades shard K of N, counted from 0: "
                         f"0/4, 1/4, 2/4, 3/4), or auto, or auto/N")
    count = int(match.group(2)) if match.group(2) else None
    if count is not None and count < 1:
        raise ShardError(f"--shard {raw}: the number of shards must be 1 or more")
    if raw.startswith("auto"):
        return shard_from_environment(environ, count)
    index = int(match.group(1))
    if index >= count:
        raise ShardError(f"--shard {raw}: shards are counted from 0, so a split into {count} has shards "
                         f"0/{count} to {count - 1}/{count}")
    return Shard(index, count)


def _integer(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ShardError(f"--shard auto: {name}={value!r} is not a whole number") from None


def shard_from_environment(environ: Mapping[str, str], count: int | None = None) -> Shard:
    """The shard a Slurm array task or a Kubernetes indexed Job's pod is (``count`` from ``auto/N``)."""
    task = _integer(environ, "SLURM_ARRAY_TASK_ID")
    if task is not None:
        if count is not None:  # auto/N: the task id is the shard, whatever the array (--array=3 reruns shard 3)
            if not 0 <= task < count:
                raise ShardError(f"--shard auto/{count}: SLURM_ARRAY_TASK_ID={task} is not a shard 0 to {count - 1}; "
                                 f"submit the array as --array=0-{count - 1} (or a part of that range)")
            return Shard(task, count)
        tasks = _integer(environ, "SLURM_ARRAY_TASK_COUNT")
        first = _integer(environ, "SLURM_ARRAY_TASK_MIN")
        last = _integer(environ, "SLURM_ARRAY_TASK_MAX")
        if tasks is None:
            raise ShardError("--shard auto: SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not (an old "
                             "Slurm?); give the number of shards as --shard auto/N")
        if (first or 0) != 0 or (last is not None and last != tasks - 1) or not 0 <= task < tasks:
            raise ShardError(f"--shard auto: this Slurm array (task {task}; {tasks} tasks, ids {first} to {last}) "
                             f"is not --array=0-{tasks - 1}, so its task ids are not the shards; submit "
                             f"--array=0-(N-1), or give the number of shards as --shard auto/N (then each task "
                             f"grades the shard of its id, and --array=3 grades shard 3 again)")
        return Shard(task, tasks)
    index = _integer(environ, "JOB_COMPLETION_INDEX")
    if index is not None:
        if count is None:
            raise ShardError("--shard auto: JOB_COMPLETION_INDEX is set (a Kubernetes indexed Job) but Kubernetes "
                             "does not say how many completions the Job has: give them as --shard auto/N, "
                             "N being the Job's spec.completions")
        if not 0 <= index < count:
            raise ShardError(f"--shard auto/{count}: JOB_COMPLETION_INDEX={index} is not 0 to {count - 1}; "
                             f"is N the Job's spec.completions?")
        return Shard(index, count)
    raise ShardError(f"{AUTO_HELP}. None of these variables is set here: give --shard K/N instead")


# -- which notebooks ----------------------------------------------------------------------------

def _text(path: Path | str) -> str:
    return escape_surrogates(str(path))


def deal(notebooks: list[Path], shard: Shard) -> list[tuple[int, Path]]:
    """The notebooks of ``shard``, each with its place in ``notebooks`` (the order a single-machine run
    grades and reports them): the paths sorted as text, dealt round-robin."""
    order = sorted(range(len(notebooks)), key=lambda i: (str(notebooks[i]).encode("utf-8", "surrogateescape"), i))
    mine = sorted(order[shard.index::shard.count])
    return [(i, notebooks[i]) for i in mine]


def submissions_digest(notebooks: list[Path]) -> str:
    """A digest of the list of submissions, in order: the shards of one run were all given the same."""
    text = "\n".join(str(p) for p in notebooks).encode("utf-8", "surrogateescape")
    return hashlib.sha256(text).hexdigest()


# -- which course -------------------------------------------------------------------------------

def _sha256_file(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "missing"


def course_fingerprint() -> dict:
    """What the grader's course is: version, git commit (where it is a checkout), and digests of
    ``lab_checks.json`` and of every Python file of the package (the checks, the grader)."""
    code = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        code.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    commit = ""
    if (COURSE_ROOT / ".git").exists() and shutil.which("git"):
        try:
            done = subprocess.run(["git", "-C", str(COURSE_ROOT), "rev-parse", "HEAD"], capture_output=True,
                                  text=True, timeout=30)
            commit = done.stdout.strip() if done.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired):
            commit = ""
    return {"labsupport": labsupport.__version__, "commit": commit,
            "lab_checks_sha256": _sha256_file(PACKAGE / "lab_checks.json"), "code_sha256": code.hexdigest()}


# -- the shard file -----------------------------------------------------------------------------

def _write_json(data: dict, path: Path) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""

    def write(f) -> None:
        json.dump(data, f, indent=1)
        f.write("\n")

    write_atomically(path, write, encoding="utf-8")


class ShardFile:
    """One shard's results, rewritten after every notebook (``complete`` only at the end), so a shard
    that is killed keeps what it graded and the merge knows it did not finish.

    Like the CSV: an existing file is refused unless ``overwrite`` (the old one is kept as ``.bak``),
    and if the file cannot be written mid-way the results go on to a temporary file, named in
    ``fallback``. Safe to call from several threads.
    """

    def __init__(self, folder: Path, shard: Shard, overwrite: bool = False):
        self.folder = Path(folder)
        self.shard = shard
        self.path = self.folder / shard.filename
        self.overwrite = overwrite
        self.header: dict = {}
        self.graded: dict[int, dict] = {}
        self.fallback: Path | None = None
        self.error: OSError | None = None
        self._lock = threading.Lock()

    def check(self) -> None:
        """Raise OSError if the file could not or should not be written (before any grading)."""
        if self.folder.exists() and not self.folder.is_dir():
            raise NotADirectoryError(f"--shard-dir {self.folder} is a file; give a folder for the shard files")
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            if not self.overwrite:
                raise FileExistsError(f"{self.path} already exists (this shard was graded before?); give "
                                      f"--overwrite to replace it (the old file is kept as {self.path.name}.bak), "
                                      f"or choose another --shard-dir")
            if read_shard_header(self.path) is None:
                raise FileExistsError(f"{self.path} exists and is not a shard file written by this command; "
                                      f"choose another --shard-dir")
        if not os.access(self.folder, os.W_OK | os.X_OK):
            raise PermissionError(f"cannot write in --shard-dir {self.folder}: the folder is not writable")

    def start(self, header: dict) -> None:
        self.check()
        if self.path.exists():
            shutil.copy2(self.path, self.path.with_name(self.path.name + ".bak"))
        self.header = header
        with self._lock:
            self._write(complete=False)

    def add(self, position: int, path: Path, rows: list[Row]) -> None:
        with self._lock:
            self.graded[position] = {"position": position, "path": _text(path),
                                     "rows": [dataclasses.asdict(r) for r in rows]}
            self._write(complete=False)

    def finish(self) -> Path:
        with self._lock:
            self._write(complete=True)
            return self.fallback or self.path

    def _write(self, complete: bool) -> None:
        data = {**self.header, "complete": complete, "graded": len(self.graded),
                "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) if complete else None,
                "notebooks": [self.graded[k] for k in sorted(self.graded)]}
        if self.fallback is None:
            try:
                _write_json(data, self.path)
                return
            except OSError as exc:
                self.error = exc
                fd, name = tempfile.mkstemp(prefix=f"grade-{self.path.stem}-", suffix=".json")
                os.close(fd)
                self.fallback = Path(name)
        _write_json(data, self.fallback)


def shard_header(shard: Shard, notebooks: list[Path], paths: list[str], options: dict, jobs: int) -> dict:
    """Everything a shard file says before its results (see the module's docstring)."""
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "shard": {"index": shard.index, "count": shard.count},
        "course": course_fingerprint(),
        "options": {k: options.get(k) for k in SCORING_OPTIONS},
        "submissions": {"paths": [_text(p) for p in paths], "count": len(notebooks),
                        "sha256": submissions_digest(notebooks), "notebooks": [_text(p) for p in notebooks]},
        "expected": len(deal(notebooks, shard)),
        "host": socket.gethostname(), "jobs": jobs,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# -- the merge ----------------------------------------------------------------------------------

def read_shard_header(path: Path) -> dict | None:
    """The shard file's contents, or None when ``path`` is not a shard file (any JSON of another kind,
    or not JSON)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def _not_a_shard(path: Path, why: str) -> ShardError:
    return ShardError(f"{path} is not a shard file written by `python -m labsupport grade --shard K/N` ({why}); "
                      f"give the shard files (or the --shard-dir folder that holds them)")


def read_shard(path: Path) -> dict:
    """A shard file, checked to be one and whole: its rows as :class:`Row` objects under ``rows``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ShardError(f"{path}: no such file") from None
    except OSError as exc:
        raise ShardError(f"{path} cannot be read ({exc})") from None
    except ValueError as exc:
        raise _not_a_shard(path, f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _not_a_shard(path, "it has no \"format\": \"labsupport-grade-shard\"")
    if data.get("format_version") != FORMAT_VERSION:
        raise ShardError(f"{path} is a shard file of format version {data.get('format_version')!r}; this grader "
                         f"reads version {FORMAT_VERSION}: merge with the grader that wrote it")
    try:
        index, count = int(data["shard"]["index"]), int(data["shard"]["count"])
        notebooks = data["notebooks"]
        entries = []
        for entry in notebooks:
            rows = []
            for fields in entry["rows"]:
                if sorted(fields) != sorted(ROW_FIELDS):
                    raise KeyError(f"a row with the fields {sorted(fields)}")
                rows.append(Row(**fields))
            entries.append((int(entry["position"]), str(entry["path"]), rows))
        for key in ("course", "options", "submissions"):
            if not isinstance(data[key], dict):
                raise TypeError(f"{key} is not an object")
        int(data["submissions"]["count"])
    except (KeyError, TypeError, ValueError) as exc:
        raise _not_a_shard(path, f"damaged: {type(exc).__name__}: {exc}") from None
    if not 0 <= index < count:
        raise _not_a_shard(path, f"damaged: shard {index}/{count}")
    data["entries"] = entries
    data["label"] = Shard(index, count)
    return data


def shard_paths(arguments: Iterable[str]) -> list[Path]:
    """Files as given; a folder becomes the ``shard-K-of-N.json`` files in it; no file twice."""
    found: list[Path] = []
    for raw in arguments:
        path = Path(raw)
        if path.is_dir():
            inside = sorted(p for p in path.iterdir() if SHARD_NAME.fullmatch(p.name))
            if not inside:
                raise ShardError(f"{path} holds no shard files (shard-K-of-N.json); give the --shard-dir the "
                                 f"shards wrote to")
            found.extend(inside)
        else:
            found.append(path)
    return each_once(found)


def _list_difference(a: dict, b: dict, shown: int = 3) -> str:
    """``; only the first has x.ipynb; only the second has y.ipynb`` from two shards' lists of
    notebooks (empty when a shard file has no list, or the lists hold the same notebooks)."""
    first, second = a.get("notebooks"), b.get("notebooks")
    if not isinstance(first, list) or not isinstance(second, list):
        return ""
    parts = []
    for label, mine, theirs in (("the first", first, second), ("the second", second, first)):
        only = [p for p in mine if p not in set(theirs)]
        if only:
            more = f" and {len(only) - shown} more" if len(only) > shown else ""
            parts.append(f"only {label} has {', '.join(map(str, only[:shown]))}{more}")
    return "".join(f"; {part}" for part in parts)


def _differ(name: str, first: tuple[Path, object], other: tuple[Path, object], what: str) -> ShardError:
    return ShardError(f"{first[0]} and {other[0]} were graded with different {name} ({first[1]} and "
                      f"{other[1]}): {what}")


def merge(arguments: Iterable[str]) -> tuple[list[Row], list[dict]]:
    """The rows of every shard, in the order one machine grading everything writes them, and the
    shard files read; :class:`ShardError` when the files are not exactly one whole run."""
    paths = shard_paths(arguments)
    if not paths:
        raise ShardError("no shard files given")
    shards = [(path, read_shard(path)) for path in paths]
    first_path, first = shards[0]
    count = first["label"].count
    for path, data in shards[1:]:
        if data["label"].count != count:
            raise ShardError(f"{first_path} is shard {first['label']} but {path} is shard {data['label']}: they "
                             f"come from splits into different numbers of shards; merge the shards of one run")
    for path, data in shards:
        if not data.get("complete"):
            raise ShardError(f"{path}: shard {data['label']} did not finish ({len(data['entries'])} of "
                             f"{data.get('expected', '?')} notebook(s) graded; was it stopped, or out of time?). "
                             f"Grade shard {data['label']} again, with --overwrite")
    # the same course, options and submissions
    for path, data in shards[1:]:
        a, b = first["course"], data["course"]
        for key in ("labsupport", "lab_checks_sha256", "code_sha256"):
            if a.get(key) != b.get(key):
                commits = f" (commits {a.get('commit') or '?'} and {b.get('commit') or '?'})"
                raise _differ(f"course versions: {key}", (first_path, a.get(key)), (path, b.get(key)),
                              f"the course differed{commits}; grade every shard with one checkout or image")
        for key in SCORING_OPTIONS:
            if first["options"].get(key) != data["options"].get(key):
                raise _differ(f"options: {key}", (first_path, first["options"].get(key)),
                              (path, data["options"].get(key)),
                              "grade every shard with the same options (only --jobs may differ)")
        a, b = first["submissions"], data["submissions"]
        if (a.get("sha256"), a.get("count")) != (b.get("sha256"), b.get("count")):
            raise ShardError(f"{first_path} and {path} were given different submissions ({a.get('count')} and "
                             f"{b.get('count')} notebooks, from {a.get('paths')} and {b.get('paths')}"
                             f"{_list_difference(a, b)}): the submissions changed between shards, or the shards "
                             f"were given other paths or the same in another order. Grade every shard again "
                             f"with the same paths")
    # every shard exactly once
    by_index: dict[int, list[Path]] = {}
    for path, data in shards:
        by_index.setdefault(data["label"].index, []).append(path)
    twice = {i: ps for i, ps in by_index.items() if len(ps) > 1}
    if twice:
        i, ps = min(twice.items())
        raise ShardError(f"shard {i}/{count} is given {len(ps)} times: {', '.join(map(str, ps))}; give each "
                         f"shard once")
    missing = [i for i in range(count) if i not in by_index]
    if missing:
        names = ", ".join(f"{i}/{count}" for i in missing)
        raise ShardError(f"shard {names} {'is' if len(missing) == 1 else 'are'} missing (no "
                         f"{Shard(missing[0], count).filename}"
                         f"{' and the others' if len(missing) > 1 else ''} among the files given); grade "
                         f"{'it' if len(missing) == 1 else 'them'} with `python -m labsupport grade ... --shard "
                         f"{missing[0]}/{count}`, then merge again")
    # every notebook exactly once, in the single-machine order
    total = int(first["submissions"]["count"])
    placed: dict[int, tuple[Path, list[Row]]] = {}
    for path, data in shards:
        for position, _, rows in data["entries"]:
            if position in placed or not 0 <= position < total:
                raise ShardError(f"{path}: notebook {position} appears twice or is out of range; the shard file "
                                 f"was edited or damaged. Grade its shard again")
            placed[position] = (path, rows)
    if len(placed) != total:
        lost = next(i for i in range(total) if i not in placed)
        raise ShardError(f"the shards graded {len(placed)} of the {total} submissions (notebook {lost} is in none "
                         f"of them); the shard files were edited or damaged. Grade the shards again")
    rows = [row for position in sorted(placed) for row in placed[position][1]]
    return rows, [data for _, data in shards]
