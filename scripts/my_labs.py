"""Give a learner a working copy of the labs that no course command touches: ``make lab``.

    python scripts/my_labs.py [labs] [my-labs] [--open JUPYTER]

Copies each ``labs/*.ipynb`` into ``my-labs/`` (git-ignored) the first time only. A notebook
already in ``my-labs/`` is never overwritten, so your work survives ``git pull`` and ``make
release``; when the course has changed a lab since you copied it, this says so and points at
the new version in ``labs/`` (copy what you need from there by hand, or rename your copy and run
``make lab`` again for a fresh one).

``--open JUPYTER`` then starts JupyterLab there (``make lab`` does) with the course's settings,
``scripts/jupyterlab/overrides.json`` (no news pop-up covering the first outputs; your own
settings still apply on top), and with ``--allow-root`` when run as root (containers, Colab-like
hosts), where Jupyter otherwise refuses to start.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

SETTINGS = Path(__file__).resolve().parent / "jupyterlab"  # the course's JupyterLab defaults (overrides.json)


def _digest(path: Path) -> str | None:
    """The release digest a notebook was written with (None if it has none or is unreadable)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))["metadata"]["labsupport"]["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def sync(labs: Path, mine: Path, log=print) -> tuple[list[Path], list[Path]]:
    """Copy the labs that ``mine`` lacks; returns (copied, kept). Never replaces a file in ``mine``."""
    if not labs.is_dir():
        raise SystemExit(f"my_labs: {labs} is not a folder: run this from the course repository")
    mine.mkdir(exist_ok=True)
    copied, kept = [], []
    for source in sorted(labs.glob("*.ipynb")):
        target = mine / source.name
        if target.exists():
            kept.append(target)
            new, yours = _digest(source), _digest(target)
            if new and yours and new != yours:  # the copy keeps the digest of the release it came from
                log(f"{source} has changed since you copied it; your {target} is kept as it is "
                    f"(the new version is in {source})")
            continue
        shutil.copy2(source, target)
        copied.append(target)
    if copied:
        log(f"copied into {mine}/: " + ", ".join(p.name for p in copied))
    log(f"your working copies are in {mine}/ (git ignores it; no course command writes there)")
    return copied, kept


def lab_command(jupyter: str, folder: Path, *extra: str) -> list[str]:
    """The command that opens JupyterLab on ``folder`` with the course's settings."""
    command = [jupyter, "lab", f"--LabApp.app_settings_dir={SETTINGS}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")  # as root Jupyter refuses to start without it
    return [*command, *extra, str(folder)]


def main(argv: list[str]) -> int:
    jupyter = None
    if "--open" in argv:
        at = argv.index("--open")
        if at + 1 >= len(argv):
            raise SystemExit("my_labs: --open needs the jupyter command to run (such as .venv/bin/jupyter)")
        jupyter = argv[at + 1]
        argv = argv[:at] + argv[at + 2:]
    labs = Path(argv[0]) if argv else Path("labs")
    mine = Path(argv[1]) if len(argv) > 1 else Path("my-labs")
    sync(labs, mine)
    if jupyter:
        command = lab_command(jupyter, mine)
        os.execvp(command[0], command)  # JupyterLab takes over this process (and its Ctrl+C)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
