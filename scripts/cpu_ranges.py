"""The normal range of each CPU measurement the labs print, from class-ledger files (instructors).

Run every solution notebook a few times on the machine learners will use, with ``LABSUPPORT_LEDGER``
pointing at one folder (each run of a lab's ledger cell writes a file there), then

    python scripts/cpu_ranges.py FOLDER --note "what the machine was doing" --out book/instructors/cpu_ranges.inc.md

writes a Markdown table per lab: each figure's lowest and highest value over the runs, their count, the
unit and the lab's convention, with the machine (as the files name it) and the dates of the runs. A
figure that varies by a factor of two between runs on one machine is noise to an instructor, not a bug.

``--grading TIMES --grading-out FILE`` also writes the grading time of each lab's solution notebook from
a file of lines ``LAB grade rc=RC SECONDS s load=LOAD`` (what ``time python -m labsupport grade
solutions/LAB.ipynb`` took, one notebook at a time, and the machine's load average when it ended).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from labsupport import ledger  # noqa: E402 - after the path, so the script runs from a checkout


def ranges_markdown(runs: list[ledger.Run], note: str) -> str:
    by_lab: dict[str, list[ledger.Run]] = collections.defaultdict(list)
    for run in runs:  # CPU runs, in Triton's interpreter too (their torch timings are real; see below)
        if run.kind in ("cpu", "cpu-interpreter"):
            by_lab[run.lab].append(run)
    if not by_lab:
        return "No CPU runs were found in the ledger folder.\n"
    devices = sorted({r.device for rs in by_lab.values() for r in rs})
    dates = sorted(r.utc[:10] for rs in by_lab.values() for r in rs)
    out = [f"Measured on {', '.join(devices)}, {dates[0]} to {dates[-1]} (UTC). {note}", ""]
    for lab in sorted(by_lab):
        values: dict[str, list[float]] = collections.defaultdict(list)
        meta: dict[str, ledger.Figure] = {}
        for run in by_lab[lab]:
            for fig in run.figures:
                if fig.timing and not run.timings_real:
                    continue  # a Triton kernel timed in the interpreter: it measures Python
                values[fig.name].append(fig.value)
                meta[fig.name] = fig
        out += [f"**{lab}** ({len(by_lab[lab])} run{'s' if len(by_lab[lab]) > 1 else ''})", "",
                "| figure | lowest | highest | unit | convention |", "| --- | --- | --- | --- | --- |"]
        for name in sorted(values):
            v = values[name]
            out.append(f"| `{name}` | {min(v):.4g} | {max(v):.4g} | {meta[name].unit} | "
                       f"{meta[name].convention.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


def grading_markdown(lines: list[str]) -> str:
    """A table of grading minutes per lab from ``LAB grade rc=RC SECONDS s load=LOAD`` lines."""
    rows = ["| lab | grading one solution notebook | exit status | load average at the end |", "| --- | --- | --- | --- |"]
    for line in lines:
        parts = line.split()
        if len(parts) >= 5 and parts[1] == "grade":
            rows.append(f"| {parts[0]} | {float(parts[3]) / 60:.1f} min | {parts[2].removeprefix('rc=')} | "
                        f"{parts[5].removeprefix('load=') if len(parts) > 5 else '?'} |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="a folder of class-ledger files (searched recursively)")
    p.add_argument("--note", default="", help="what the machine was doing during the runs (say if it was loaded)")
    p.add_argument("--out", default=None, help="write the Markdown here (default: print it)")
    p.add_argument("--grading", default=None, help="a file of 'LAB grade rc=RC SECONDS s load=LOAD' lines")
    p.add_argument("--grading-out", default=None, help="where the grading table goes (default: print it)")
    args = p.parse_args(argv)
    if args.grading:
        table = grading_markdown(Path(args.grading).read_text().splitlines())
        if args.grading_out:
            Path(args.grading_out).write_text(table)
        else:
            print(table)
    runs, problems = ledger.collect(args.folder)
    for problem in problems:
        print("skipped:", problem, file=sys.stderr)
    text = ranges_markdown(runs, args.note)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
