"""Writes at an offset, whole: ``os.pwrite`` may write less than it was given."""

from __future__ import annotations

import os


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd``; OSError when nothing more can be written."""
    written = 0
    while written < len(data):
        count = os.pwrite(fd, data[written:], offset + written)
        if count <= 0:
            raise OSError(0, "nothing was written")
        written += count
