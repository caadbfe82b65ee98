"""Reading edgespec's own cache files (probe figures, calibrations) without trusting them.

A cache path may hold anything another program, a user or an attacker put there: a FIFO (an
open() for reading would wait forever for a writer), /dev/zero or a symlink to it (read() never
ends, then MemoryError), a directory, a huge file. Only a regular file of a bounded size is read;
every other case reads as "no cache", and the caller measures again.
"""
from __future__ import annotations

import os
import stat
from typing import BinaryIO

MAX_BYTES = 1 << 20  # a calibration or probe record is a few KiB


def open_regular(path: str | os.PathLike, max_bytes: int | None = None) -> BinaryIO | None:
    """`path` opened for reading in binary, or None when it is missing, unreadable, not a regular
    file or (with `max_bytes`) larger than that."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)  # O_NONBLOCK: a FIFO opens at once instead of waiting for a writer
    except OSError:
        return None
    try:
        st = os.fstat(fd)  # what was opened, after any symlink: not what the name said
        if stat.S_ISREG(st.st_mode) and (max_bytes is None or st.st_size <= max_bytes):
            return os.fdopen(fd, "rb")
    except OSError:
        pass
    os.close(fd)
    return None


def read_text(path: str | os.PathLike, max_bytes: int = MAX_BYTES) -> str | None:
    """The file's UTF-8 text, or None when it is missing, not a regular file, larger than
    `max_bytes`, unreadable or not UTF-8."""
    fh = open_regular(path, max_bytes)
    if fh is None:
        return None
    try:
        with fh:
            data = fh.read(max_bytes + 1)
        if len(data) > max_bytes:  # grew past the limit while being read
            return None
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
