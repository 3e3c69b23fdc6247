"""The files serve writes are its own: private, never reached through a link or a shared directory.

Span payloads (prompt text in a request waiting in the journal, violation messages) land in
the state database, its write-ahead log and the JSONL outputs, so serve makes them private
whatever the umask: directories it creates are 0700, files 0600 (the umask is tightened at
start, and each file is also created with that mode). A file or directory that already
exists keeps its mode; a looser one is reported at start, once per path.

Another local user must not be able to choose what serve writes to. An output is refused
(by ``serve --check`` and at start) when it is a symbolic link, or when a directory above
it belongs to another user (neither us nor root) or can be written by others without the
sticky bit (anyone could put a link there). Files are opened with ``O_NOFOLLOW`` as well,
so a link planted after the check is refused rather than followed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final

log = logging.getLogger("durable_check.serve")

PRIVATE_FILE: Final = 0o600
PRIVATE_DIR: Final = 0o700
# Bits no one but the owner should have on serve's files.
_OTHERS: Final = 0o077
# Devices that stand for a stream (the JSONL output may name them): they are links on Linux.
STREAM_DEVICES: Final = ("/dev/stdout", "/dev/stderr")


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Whatever serve (or SQLite on its behalf) creates meanwhile is private; the umask is restored after."""
    old = os.umask(0o077)
    os.umask(old | _OTHERS)
    try:
        yield
    finally:
        os.umask(old)


def make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents, each 0700; an existing one is left as it is."""
    missing: list[Path] = []
    current = directory
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, PRIVATE_DIR)
        except FileExistsError:
            continue
        os.chmod(path, PRIVATE_DIR)  # the umask may have taken bits away, never added: make it exact


def open_private(path: str | Path, flags: int) -> int:
    """``os.open`` for serve's own files: created 0600, never through a link (``OSError`` ELOOP then)."""
    nofollow = 0 if str(path) in STREAM_DEVICES else os.O_NOFOLLOW
    return os.open(path, flags | nofollow | os.O_CLOEXEC, PRIVATE_FILE)


def output_problems(path: str, side_files: Iterable[str] = ()) -> list[str]:
    """Why serve must not write ``path`` (and the files it creates beside it), as messages; [] when it may."""
    if path in STREAM_DEVICES:
        return []
    problems: list[str] = []
    for name in (path, *side_files):
        try:
            info = os.lstat(name)
        except OSError:
            continue
        if stat.S_ISLNK(info.st_mode):
            problems.append(f"{name} is a symbolic link; serve never writes through a link: name the file itself")
    directory = _nearest_existing(os.path.dirname(os.path.abspath(path)))
    if directory is not None:
        problem = _directory_problem(directory)
        if problem is not None:
            problems.append(problem)
    return problems


def _nearest_existing(directory: str) -> str | None:
    while True:
        if os.path.isdir(directory):
            return os.path.realpath(directory)
        up = os.path.dirname(directory)
        if up == directory:
            return None
        directory = up


def _directory_problem(directory: str) -> str | None:
    """The first directory from ``directory`` up to ``/`` that another user could use to redirect a write."""
    me = os.geteuid()
    current = directory
    while True:
        try:
            info = os.stat(current)
        except OSError:
            return None  # not ours to judge: the write itself will say what is wrong
        if info.st_uid not in (me, 0):
            return (f"{current} belongs to another user (uid {info.st_uid}), who could replace what serve writes "
                    "there; use a directory of this user's own")
        if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
            return (f"{current} is writable by others without the sticky bit: anyone could put a link there; "
                    "use a directory of this user's own (or set the sticky bit)")
        up = os.path.dirname(current)
        if up == current:
            return None
        current = up


def report_loose(paths: Iterable[str]) -> None:
    """One warning per existing file or directory of serve's that other users can read or write: by its
    "other" bits, or by its group bits when the group is not serve's own."""
    seen: set[str] = set()
    for name in paths:
        if name in seen or name in STREAM_DEVICES:
            continue
        seen.add(name)
        try:
            info = os.lstat(name)
        except OSError:
            continue
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
            continue
        mode = stat.S_IMODE(info.st_mode)
        # Group bits for serve's own group (the image's, a Kubernetes fsGroup) give no one else access.
        if mode & 0o007 or (mode & 0o070 and info.st_gid != os.getegid()):
            wanted = PRIVATE_DIR if stat.S_ISDIR(info.st_mode) else PRIVATE_FILE
            log.warning("%s is open to other users (mode %04o); serve creates its own %s %04o: "
                        "chmod %04o it unless that is meant", name, mode,
                        "directories" if stat.S_ISDIR(info.st_mode) else "files", wanted, wanted)
