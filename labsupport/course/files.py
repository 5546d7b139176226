"""Files the grader is given and writes: each submission or shard file named once, and a file
written atomically (a reader sees the old file or the new one, never half of one)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


def each_once(paths: Iterable[Path]) -> list[Path]:
    """``paths`` in order, without a second path to a file already listed (compared resolved)."""
    unique, seen = [], set()
    for path in paths:
        key = path.resolve() if path.exists() else path
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


def write_atomically(path: Path, write: Callable, **open_options) -> None:
    """Write ``path`` through ``write(f)`` (``f`` a text file opened with ``open_options``) into a
    temporary file beside it, synced to disk and then renamed over ``path``; nothing is left behind
    when ``write`` fails."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with open(fd, "w", **open_options) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
