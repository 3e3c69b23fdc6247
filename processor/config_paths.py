"""Checks across the configured file paths: usable names, no two settings on one file.

Each section checks its own fields; what only shows when paths are compared (the
JSONL output on the state database, a rule file as an output) or when the file
system is asked (a directory where a file is written) is checked here, for
``serve --check`` and for start-up alike.

An *output* is a file serve writes, truncates or rotates: the state database and
its SQLite side files, the JSONL outputs and their rotated copies. An output may
not name the same file as any other configured path. Inputs may share a file with
each other (a PEM holding both certificate and key is common).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from processor.errors import Problem
from processor.private_files import STREAM_DEVICES, output_problems

if TYPE_CHECKING:
    from processor.config import Config

_SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal", ".lock")


@dataclass(frozen=True, slots=True)
class _Named:
    where: str  # config path
    path: str
    output: bool


def check_paths(config: Config) -> list[Problem]:
    """Every problem with the configured paths, each named by its config path."""
    named = _named_paths(config)
    problems: list[Problem] = []
    usable: list[_Named] = []
    for item in named:
        if "\0" in item.path:
            problems.append(Problem(item.where, "contains a NUL byte"))
            continue
        usable.append(item)
        if item.output:
            problems.extend(_check_output(item))
            problems.extend(Problem(item.where, message)
                            for message in output_problems(item.path, created_beside(item.where, item.path, config)))
    problems.extend(_shared_files(usable, config))
    return problems


def _named_paths(config: Config) -> list[_Named]:
    out: list[_Named] = []
    if config.state.backend == "sqlite" and config.state.path:
        out.append(_Named("state.path", config.state.path, output=True))
    jsonl = config.exporters.jsonl
    if jsonl.path:
        out.append(_Named("exporters.jsonl.path", jsonl.path, output=True))
    if jsonl.actions and jsonl.actions_path:
        out.append(_Named("exporters.jsonl.actions_path", jsonl.actions_path, output=True))
    for index, rule_path in enumerate(config.evaluate.rules):
        if rule_path:
            out.append(_Named(f"evaluate.rules[{index}]", rule_path, output=False))
    receivers = config.receivers.otlp
    for name, receiver_tls in (("grpc", receivers.grpc.tls), ("http", receivers.http.tls)):
        for field_name in ("cert_file", "key_file", "client_ca_file"):
            value = getattr(receiver_tls, field_name)
            if value:
                out.append(_Named(f"receivers.otlp.{name}.tls.{field_name}", value, output=False))
    if config.forward.ca_file:
        out.append(_Named("forward.ca_file", config.forward.ca_file, output=False))
    return out


def _check_output(item: _Named) -> list[Problem]:
    """An output must be a regular file (or not exist yet, in a directory that can hold it)."""
    try:
        info = os.stat(item.path)
    except (FileNotFoundError, NotADirectoryError):
        return _check_parent(item)
    except OSError as exc:
        return [Problem(item.where, f"cannot use {item.path}: {exc.strerror or exc}")]
    if stat.S_ISDIR(info.st_mode):
        return [Problem(item.where, f"{item.path} is a directory; name a file in it")]
    if stat.S_ISREG(info.st_mode):
        return []
    if item.where.startswith("exporters.jsonl") and (item.path in STREAM_DEVICES or stat.S_ISFIFO(info.st_mode)):
        return []  # a stream: never rotated or truncated (see exporters.jsonl)
    return [Problem(item.where, f"{item.path} is a device or special file, not a regular file")]


def _check_parent(item: _Named) -> list[Problem]:
    # The nearest existing ancestor must be a directory: serve creates the ones missing below it.
    parent = os.path.dirname(os.path.abspath(item.path))
    while True:
        try:
            info = os.stat(parent)
        except (FileNotFoundError, NotADirectoryError):
            up = os.path.dirname(parent)
            if up == parent:
                return []
            parent = up
            continue
        except OSError as exc:
            return [Problem(item.where, f"cannot use {parent}: {exc.strerror or exc}")]
        if not stat.S_ISDIR(info.st_mode):
            return [Problem(item.where, f"{parent} is not a directory")]
        return []


def created_beside(where: str, path: str, config: Config) -> list[str]:
    """The files serve creates beside the output ``path`` of the setting ``where``."""
    if where == "state.path":
        return [path + suffix for suffix in _SQLITE_SIDE_FILES]
    if where.startswith("exporters.jsonl"):
        return [f"{path}.{i}" for i in range(1, config.exporters.jsonl.rotate_keep + 1)]
    return []


def output_files(config: Config) -> list[str]:
    """Every file serve writes (outputs and the files beside them) and the directories that hold them."""
    out: list[str] = []
    for item in _named_paths(config):
        if item.output and "\0" not in item.path:
            out += [os.path.dirname(os.path.abspath(item.path)), item.path,
                    *created_beside(item.where, item.path, config)]
    return out


def _identities(item: _Named, config: Config) -> list[tuple[str, str]]:
    """(identity, file) for every file the setting names or, for an output, creates."""
    files = [item.path, *(created_beside(item.where, item.path, config) if item.output else ())]
    out = []
    for name in files:
        real = os.path.realpath(name)
        try:
            info = os.stat(real)
        except OSError:
            out.append((real, name))
            continue
        # Hard links share an inode but not a name.
        out.append((f"inode {info.st_dev}:{info.st_ino}", name))
    return out


def _shared_files(items: list[_Named], config: Config) -> list[Problem]:
    problems: list[Problem] = []
    owners: dict[str, _Named] = {}
    for item in items:
        mine = _identities(item, config)
        for identity, name in mine:
            other = owners.get(identity)
            if other is not None and other is not item and (item.output or other.output):
                problems.append(Problem(item.where, f"{name} is the same file as {other.where} ({other.path}); "
                                        "each output needs its own file"))
                break
        for identity, _ in mine:
            owners.setdefault(identity, item)
    return problems
