"""Issue 50, item 7: a prompt-cache save cut off by SIGKILL leaves a .part file in --cache-dir; the
next start removes it, but never the .part of a save another process (a second server sharing the
folder) is still writing. Real processes, killed for real, around the real DiskCache."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from edgespec.promptcache import DiskCache, Slot

# a save in a process of its own, stopped where its .part is written whole but not yet renamed:
# "kill" dies there by SIGKILL, "hold" stays there (a save in progress) until it is killed
SAVER = r"""
import os, signal, sys, time
from edgespec.promptcache import DiskCache, Slot

def cut(*args, **kwargs):
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    print("writing", flush=True)
    time.sleep(600)

os.replace = cut
DiskCache(sys.argv[1], "setup").put(Slot(tuple(range(40)), b"x" * 2**20))
"""


def _saver(folder, how: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SAVER, str(folder), how], stdout=subprocess.PIPE, text=True)


def _parts(folder) -> set:
    return {p.name for p in folder.glob("*.part")}


def test_a_start_removes_the_part_a_killed_save_left_and_keeps_one_being_written(tmp_path):
    writing = _saver(tmp_path, "hold")  # another server's save, in progress
    try:
        assert writing.stdout.readline().strip() == "writing"
        theirs = _parts(tmp_path)
        assert len(theirs) == 1
        killed = _saver(tmp_path, "kill")  # its own start leaves the live .part alone
        assert killed.wait(120) == -signal.SIGKILL
        left = _parts(tmp_path) - theirs
        assert len(left) == 1 and not list(tmp_path.glob("*.slot"))
        size = (tmp_path / next(iter(left))).stat().st_size
        assert size > 2**20  # the whole payload, never renamed
        cache = DiskCache(tmp_path, "setup")
        assert cache.removed_parts == size
        assert _parts(tmp_path) == theirs  # the killed save's went, the live one stays
    finally:
        writing.kill()
        writing.wait()
    assert DiskCache(tmp_path, "setup").removed_parts > 2**20  # once its writer is gone, it goes too
    assert _parts(tmp_path) == set()


def test_a_part_is_locked_from_its_creation_and_a_save_still_lands(tmp_path):
    from edgespec.promptcache import _new_part, clean_parts
    fd, tmp = _new_part(tmp_path)
    try:
        assert clean_parts(tmp_path) == 0 and os.path.exists(tmp)  # in this process too: the lock is the file's
    finally:
        os.close(fd)
    assert clean_parts(tmp_path) == 0 and not os.path.exists(tmp)  # empty, and nobody's: removed
    cache = DiskCache(tmp_path, "setup")
    cache.put(Slot(tuple(range(40)), b"y" * 1000))
    assert len(list(tmp_path.glob("*.slot"))) == 1 and _parts(tmp_path) == set()
    assert DiskCache(tmp_path, "setup").load(next(tmp_path.glob("*.slot"))).target == b"y" * 1000
