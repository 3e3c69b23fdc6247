"""A real PostgreSQL server for the tests, started in a temp dir on 127.0.0.1 with a free port.

PostgreSQL refuses to run as root, and CI runs as root: the server is started as the
``postgres`` system user then (``runuser``), in a directory it owns. Any Debian
PostgreSQL version works (the binaries are found under /usr/lib/postgresql/*/bin);
without them the tests are skipped with the reason.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.servers import free_port

_databases = itertools.count(1)


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


def _as_server_user(args: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return args
    return ["runuser", "-u", "postgres", "--", *args]


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """The URL of a running server's ``postgres`` database (superuser ``postgres``, trust auth on loopback)."""
    bin_dir = _bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin "
                    "(Debian: apt-get install postgresql)")
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
    base = Path(tempfile.mkdtemp(prefix="durable-check-pg-"))
    data = base / "data"
    if os.geteuid() == 0:
        os.chown(base, owner.pw_uid, owner.pw_gid)
    port = free_port()
    subprocess.run(
        _as_server_user([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                         "--no-sync", "-E", "UTF8"]),
        check=True, capture_output=True,
    )
    options = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={base} -c fsync=off"
    subprocess.run(
        _as_server_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(base / "server.log"), "-o", options,
                         "-w", "-t", "60", "start"]),
        check=True, capture_output=True,
    )
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(_as_server_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                       check=False, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def fresh_database(server_url: str) -> str:
    """A new, empty database on the server; its URL."""
    name = f"durable_check_{os.getpid()}_{next(_databases)}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return server_url.rsplit("/", 1)[0] + "/" + name
