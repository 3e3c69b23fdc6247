"""The compact store of a replay's action ids (log_scope: file rules), against a dict, and what it holds."""

from __future__ import annotations

import os
import random
import tracemalloc
from typing import Any

import pytest

from processor.evaluate.cel import Environment, compile_expression, references_when
from processor.evaluate.engine import Engine, EngineOptions
from processor.state.file_ids import FileIds
from processor.state.session import MISSING
from tests._engine_util import log_line, shipped


def _digest(rng: random.Random, prefix: bytes = b"") -> bytes:
    return prefix + rng.randbytes(16 - len(prefix))


@pytest.mark.parametrize("memory_entries", [256, 4096, 1 << 20])
def test_it_answers_as_a_dict_would_for_every_kind_of_kept_tuple(memory_entries: int, tmp_path: Any) -> None:
    rng = random.Random(7)
    kinds: list[tuple[Any, ...]] = [("llm_call", MISSING), ("payment", None), (b"\x01" * 8, "x"), (MISSING,),
                                    (1,), (True,), (1.0,), ([1, 2],), ({"a": 1},), (-0.0, "s")]
    store, reference = FileIds(memory_entries=memory_entries, directory=str(tmp_path)), {}
    # Crowded buckets (a few first bytes) as well as spread ones.
    prefixes = [b"", b"\x00\x00", b"\xff\x01"]
    try:
        for n in range(20_000):
            digest = _digest(rng, rng.choice(prefixes))
            if digest in reference:
                continue
            kept = rng.choice(kinds)
            store.put(digest, kept)
            reference[digest] = kept
            if n % 97 == 0:  # looked up while its neighbours are still pending, and after they are written
                probe = rng.choice(list(reference)[-50:])
                assert store.get(probe) is reference[probe]
        assert len(store) == len(reference)
        assert (store.file_bytes > 0) is (memory_entries < 20_000)
        for digest, kept in reference.items():
            found = store.get(digest)
            assert found == kept and [type(v) for v in found] == [type(v) for v in kept], (digest, found, kept)
        for _ in range(5_000):
            digest = _digest(rng, rng.choice(prefixes))
            assert store.get(digest) is reference.get(digest)
    finally:
        store.close()


def test_ids_that_share_a_fingerprint_are_told_apart_by_their_whole_digest(tmp_path: Any) -> None:
    store = FileIds(memory_entries=256, directory=str(tmp_path))
    shared = b"\x07\x07\x07\x07\x07"  # bucket and fingerprint alike
    ids = [shared + n.to_bytes(2, "big") * 5 + b"\x01" for n in range(600)]
    for n, digest in enumerate(ids):
        store.put(digest, (f"k{n % 3}",))
    try:
        # The first entries' blocks are on disk: a lookup reads blocks until one holds its digest.
        assert store.file_bytes >= 256 * 18
        assert store.get(ids[0]) == ("k0",) and store.disk_reads == 1  # found in the first block
        assert store.get(ids[599]) == ("k2",) and store.disk_reads == 5  # after the four blocks on disk
        before = store.disk_reads
        assert store.get(shared + b"\xfe" * 11) is None  # each block with the fingerprint searched once
        assert store.disk_reads - before == 4  # four blocks on disk, the fifth pending
        assert store.get(ids[300]) == ("k0",)
    finally:
        store.close()


def test_bytes_that_straddle_two_entries_are_not_an_id() -> None:
    store = FileIds()
    first, second = b"\x07\x07" + bytes(range(1, 15)), b"\x07\x07" + bytes(range(101, 115))
    store.put(first, ("a",))
    store.put(second, ("b",))
    bucket = store._buckets[(0x07 << 6) | (0x07 >> 2)]
    assert bucket is not None and len(bucket) == 10
    # A digest whose fingerprint is the bytes across the two fingerprints: the end of the
    # first's block number, the start of the second's.
    straddling = b"\x07\x07" + bytes(bucket[4:6]) + bytes(range(201, 213))
    assert store.get(straddling) is None
    # An entry's bytes across two entries in the pending block are not an entry either.
    pending = bytes(store._pending)
    assert store.get(pending[10:26]) is None
    # Once it is an id of its own, it is found at its entry.
    store.put(straddling, ("c",))
    assert (store.get(first), store.get(second), store.get(straddling)) == (("a",), ("b",), ("c",))
    store.setdefault(first, ("z",))
    assert store.get(first) == ("a",) and len(store) == 3


def test_bytes_across_two_entries_of_a_block_are_not_an_entry(tmp_path: Any) -> None:
    """A digest found inside a block but across two entries is not there, in memory or on disk,
    even when an id of that block shares its fingerprint (so that the block is read)."""
    store = FileIds(memory_entries=128, directory=str(tmp_path))
    first, second = bytes(range(16)), bytes(range(100, 116))
    store.put(first, ("a",))
    store.put(second, ("a",))
    entries = bytes(store._pending[: 2 * 18])
    across = entries[4:20]  # the end of the first digest, its tuple number, the second's start
    store.put(across[:4] + b"\xee" * 12, ("b",))  # same bucket and fingerprint as ``across``
    try:
        assert store.get(across) is None
        rng = random.Random(13)
        for _ in range(300):
            store.put(_digest(rng), ("c",))
        assert store.file_bytes > 0  # the first block is on disk now
        reads = store.disk_reads
        assert store.get(across) is None and store.disk_reads == reads + 1
        assert store.get(first) == ("a",) and store.get(across[:4] + b"\xee" * 12) == ("b",)
    finally:
        store.close()


def test_past_the_numbered_tuples_ids_still_keep_their_own() -> None:
    store = FileIds()
    rng = random.Random(3)
    digests = [_digest(rng) for _ in range(70_000)]
    for n, digest in enumerate(digests):
        store.put(digest, (f"kind-{n}",))
    assert all(store.get(d) == (f"kind-{n}",) for n, d in enumerate(digests))
    with pytest.raises(ValueError, match="16 bytes"):
        store.put(b"short", ("a",))
    store.close()


def test_the_temporary_file_is_unlinked_and_goes_on_close(tmp_path: Any) -> None:
    store = FileIds(memory_entries=256, directory=str(tmp_path))
    rng = random.Random(5)
    for _ in range(2_000):
        store.put(_digest(rng), ("llm_call",))
    assert store.file_bytes == 1792 * 18  # whole blocks written, the rest pending
    assert list(tmp_path.iterdir()) == []  # nothing to leave behind, even on a crash
    assert store._file is not None
    fd = store._file.fileno()
    store.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_file_that_cannot_be_written_keeps_the_ids_in_memory(tmp_path: Any, caplog: Any) -> None:
    missing = tmp_path / "gone"  # no such directory: the temporary file cannot be made
    store = FileIds(memory_entries=256, directory=str(missing))
    rng = random.Random(9)
    digests = [_digest(rng) for _ in range(3_000)]
    with caplog.at_level("WARNING", logger="durable_check.state"):
        for n, digest in enumerate(digests):
            store.put(digest, (f"k{n % 5}",))
    assert store.file_bytes == 0 and store.disk_reads == 0
    assert all(store.get(d) == (f"k{n % 5}",) for n, d in enumerate(digests))
    warnings = [r for r in caplog.records if "action ids in memory" in r.getMessage()]
    assert len(warnings) == 1 and str(missing) not in warnings[0].getMessage()


def test_an_id_takes_about_five_bytes_of_memory_not_a_hundred(tmp_path: Any) -> None:
    rng = random.Random(11)
    digests = [_digest(rng) for _ in range(500_000)]
    kinds = [("llm_call", MISSING), ("payment", MISSING), ("user_prompt", MISSING)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = FileIds(directory=str(tmp_path))
        for n, digest in enumerate(digests):
            store.put(digest, kinds[n % 3])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    try:
        # 5 bytes of fingerprint an id, the buckets' slack, and the entries not yet written (295 KB).
        assert held / len(digests) < 10, held / len(digests)
        assert store.file_bytes >= 400_000 * 18
        assert all(store.get(d) == kinds[n % 3] for n, d in enumerate(digests[::1000]))
    finally:
        store.close()
    reference = {int.from_bytes(d, "big"): kinds[n % 3] for n, d in enumerate(digests[:50_000])}
    assert len(reference) == 50_000  # what it replaced: a dict of 128-bit ints, over 100 bytes an id


def _first_read(source: str, on: str) -> set[str]:
    env = Environment(variables={"record": "map", "meta": "map", "first": "map"})
    expression = compile_expression(source, env)
    assert expression.tree is not None
    references = references_when(expression.tree, expression.constants, {("meta", "source"): on})
    return {f for v, f in references if v == "first"}


@pytest.mark.parametrize(
    ("source", "on_logs", "on_spans"),
    [
        ('meta.source == "log" || record.kind != first.kind', set(), {"kind"}),
        ('meta.source == "span" ? first.a : first.b', {"b"}, {"a"}),
        ('meta.source != "log" && first.x == 1', set(), {"x"}),
        ('!(meta.source == "log") || first.q == 2', {"q"}, set()),
        ('record.kind == "x" || first.y == 1', {"y"}, {"y"}),
        ('has(first.z) && meta.source == "log"', {"z"}, set()),
        ('"log" == meta.source || size(first) > 0', set(), {"*"}),
    ],
)
def test_what_an_expression_reads_of_first_once_the_source_is_known(
    source: str, on_logs: set[str], on_spans: set[str]
) -> None:
    assert _first_read(source, "log") == on_logs
    assert _first_read(source, "span") == on_spans


def test_ds009_keeps_a_lines_kind_not_its_fingerprint_and_still_reports_the_first_kind() -> None:
    engine = Engine(shipped(), EngineOptions())
    kinds = ["llm_call", "payment", "user_prompt"]
    lines = [log_line(n, action_id=f"a{n}", kind=kinds[n % 3], input_fingerprint=f"fp-{n}") for n in range(1, 301)]
    lines.append(log_line(301, action_id="a2", kind="write", input_fingerprint="fp-other"))
    out = engine.submit_many(lines) + engine.finish()
    repeats = [v for v in out if v.rule == "DS009"]
    assert len(repeats) == 1 and "first as user_prompt, now as write" in repeats[0].message
    (ids,) = [g for g in engine._file_groups.values() if len(g)]
    assert len(ids) == 300 and len(ids._tuples) <= 3 and not ids._other


def test_the_engine_finds_repeats_of_ids_whose_entries_went_to_disk() -> None:
    """Past 16,384 ids a file's entries are written out: the engine still reports a repeat of
    the first ids, with the kind their first line kept, and nothing for new ids."""
    engine = Engine(shipped(), EngineOptions())
    kinds = ["llm_call", "tool_call", "user_prompt"]
    count = 20_000
    lines = [log_line(n, session=f"s{n % 50}", action_id=f"a{n}", kind=kinds[n % 3]) for n in range(1, count + 1)]
    repeats = [1, 2, 5_000, 16_000, 19_999]
    lines += [log_line(count + i + 1, session="late", action_id=f"a{n}", kind="write") for i, n in enumerate(repeats)]
    try:
        out = engine.submit_many(lines) + engine.finish()
        (ids,) = [g for g in engine._file_groups.values() if len(g)]
        assert len(ids) == count and ids.file_bytes >= 16_384 * 18
        found = sorted((v.action_id, v.message.split("first as ")[1].split(",")[0]) for v in out if v.rule == "DS009")
        assert found == sorted((f"a{n}", kinds[n % 3]) for n in repeats)
        assert ids.disk_reads >= 3  # the repeats of ids written out were read back
    finally:
        engine.close()
    assert ids._file is None


@pytest.mark.parametrize("names", [("a",), ("a", "b"), ("a", "b", "c"), ("a", "b", "c", "d")])
def test_a_reader_of_some_kept_fields_reads_those_and_leaves_the_others_absent(names: tuple[str, ...]) -> None:
    from itertools import combinations

    from processor.evaluate.engine import _kept_reader

    record = {"a": 1, "b": None, "d": "x", "other": 2}
    for size in range(len(names) + 1):
        for only in combinations(names, size):
            read = _kept_reader(names, frozenset(only))(record)
            assert read == tuple(record.get(n, MISSING) if n in only else MISSING for n in names), only
