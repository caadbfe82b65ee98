"""Reading edgespec's own cache files (probe figures, calibrations) without trusting them.

A cache path may hold anything another program, a user or an attacker put there: a FIFO (an
open() for reading would wait forever for a writer), /dev/zero or a symlink to it (read() never
ends, then MemoryError), a directory, a huge file. Only a regular file of a bounded size is read;
every other case reads as "no cache", and the caller measures again.
"""
from __future__ import annotations

import os
import stat

MAX_BYTES = 1 << 20  # a calibration or probe record is a few KiB


def read_text(path: str | os.PathLike, max_bytes: int = MAX_BYTES) -> str | None:
    """The file's UTF-8 text, or None when it is missing, not a regular file, larger than
    `max_bytes`, unreadable or not UTF-8."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)  # O_NONBLOCK: a FIFO opens at once instead of waiting for a writer
    except OSError:
        return None
    try:
        st = os.fstat(fd)  # what was opened, after any symlink: not what the name said
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return None
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:  # grew past the limit while being read
            return None
        return b"".join(chunks).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
