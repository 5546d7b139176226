"""Give a learner a working copy of the labs that no course command touches: ``make lab``.

    python scripts/my_labs.py [labs] [my-labs]

Copies each ``labs/*.ipynb`` into ``my-labs/`` (git-ignored) the first time only. A notebook
already in ``my-labs/`` is never overwritten, so your work survives ``git pull`` and ``make
release``; when the course has changed a lab since you copied it, this says so and points at
the new version in ``labs/`` (copy what you need from there by hand, or rename your copy and run
``make lab`` again for a fresh one).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


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


def main(argv: list[str]) -> int:
    labs = Path(argv[0]) if argv else Path("labs")
    mine = Path(argv[1]) if len(argv) > 1 else Path("my-labs")
    sync(labs, mine)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
