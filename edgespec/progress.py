"""Progress reports for long work (downloads, calibration) and the library's logger.

The library never writes to a terminal: notices go to the `edgespec` logger, long work calls
an optional `progress` callback with a `Progress` value. The CLI turns both into output.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger("edgespec")
log.addHandler(logging.NullHandler())


@dataclass(frozen=True)
class Progress:
    task: str                  # "download", "verify" (checksum) or "calibrate"
    done: float                # units finished so far
    total: Optional[float]     # units in all, None when unknown
    unit: str = "bytes"        # "bytes" or "steps"
    detail: str = ""           # what is being worked on: a file name, a pass size

    @property
    def fraction(self) -> Optional[float]:
        return self.done / self.total if self.total else None


ProgressCallback = Callable[[Progress], None]


def report(callback: Optional[ProgressCallback], task: str, done: float, total: Optional[float],
           unit: str = "bytes", detail: str = "") -> None:
    """Call `callback` if there is one (a None callback costs nothing)."""
    if callback is not None:
        callback(Progress(task, done, total, unit, detail))
