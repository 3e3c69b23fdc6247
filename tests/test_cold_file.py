"""Replay's temporary file of idle sessions' packed groups (processor.state.cold)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from processor.errors import StateError
from processor.state.cold import ColdBlob, ColdFile


def test_blobs_read_back_as_they_were_put_and_only_once() -> None:
    cold = ColdFile()
    try:
        blobs = [(cold.put(bytes([n]) * (n * 37 + 1)), bytes([n]) * (n * 37 + 1)) for n in range(50)]
        assert cold.blobs == 50
        assert cold.live_bytes == sum(len(data) for _, data in blobs)
        for blob, data in reversed(blobs):
            assert blob is not None
            assert blob.read() == data
        assert cold.blobs == 0 and cold.live_bytes == 0
        with pytest.raises(StateError, match="read back twice"):
            blobs[0][0].read()  # type: ignore[union-attr]
    finally:
        cold.close()


def test_the_file_is_compacted_once_what_was_read_outweighs_what_it_holds() -> None:
    """Live blobs keep their bytes across compactions; the file stays within about twice what
    it holds plus the threshold, however many blobs pass through it."""
    rng = random.Random(3)
    cold = ColdFile(compact_after_bytes=4096)
    live: dict[int, tuple[ColdBlob, bytes]] = {}
    try:
        for n in range(3000):
            data = rng.randbytes(rng.randrange(1, 400))
            blob = cold.put(data)
            assert blob is not None
            live[n] = (blob, data)
            if rng.random() < 0.9 and live:
                key = rng.choice(list(live))
                taken, expected = live.pop(key)
                assert taken.read() == expected
            assert cold.file_bytes <= 2 * cold.live_bytes + 4096 + 400
        assert cold.live_bytes == sum(len(data) for _, data in live.values())
        for blob, data in live.values():
            assert blob.read() == data
    finally:
        cold.close()


def test_a_file_that_cannot_be_made_leaves_the_bytes_with_the_caller(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cold = ColdFile(str(tmp_path / "no-such-directory"))
    assert cold.put(b"payload-7f3a") is None
    assert cold.put(b"payload-91c2") is None, "one failure is enough: the rest stay in memory too"
    assert [r.getMessage() for r in caplog.records] == [
        "replay keeps idle sessions' groups in memory: their temporary file failed (No such file or directory)"
    ]
    assert "payload" not in caplog.text


def test_a_packed_replay_session_keeps_where_its_groups_are_not_the_groups() -> None:
    from processor.evaluate.engine import Engine, EngineOptions
    from tests._engine_util import Spans, shipped

    engine = Engine(shipped(), EngineOptions(pack_idle_after_s=60, pack_every_records=1))
    span = Spans()
    try:
        engine.submit_many([span(0, session="quiet", action_id=f"a{n}", kind="tool_call") for n in range(20)])
        for n in range(4):
            engine.submit_many([span(30 * (n + 1), session="busy", action_id=f"b{n}")])
        quiet = engine._sessions["quiet"]
        assert quiet.packed is not None and isinstance(quiet.packed[0], ColdBlob)
        cold = engine._cold
        assert cold is not None and cold.blobs == 1 and cold.live_bytes == quiet.packed[0].length
        out = engine.submit_many([span(200, session="quiet", action_id="a7", kind="tool_call")])
        out += engine.finish()
        assert [(v.rule, v.action_id) for v in out if v.rule == "DS101"] == [("DS101", "a7")]
        assert quiet.packed is None and cold.blobs == 0
    finally:
        engine.close()


def test_serve_keeps_packed_groups_in_memory() -> None:
    from processor.evaluate.engine import Engine, EngineOptions
    from tests._engine_util import shipped

    engine = Engine(shipped(), EngineOptions(mode="serve"))
    assert engine._cold is None
    engine.close()


def test_the_file_is_gone_from_its_directory_from_the_start(tmp_path: Path) -> None:
    cold = ColdFile(str(tmp_path))
    try:
        assert cold.put(b"x" * 10) is not None
        assert os.listdir(tmp_path) == []  # unlinked when made: nothing to clean up after a crash
    finally:
        cold.close()
