"""Course commands: ``python -m labsupport release``, ``grade``, ``grade-merge``, ``ledger`` and ``stack``."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from .report import GradesFile, escape_surrogates, format_table, summary_line
from .shard import ShardError, ShardFile, deal, merge, parse_shard, shard_header


def _root() -> Path:
    """The course repository: the current folder or one above it that has solutions/ and labs/."""
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "solutions").is_dir() and (folder / "_toc.yml").exists():
            return folder
    raise SystemExit("release: run this inside the course repository (no solutions/ and _toc.yml found)")


def _missing_tools() -> list[str]:
    """The notebook packages release and grade need (the 'grade' extra), if any are missing."""
    return [name for name in ("nbformat", "nbclient", "ipykernel") if importlib.util.find_spec(name) is None]


def _joined_shard(argv: list[str]) -> list[str]:
    """``--shard -1/2`` as ``--shard=-1/2``: argparse reads a value that starts with a dash as an
    option and says only "expected one argument"; joined, the value reaches :func:`parse_shard`,
    whose message says what a shard should look like."""
    out = list(argv)
    for i, word in enumerate(out[:-1]):
        if word == "--shard" and out[i + 1].startswith("-"):
            out[i : i + 2] = [f"--shard={out[i + 1]}"]
            break
    return out


def _add_release(sub) -> None:
    rel = sub.add_parser("release", help="write labs/*.ipynb (learners) and solutions/*.ipynb from solutions/*.py")
    rel.add_argument("labs", nargs="*", help="lab names such as 00_first_kernel (default: all)")
    rel.add_argument("--check", action="store_true", help="write nothing; exit 1 if any notebook is out of date")
    rel.add_argument("--force", action="store_true", help="replace edited notebooks (a .bak copy is kept)")
    rel.add_argument("--record", action="store_true",
                     help="first run the solution notebooks and store the outputs nbval compares "
                          "(solutions/outputs/), then release")


def _add_grade(sub) -> None:
    gr = sub.add_parser("grade", help="run notebooks headlessly and score their checks")
    gr.add_argument("paths", nargs="+", help="notebooks, or folders of notebooks")
    gr.add_argument("--csv", default=None, help="where to write the scores (default: grades.csv)")
    gr.add_argument("--overwrite", action="store_true",
                    help="replace an existing --csv file or shard file (the old one is kept as FILE.bak)")
    gr.add_argument("--shard", metavar="K/N",
                    help="grade only shard K of N (counted from 0) of the submissions, for a class graded on "
                         "several machines, and write a shard file into --shard-dir instead of the CSV; "
                         "`auto` reads K and N of a Slurm job array (SLURM_ARRAY_TASK_ID, "
                         "SLURM_ARRAY_TASK_COUNT), `auto/N` K of a Kubernetes indexed Job (JOB_COMPLETION_INDEX). "
                         "Then `python -m labsupport grade-merge` writes the CSV")
    gr.add_argument("--shard-dir", default="grade-shards",
                    help="with --shard: the folder the shard file (shard-K-of-N.json) goes to, created if "
                         "missing (default: grade-shards)")
    gr.add_argument("--lab", help="grade every notebook as this lab (such as 07_attention), whatever its "
                                  "file name and metadata say")
    gr.add_argument("--timeout", type=int, default=600,
                    help="seconds a single cell may run before it is interrupted (default: 600)")
    gr.add_argument("--notebook-timeout", type=int, default=None,
                    help="seconds a whole notebook may run before it is stopped (default: 3600)")
    gr.add_argument("--jobs", "-j", type=int, default=1,
                    help="notebooks graded at once, each in its own kernel (default: 1; give the number of "
                         "cores: twenty notebooks take about half as long with -j 2 on two cores)")
    gr.add_argument("--no-sandbox", action="store_true",
                    help="run kernels with your own permissions, not in a bubblewrap sandbox (every row then "
                         "says UNSANDBOXED)")
    gr.add_argument("--container", metavar="IMAGE",
                    help="run each kernel in this container image (docker or podman; the image needs python "
                         "with ipykernel and the course package)")
    gr.add_argument("--require-sandbox", action="store_true",
                    help="stop (exit 2) when bubblewrap cannot work here, instead of grading UNSANDBOXED with a "
                         "warning nobody reads (for batch jobs; an explicit --no-sandbox still grades unsandboxed)")
    gr.add_argument("--memory", type=float, default=8,
                    help="GiB of address space a sandboxed kernel may map (default: 8)")
    gr.add_argument("--as-is", action="store_true",
                    help="run each submitted notebook whole, its own setup and check cells included, instead of "
                         "the course's notebook with only the learner's exercise cells put in (for notebooks "
                         "not made from the course's labs; less trustworthy)")
    gr.add_argument("--all-cells", action="store_true",
                    help="run every cell of the course's notebook, measurements and plots included (by default "
                         "only the cells the checks need run, which is much faster)")


def _add_grade_merge(sub) -> None:
    mg = sub.add_parser("grade-merge", help="merge the shard files of `grade --shard K/N` into the table and CSV "
                                            "one machine grading everything writes")
    mg.add_argument("shards", nargs="+", help="the shard files, or the --shard-dir folders holding them")
    mg.add_argument("--csv", default="grades.csv", help="where to write the scores (default: grades.csv)")
    mg.add_argument("--overwrite", action="store_true",
                    help="replace an existing --csv file (the old one is kept as FILE.bak)")


def _add_ledger(sub) -> None:
    led = sub.add_parser("ledger", help="tabulate and plot a folder of lab results files, one column per GPU")
    led.add_argument("folder", help="a folder of results files (searched recursively), or one file; labs save "
                                    "them to ~/.labsupport/results (or $LABSUPPORT_LEDGER)")
    led.add_argument("--out", metavar="DIR", help="also write ledger.csv, ledger.md and one plot per lab "
                                                  "(ledger_<lab>.png) into DIR; files of those names are replaced")
    led.add_argument("--no-plots", action="store_true", help="with --out, write the CSV and markdown only")


def _add_stack(sub) -> None:
    st = sub.add_parser("stack", help="assemble your serving stack from your lab notebooks: a table of slots, "
                                      "whose part each holds and its check (labsupport.course.stack)")
    st.add_argument("labs_dir", help="the folder of your lab notebooks (nothing in it is written)")
    st.add_argument("--json", action="store_true", help="print a list of objects (slot, lab, source, serves, check)")
    st.add_argument("--cache", metavar="DIR", default=None,
                    help="where the parts' module files and the check results go (default $LABSUPPORT_CACHE/stack)")
    st.add_argument("--slot", action="append", default=None, metavar="NAME",
                    help="assemble only this slot (repeatable; default: every slot)")
    st.add_argument("--jobs", type=int, default=None, metavar="N",
                    help="check N labs at once, each in its own process (default: the CPU cores, at most 4)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labsupport")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_release, _add_grade, _add_grade_merge, _add_ledger, _add_stack):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(_joined_shard(sys.argv[1:] if argv is None else list(argv)))
    if args.command == "grade-merge":  # no notebook runner needed: runs without the grade extra
        return _merge(args)
    if args.command == "ledger":  # needs none of the notebook packages
        from .. import ledger

        return ledger.main(args.folder, args.out, plots=not args.no_plots)
    missing = _missing_tools()
    if missing:
        print(f"{args.command}: needs {', '.join(missing)}, which are not installed. Install them with "
              "`pip install 'labsupport[grade]'` (or run `make setup` in the course repository).",
              file=sys.stderr)
        return 2
    if args.command == "release":
        return _release(args)
    if args.command == "stack":
        from . import stack

        return stack.main(args.labs_dir, args.cache, as_json=args.json, only=args.slot, jobs=args.jobs)
    return _grade(args)


def _release_check(root: Path, labs: list[str]) -> int:
    """``release --check``: what is out of date or unrecorded, and what to run; 1 if anything is."""
    from .release import plan, unrecorded  # needs nbformat: only once main() has found it

    stale = [p for p in plan(root, labs) if p.status != "unchanged"]
    for p in stale:
        print(f"out of date: {p.target.relative_to(root)} ({p.status})")
    missing = unrecorded(root, labs)
    for line in missing:
        print(f"no stored output: {line}")
    if missing:
        print("run `make record-outputs` (python -m labsupport release --record) to record them")
    if any(p.status != "learner-edited" for p in stale):
        print("run `python -m labsupport release` to regenerate them")
    if any(p.status == "learner-edited" for p in stale):
        print("learner-edited: changed or run since it was released, so someone's work may be in it; "
              "release will not overwrite it (copy your work elsewhere first, or use --force, "
              "which keeps a .bak copy)")
    if stale or missing:
        return 1
    print("all released notebooks match their sources")
    return 0


def _release(args) -> int:
    from .release import ReleaseError, record_outputs, release, unrecorded  # needs nbformat, as above

    root = _root()
    try:
        if args.check:
            return _release_check(root, args.labs)
        if args.record:
            record_outputs(root, args.labs)
        release(root, force=args.force, names=args.labs)
        for line in unrecorded(root, args.labs):
            print(f"warning: no stored output: {line}; run `make record-outputs`")
    except ReleaseError as exc:
        print(f"release: {exc}", file=sys.stderr)
        return 2
    return 0


def _merge(args) -> int:
    """``grade-merge``: the shards' rows, checked to be one whole run, as ``grade`` writes them."""
    grades = GradesFile(Path(args.csv), overwrite=args.overwrite)
    try:
        grades.check()
        rows, shards = merge(args.shards)
        grades.start()
    except (ShardError, OSError) as exc:
        print(f"grade-merge: {exc}", file=sys.stderr)
        return 2
    print(f"merging {len(shards)} shard(s) of {sum(len(s['entries']) for s in shards)} notebook(s)", file=sys.stderr)
    print(format_table(rows))
    where = grades.finish(rows)
    if grades.fallback is not None:
        print(f"grade-merge: could not write {args.csv} ({grades.error}); the scores are in {where}", file=sys.stderr)
        return 1
    print(f"\nscores written to {args.csv} (one row per notebook and check, with the full details)")
    return 0


class _Stop(Exception):
    """Grading cannot start: the message says why (``grade`` prints it and exits 2)."""


@dataclass
class _Grading:
    """What ``grade`` was asked to do, checked before anything runs."""

    manifest: dict
    shard: object | None  # the shard (labsupport.course.shard), or None for one machine's whole run
    grades: object  # where the rows go as they come: a GradesFile (the CSV) or a ShardFile
    output: Path  # that file
    everyone: list[Path]  # every submission named
    notebooks: list[Path]  # those graded here (this shard's)
    positions: dict[Path, int]  # with --shard: each notebook's place in the single-machine order
    sandbox: object | None
    unsandboxed: str  # why there is no sandbox (when there is none)


def _check_grade_options(args):
    """The shard asked for (or None), with every option that needs no file checked."""
    from .grade import NOTEBOOK_TIMEOUT  # needs nbformat: only once main() has found it

    shard = None
    if args.shard is not None:
        try:
            shard = parse_shard(args.shard)
        except ShardError as exc:
            raise _Stop(str(exc)) from exc
        if args.csv is not None:
            raise _Stop("--shard writes a shard file into --shard-dir, not a CSV; drop --csv here and give it to "
                        "`python -m labsupport grade-merge`, which writes the CSV of all the shards")
    if args.notebook_timeout is None:
        args.notebook_timeout = NOTEBOOK_TIMEOUT
    if args.timeout < 1 or args.jobs < 1 or args.notebook_timeout < 1:
        raise _Stop("--timeout, --notebook-timeout and --jobs must be 1 or more")
    return shard


def _plan_grading(args) -> _Grading:
    """Check everything ``grade`` was given, in the order a user would fix it, before any notebook runs."""
    from .grade import bad_paths, expand
    from .manifest import ManifestError, load_manifest, manifest_drift
    from .sandbox import choose

    shard = _check_grade_options(args)
    csv_path = Path(args.csv or "grades.csv")
    try:
        manifest = load_manifest()
    except ManifestError as exc:
        raise _Stop(str(exc)) from exc
    if args.lab is not None and args.lab not in manifest:
        raise _Stop(f"--lab {args.lab}: no such lab; the labs are {', '.join(manifest)}")
    typos = bad_paths(args.paths)
    if typos:
        raise _Stop(f"{', '.join(typos)}: no such file or folder. Give notebooks (.ipynb) or folders of "
                    f"them; nothing was graded and {csv_path} was not written.")
    if shard is not None:
        grades = ShardFile(Path(args.shard_dir), shard, overwrite=args.overwrite)
    else:
        grades = GradesFile(csv_path, overwrite=args.overwrite)
    try:
        grades.check()  # before grading, not after an hour of it
    except OSError as exc:
        raise _Stop(str(exc)) from exc
    everyone = expand(args.paths)
    if not everyone:
        raise _Stop("no notebooks found in " + ", ".join(args.paths))
    positions, notebooks = {}, everyone
    if shard is not None:  # this machine's share, each with its place in the single-machine order
        mine = deal(everyone, shard)
        positions = {path: i for i, path in mine}
        notebooks = [path for _, path in mine]
    try:
        sandbox, unsandboxed = choose(args.no_sandbox, args.container, int(args.memory * 2**30))
    except RuntimeError as exc:
        raise _Stop(str(exc)) from exc
    if sandbox is None and args.require_sandbox and not args.no_sandbox:
        raise _Stop(f"--require-sandbox: no sandbox here ({unsandboxed}); nothing was graded. Grade where "
                    f"bubblewrap works, or use --container IMAGE")
    if sandbox is not None and sandbox.note:
        print(f"grade: note: {sandbox.note}", file=sys.stderr)
    if sandbox is None:
        print(f"grade: WARNING: grading UNSANDBOXED ({unsandboxed}): the submitted code runs with your "
              f"permissions; every row says so", file=sys.stderr)
    drift = manifest_drift(manifest)
    if drift:
        print(f"grade: warning: {drift}", file=sys.stderr)
    output = grades.path if shard is not None else csv_path
    return _Grading(manifest, shard, grades, output, everyone, notebooks, positions, sandbox, unsandboxed)


def _start_file(args, g: _Grading, where: str) -> None:
    """Write the output file's start: the shard file's header (what was asked), or the empty CSV."""
    if g.shard is None:
        g.grades.start()
        return
    options = {"lab": args.lab, "timeout": args.timeout, "notebook_timeout": args.notebook_timeout,
               "memory": args.memory, "as_is": args.as_is, "all_cells": args.all_cells, "sandbox": where}
    g.grades.start(shard_header(g.shard, g.everyone, args.paths, options, args.jobs))


def _grade(args) -> int:
    # the grader needs nbformat and nbclient: imported only once main() has found them installed
    from .grade import grade_all
    from .notebooks import KernelStartError

    try:
        g = _plan_grading(args)
    except _Stop as stop:
        print(f"grade: {stop}", file=sys.stderr)
        return 2
    shard, grades, output = g.shard, g.grades, g.output
    where = g.sandbox.label if g.sandbox is not None else "UNSANDBOXED"
    share = f" (shard {shard}: {len(g.notebooks)} of {len(g.everyone)})" if shard is not None else ""
    print(f"grading {len(g.notebooks)} notebook(s){share}, {args.jobs} at a time ({where}); each cell may run "
          f"{args.timeout} s, each notebook {args.notebook_timeout} s", file=sys.stderr, flush=True)

    def progress(path, rows, seconds):
        # the CSV (or shard file) is rewritten after each notebook: a crash keeps what was graded
        if shard is not None:
            grades.add(g.positions[path], path, rows)
        else:
            grades.add(rows)
        print(escape_surrogates(f"  {path}: {summary_line(rows)} [{seconds:.0f} s]"), file=sys.stderr, flush=True)

    try:
        _start_file(args, g, where)
    except OSError as exc:
        print(f"grade: {exc}", file=sys.stderr)
        return 2
    try:
        rows = grade_all(g.notebooks, timeout=args.timeout, jobs=args.jobs, progress=progress, lab=args.lab,
                         manifest=g.manifest, notebook_timeout=args.notebook_timeout, sandbox=g.sandbox,
                         unsandboxed=g.unsandboxed, as_is=args.as_is, all_cells=args.all_cells,
                         names_among=g.everyone)
    except KernelStartError as exc:
        done = len(grades.graded) if shard is not None else len(grades.rows)
        kept = (f"what was graded before ({done}) is in {grades.fallback or output}" if done
                else f"{output} holds no scores")
        if shard is not None:
            kept += f"; it is marked unfinished, so grade-merge refuses it until shard {shard} is graded again"
        print(f"grade: {exc}\nGrading stopped (every notebook needs a kernel); {kept}.", file=sys.stderr)
        return 2
    return _finish(rows, g)


def _finish(rows, g: _Grading) -> int:
    """The table, the file's last write, and where the scores are (1 if they had to go elsewhere)."""
    shard, grades, output = g.shard, g.grades, g.output
    print(format_table(rows) if rows or shard is None else f"shard {shard}: no notebooks in this shard")
    where = grades.finish() if shard is not None else grades.finish(rows)
    if grades.fallback is not None:  # the folder went away or filled up while grading: scores kept anyway
        print(f"grade: could not write {output} ({grades.error}); the scores are in {where}", file=sys.stderr)
        return 1
    if shard is not None:
        print(f"\nshard {shard} ({len(g.notebooks)} notebook(s)) written to {output}; when every shard is done, "
              f"`python -m labsupport grade-merge {output.parent}` writes the table and the CSV of all of them")
        return 0
    print(f"\nscores written to {output} (one row per notebook and check, with the full details)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
