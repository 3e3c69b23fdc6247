"""Store faults: a corrupt file stops serve with a clear message; a locked database, a full disk and a
read-only state directory are answered "retry later", and nothing acknowledged is lost once they clear."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from processor.evaluate.engine import Engine, EngineOptions
from processor.state.faults import StateCorrupt, StateUnavailable
from processor.state.journal import Journal, NewEntry
from processor.state.sqlite import SqliteStore
from tests._engine_util import Spans, shipped
from tests.durable_support import RecordingSender, durable_server, memory_run_ids, send_sessions, workload
from tests.serve_support import read_jsonl, serve_config, wait_for

SETTLE_S = 2.5


def _mount(path: Path, size: str) -> bool:
    """A small tmpfs at ``path`` (root only); False when this machine does not allow it."""
    if os.geteuid() != 0:
        return False
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, check=False)
    return done.returncode == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "fs"
    if not _mount(mount_point, "16m"):
        pytest.skip("needs root and tmpfs mounts for a real full or read-only file system (the store-level "
                    "tests below simulate a full disk with max_page_count instead)")
    try:
        yield mount_point
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(mount_point)], capture_output=True, check=False)
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)


def test_a_file_that_is_not_a_database_refuses_to_start_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not an SQLite database, it is a leftover text file\n" * 100)
    with pytest.raises(StateCorrupt) as caught:
        SqliteStore(path)
    assert str(path) in str(caught.value)
    assert "move it aside" in str(caught.value)


def test_damaged_pages_fail_the_integrity_check_at_open(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    engine = Engine(shipped(), EngineOptions(), store)
    spans = Spans()
    for n in range(200):
        engine.submit_many([spans(float(n), f"s{n}", kind="payment", action_id=f"p{n}")])
    store.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    conn.close()
    data = bytearray(path.read_bytes())
    assert len(data) > 6 * page_size
    # Every page after the first gets an invalid b-tree page type: the tables are unreadable.
    for page in range(1, len(data) // page_size):
        data[page * page_size] = 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StateCorrupt) as caught:
        SqliteStore(path)
    assert str(path) in str(caught.value)


def test_locked_database_is_retryable_and_clears(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path, busy_timeout_s=0.2)
    journal = Journal(store)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StateUnavailable) as caught:
            journal.append([NewEntry(b"r1", "grpc", "o", 1, 0)])
        assert "locked" in str(caught.value) and str(path) in str(caught.value)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert all(isinstance(i, int) for i in journal.append([NewEntry(b"r1", "grpc", "o", 1, 0)]))
    assert [e.body for e in journal.pending()] == [b"r1"]
    store.close()


def test_size_cap_reads_as_disk_full_and_the_store_recovers(tmp_path: Path) -> None:
    """max_page_count caps the file: SQLite answers SQLITE_FULL exactly as on a full disk."""
    path = tmp_path / "state.db"
    store = SqliteStore(path, max_page_count=40)
    journal = Journal(store)
    with pytest.raises(StateUnavailable) as caught:
        for n in range(200):
            journal.append([NewEntry(os.urandom(4000), "grpc", "o", n, 0)])
    assert str(caught.value) == f"disk full at {path}"
    accepted = journal.pending(limit=1000)
    assert accepted, "requests journaled before the disk filled stay journaled"
    with store.unit():
        journal.done_in_unit([(e.id, e.size) for e in accepted])
    assert all(isinstance(i, int) for i in journal.append([NewEntry(b"small", "grpc", "o", 1, 0)]))
    store.close()


def test_full_disk_answers_retry_and_loses_nothing_acknowledged(tmp_path: Path, small_fs: Path) -> None:
    """Half the workload; the state's file system fills while the other half is sent; space comes back."""
    state_dir = small_fs
    requests = workload(7, sessions=16, steps=8, start_ns=time.time_ns())
    first = {name: reqs[:4] for name, reqs in requests.items()}
    second = {name: reqs[4:] for name, reqs in requests.items()}
    reference_config = serve_config(tmp_path / "ref", {"evaluate": {"allowed_lateness": "200ms"}})
    (tmp_path / "ref").mkdir()
    expected = memory_run_ids(reference_config, requests, SETTLE_S)
    config = serve_config(tmp_path, {"evaluate": {"allowed_lateness": "200ms"},
                                     "state": {"backend": "sqlite", "path": str(state_dir / "state.db")}})
    store = SqliteStore(state_dir / "state.db", busy_timeout_s=0.5)
    filler = state_dir / "filler"
    with durable_server(config, store) as server:
        sender = RecordingSender(lambda: server.grpc_port, give_up_s=90.0)
        send_sessions(sender, first)
        with contextlib.suppress(OSError), filler.open("wb") as handle:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        sending = threading.Thread(target=send_sessions, args=(sender, second))
        sending.start()
        try:
            assert wait_for(lambda: len(sender.errors) >= 3, timeout_s=20.0), "the fault was never reported"
            # Readiness says so too, so an orchestrator routes around this replica meanwhile.
            assert server.ready() == (False, "the state store is failing")
        finally:
            filler.unlink()
        sending.join(120.0)
        assert not sending.is_alive()
        time.sleep(SETTLE_S)
    assert any("disk full" in message for message in sender.errors), sender.errors[:5]
    documents = read_jsonl(Path(config.exporters.jsonl.path))
    ids = [d["violation_id"] for d in documents]
    assert len(ids) == len(set(ids)), "a violation was written twice"
    assert sorted(ids) == sorted(expected)


def test_read_only_state_directory_is_a_clear_error_and_clears(tmp_path: Path, small_fs: Path) -> None:
    """A read-only file system under the state (a mount, a read-only root file system in a pod).

    Linux refuses to remount a file system read-only while a file on it is open for
    writing, so the fault is met where it happens in practice: when the store opens.
    """
    store = SqliteStore(small_fs / "state.db")
    Journal(store).append([NewEntry(b"accepted before", "grpc", "o", 1, 0)])
    store.close()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    with pytest.raises(StateUnavailable) as caught:
        SqliteStore(small_fs / "state.db")
    assert str(small_fs) in str(caught.value)
    subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    reopened = SqliteStore(small_fs / "state.db")
    assert [e.body for e in Journal(reopened).pending()] == [b"accepted before"]
    reopened.close()


def test_a_second_process_on_the_same_database_refuses_to_start(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = SqliteStore(path)
    with pytest.raises(StateUnavailable) as caught:
        SqliteStore(path)
    assert "in use by another durable-check process" in str(caught.value) and str(path) in str(caught.value)
    first.close()
    SqliteStore(path).close()
