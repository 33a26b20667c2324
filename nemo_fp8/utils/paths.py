"""What a path given as a file is when it is not a regular file, for errors that name it.

``Path.is_file()`` is False for a directory, a FIFO, a socket or a device alike, and the callers used to report all
of them as "not found". ``special_file_kind`` tells them apart with ``os.stat`` only: it never opens the path (a
FIFO opened for reading blocks until a writer comes).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def special_file_kind(path: str | Path) -> str | None:
    """``"a directory"``, ``"a FIFO (named pipe)"``, ``"a socket"``, ``"a character device"`` or ``"a block
    device"`` when ``path`` (a symbolic link: its target) exists and is one of those; None when it is a regular
    file, or when it does not exist or cannot be examined (the callers' "not found" covers those)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # missing, a dangling link, no permission on a parent, a NUL in the name
        return None
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def files_in(folder: Path, suffixes: tuple[str, ...], at_most: int = 5) -> str:
    """``" (it holds a.jsonl, b.jsonl)"``: the names of up to ``at_most`` regular files directly in ``folder`` whose
    suffix is one of ``suffixes`` (sorted, ``+N more`` after them), for an error that says a folder was given
    where a file is needed; ``""`` when there are none or the folder cannot be listed."""
    try:
        names = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in suffixes and p.is_file())
    except OSError:
        return ""
    if not names:
        return ""
    more = f", +{len(names) - at_most} more" if len(names) > at_most else ""
    return f" (it holds {', '.join(names[:at_most])}{more})"
