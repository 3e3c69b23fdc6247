"""read_input: every file format, compression, streaming, and every kind of bad input."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import random
import shutil
import struct
import sys
import tempfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import zstandard

from processor.convert import ConvertOptions, SpanConverter, decode_traces
from processor.errors import InputError
from processor.receive._streams import TooLong, frames, line_blocks, lines
from processor.receive.files import (
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    FORMATS,
    read_batches,
    read_input,
)
from processor.records import Action, Malformed
from tests._spans import TESTDATA, check_golden, golden_lines, otlp_json_from_request, reference_request

READERS = TESTDATA / "readers"
SPAN_FILES = {
    "otlp-json-lines": "spans.otlp.jsonl",
    "otlp-json": "spans.otlp.json",
    "otlp-proto": "spans.pb",
    "otlp-proto-stream": "spans.pbstream",
}


def _read(
    path: Path | str,
    input_format: str | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> list[Action | Malformed]:
    return list(read_input(str(path), input_format, max_line_bytes=max_line_bytes, max_message_bytes=max_message_bytes))


def _malformed(items: list[Action | Malformed]) -> list[Malformed]:
    return [item for item in items if isinstance(item, Malformed)]


@pytest.mark.parametrize("input_format", sorted(SPAN_FILES))
def test_span_formats_match_the_golden_file(input_format: str) -> None:
    path = READERS / SPAN_FILES[input_format]
    items = _read(path)
    check_golden(READERS / "spans.golden.jsonl", items)
    assert golden_lines(_read(path, input_format)) == golden_lines(items), "detection chose the wrong format"
    assert all(item.origin == str(path) for item in items)


def test_actions_match_the_golden_file() -> None:
    items = _read(READERS / "actions.jsonl")
    check_golden(READERS / "actions.golden.jsonl", items)
    assert [item.seq for item in items if isinstance(item, Action)] == list(range(5))


@pytest.mark.parametrize("name", ["actions.jsonl", *SPAN_FILES.values()])
@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_compression_is_transparent(tmp_path: Path, name: str, compression: str) -> None:
    data = (READERS / name).read_bytes()
    packed = gzip.compress(data) if compression == "gzip" else zstandard.ZstdCompressor().compress(data)
    target = tmp_path / f"{name}.{compression}"
    target.write_bytes(packed)
    assert golden_lines(_read(target)) == golden_lines(_read(READERS / name))


def test_concatenated_gzip_members_and_zstd_frames_are_read_in_full(tmp_path: Path) -> None:
    lines = (READERS / "actions.jsonl").read_bytes().splitlines(keepends=True)
    half = len(lines) // 2
    head, tail = b"".join(lines[:half]), b"".join(lines[half:])
    expected = golden_lines(_read(READERS / "actions.jsonl"))
    (tmp_path / "a.gz").write_bytes(gzip.compress(head) + gzip.compress(tail))
    compressor = zstandard.ZstdCompressor()
    (tmp_path / "a.zst").write_bytes(compressor.compress(head) + compressor.compress(tail))
    assert golden_lines(_read(tmp_path / "a.gz")) == expected
    assert golden_lines(_read(tmp_path / "a.zst")) == expected


def test_json_lines_carry_their_line_numbers(tmp_path: Path) -> None:
    lines = (READERS / "spans.otlp.jsonl").read_bytes().splitlines()
    target = tmp_path / "spans.jsonl"
    target.write_bytes(
        lines[0]
        + b"\n\n{broken\n"
        + b'["not an object"]\n'
        + lines[1]
        + b'\n{"resourceMetrics":[]}\n{"session_id":"s"}\n'
    )
    items = _read(target)
    first = orjson.loads(lines[0])
    first_line_items = [item for item in items if item.line == 1]
    assert first_line_items and all(isinstance(i, (Action, Malformed)) for i in first_line_items)
    by_line = {item.line: item for item in _malformed(items) if item.line in (3, 4)}
    assert by_line[3].message.startswith("not valid JSON (") and "at column" in by_line[3].message
    assert by_line[4].message == "not an OTLP trace export: document: must be an object, got an array"
    assert [m.line for m in _malformed(items) if m.line and m.line > 5] == [7]  # metrics are skipped silently
    assert [m.message for m in _malformed(items) if m.line == 7] == ["not an OTLP trace export: no resourceSpans"]
    assert {item.line for item in items if isinstance(item, Action)} == {1, 5}
    assert len(first["resourceSpans"]) == 2


def test_a_bad_span_in_otlp_json_is_reported_and_the_rest_kept(tmp_path: Path) -> None:
    document = orjson.loads((READERS / "spans.otlp.json").read_bytes())
    spans = document["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans[0]["traceId"] = "not-hex"
    spans[1]["attributes"][0]["value"] = {"intValue": "twelve"}
    target = tmp_path / "bad.json"
    target.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    good = _read(READERS / "spans.otlp.json")
    items = _read(target)
    problems = [m.message for m in _malformed(items)]
    assert 'resourceSpans[0].scopeSpans[0].spans[0].traceId: must be 32 hex digits (span "ask traveller")' in problems
    assert (
        "resourceSpans[0].scopeSpans[0].spans[1].attributes[0].value.intValue: must be an integer or a decimal string"
        ' (span "charge card")'
    ) in problems
    assert len([i for i in items if isinstance(i, Action)]) == len([i for i in good if isinstance(i, Action)]) - 2


def test_otlp_json_accepts_snake_case_numbers_and_enum_names(tmp_path: Path) -> None:
    document = {
        "resource_spans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"string_value": "svc"}}]},
                "scope_spans": [
                    {
                        "spans": [
                            {
                                "trace_id": "5b8efff798038103d269b633813fc60c",
                                "span_id": "00f067aa0ba902b7",
                                "name": "pay",
                                "kind": "SPAN_KIND_CLIENT",
                                "start_time_unix_nano": 1_793_524_440_000_000_000,
                                "attributes": [
                                    {"key": "durable.action.kind", "value": {"string_value": "payment"}},
                                    {"key": "durable.retry.attempt", "value": {"int_value": 2}},
                                    {"key": "future.field", "value": {"someNewValue": 1}},
                                ],
                                "status": {"code": "STATUS_CODE_ERROR"},
                                "aNewerField": {"ignored": True},
                            }
                        ]
                    }
                ],
            }
        ]
    }
    target = tmp_path / "snake.json"
    target.write_bytes(orjson.dumps(document))
    (item,) = _read(target)
    assert isinstance(item, Action)
    assert item.record["attempts"] == 2 and item.record["status"] == "error" and item.record["service"] == "svc"


def test_protobuf_json_from_a_real_request_round_trips(tmp_path: Path) -> None:
    proto = reference_request((READERS / "spans.otlp.json").read_bytes())
    target = tmp_path / "round.json"
    target.write_bytes(otlp_json_from_request(proto))
    assert golden_lines(_read(target)) == golden_lines(_read(READERS / "spans.pb"))


def _read_until_broken(path: Path) -> tuple[list[Action | Malformed], InputError]:
    """The items read before the input broke, and the error that says where."""
    items: list[Action | Malformed] = []
    with pytest.raises(InputError) as caught:
        for item in read_input(str(path)):
            items.append(item)
    return items, caught.value


def test_truncated_gzip_is_unreadable_after_the_lines_before_the_cut(tmp_path: Path) -> None:
    body = b"".join(
        orjson.dumps({"session_id": "s", "action_id": f"a{i}", "kind": "write", "status": "ok", "pad": "x" * 200})
        + b"\n"
        for i in range(2000)
    )
    packed = gzip.compress(body, compresslevel=1)
    target = tmp_path / "cut.jsonl.gz"
    target.write_bytes(packed[: len(packed) // 2])
    actions, error = _read_until_broken(target)
    assert actions and all(isinstance(item, Action) for item in actions)
    assert str(error) == (
        f"{target}: gzip stream truncated after line {len(actions)}; the input could not be read to its end"
    )


def test_truncated_zstd_is_unreadable_after_the_lines_before_the_cut(tmp_path: Path) -> None:
    body = b"".join(
        orjson.dumps({"session_id": "s", "action_id": f"a{i}", "kind": "write", "status": "ok"}) + b"\n"
        for i in range(5000)
    )
    packed = zstandard.ZstdCompressor().compress(body)
    target = tmp_path / "cut.jsonl.zst"
    target.write_bytes(packed[: len(packed) - 20])
    items, error = _read_until_broken(target)
    assert 0 < len(items) < 5000 and all(isinstance(item, Action) for item in items)
    assert str(error).startswith(f"{target}: zstd stream truncated after line {len(items)};")


def test_gzip_header_then_garbage_is_unreadable(tmp_path: Path) -> None:
    target = tmp_path / "header.jsonl.gz"
    line = orjson.dumps({"session_id": "s", "action_id": "a", "kind": "write", "status": "ok"}) + b"\n"
    target.write_bytes(gzip.compress(line * 1000)[:14])  # the header and a few bytes of deflate data
    items, error = _read_until_broken(target)
    assert items == []
    assert "before its first line" in str(error) and str(error).startswith(f"{target}: ")


def test_trailing_junk_after_a_gzip_member_is_unreadable(tmp_path: Path) -> None:
    line = orjson.dumps({"session_id": "s", "action_id": "a", "kind": "write", "status": "ok"}) + b"\n"
    target = tmp_path / "junk.jsonl.gz"
    target.write_bytes(gzip.compress(line * 3) + b"not gzip at all")
    items, error = _read_until_broken(target)
    assert len(items) == 3
    assert str(error) == (
        f"{target}: data after the last gzip member is not gzip after line 3; the input could not be read to its end"
    )


@pytest.mark.parametrize("input_format", ["otlp-json", "otlp-proto", "otlp-proto-stream"])
def test_a_cut_compressed_span_file_is_unreadable(tmp_path: Path, input_format: str) -> None:
    sources = {"otlp-json": "spans.otlp.json", "otlp-proto": "spans.pb", "otlp-proto-stream": "spans.pbstream"}
    source = sources[input_format]
    packed = gzip.compress((READERS / source).read_bytes() * 2)
    target = tmp_path / "cut.gz"
    target.write_bytes(packed[: len(packed) - 12])
    with pytest.raises(InputError, match=r"gzip stream truncated .*; the input could not be read to its end"):
        list(read_input(str(target), input_format))


def test_gzip_that_is_not_gzip_cannot_be_read(tmp_path: Path) -> None:
    target = tmp_path / "fake.gz"
    target.write_bytes(b"\x1f\x8b" + b"this is not deflate data at all" * 10)
    with pytest.raises(InputError, match=r"fake\.gz: not valid gzip data"):
        read_input(str(target))


def test_zstd_that_is_not_zstd_cannot_be_read(tmp_path: Path) -> None:
    target = tmp_path / "fake.zst"
    # The zstd magic, then noise from a fixed seed: fresh noise after the magic is, about once in
    # two thousand runs, a frame header the decoder takes (the test then failed by chance).
    target.write_bytes(b"\x28\xb5\x2f\xfd" + random.Random(64).randbytes(64))
    with pytest.raises(InputError, match=r"fake\.zst: not valid zstd data"):
        read_input(str(target))


def test_binary_garbage_cannot_be_read(tmp_path: Path) -> None:
    target = tmp_path / "garbage.bin"
    target.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    with pytest.raises(InputError, match="binary data that is not an action log, OTLP JSON or OTLP protobuf"):
        read_input(str(target))


def test_missing_file_and_directory_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"nope\.jsonl: cannot open \(No such file or directory\)"):
        read_input(str(tmp_path / "nope.jsonl"))
    with pytest.raises(InputError, match="cannot open"):
        read_input(str(tmp_path))


@contextlib.contextmanager
def _as_unprivileged_user() -> Iterator[None]:
    """Root reads files whatever their mode: as root, drop the effective uid for the block."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


NOBODY = 65534


def test_unreadable_file_cannot_be_read() -> None:
    # A directory anyone may search (pytest's tmp_path is root's, 0700), holding a file nobody may read.
    folder = Path(tempfile.mkdtemp(prefix="durable-check-unreadable-"))
    try:
        folder.chmod(0o755)
        target = folder / "secret.jsonl"
        target.write_bytes(b"{}\n")
        target.chmod(0)
        denied = r"secret\.jsonl: cannot open \(Permission denied\)"
        with _as_unprivileged_user(), pytest.raises(InputError, match=denied):
            read_input(str(target))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux /proc")
def test_a_file_that_fails_on_first_read_cannot_be_read() -> None:
    # The first page of a process's memory is never mapped: reading it fails with EIO.
    with pytest.raises(InputError, match=r"/proc/self/mem: read failed \(Input/output error\)"):
        read_input("/proc/self/mem")


def test_unknown_format_name_is_refused() -> None:
    with pytest.raises(InputError, match="unknown input format 'csv'; use one of actions, "):
        read_input(str(READERS / "actions.jsonl"), "csv")
    assert FORMATS == ("actions", "otlp-json-lines", "otlp-json", "otlp-proto", "otlp-proto-stream")


def test_invalid_utf8_line_is_malformed_and_reading_goes_on(tmp_path: Path) -> None:
    target = tmp_path / "latin1.jsonl"
    good = b'{"session_id":"s","action_id":"a","kind":"write","status":"ok"}'
    target.write_bytes(good + b"\n" + b'{"session_id":"s\xe9","action_id":"b","kind":"write","status":"ok"}\n' + good)
    items = _read(target)
    assert [type(item).__name__ for item in items] == ["Action", "Malformed", "Action"]
    assert items[1].line == 2 and isinstance(items[1], Malformed) and items[1].message == "line is not valid UTF-8"


def test_a_100_mb_line_is_skipped_without_being_held(tmp_path: Path) -> None:
    target = tmp_path / "huge.jsonl"
    good = b'{"session_id":"s","action_id":"a","kind":"write","status":"ok"}\n'
    with target.open("wb") as handle:
        handle.write(good)
        handle.write(b'{"session_id":"s","action_id":"b","kind":"write","status":"ok","blob":"')
        block = b"x" * (1 << 20)
        for _ in range(100):
            handle.write(block)
        handle.write(b'"}\n')
        handle.write(good.replace(b'"a"', b'"c"'))
    tracemalloc.start()
    try:
        items = _read(target, max_line_bytes=4 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [type(item).__name__ for item in items] == ["Action", "Malformed", "Action"]
    assert items[1].line == 2 and items[2].line == 3
    assert isinstance(items[1], Malformed)
    assert items[1].message.startswith("line is longer than 4194304 bytes (at least 1048")
    assert peak < 16 << 20, f"peak {peak} bytes: the long line was held in memory"


def test_a_long_last_line_without_newline_is_skipped(tmp_path: Path) -> None:
    target = tmp_path / "tail.jsonl"
    target.write_bytes(b'{"session_id":"s","action_id":"a","kind":"write","status":"ok"}\n' + b"y" * 5000)
    items = _read(target, max_line_bytes=1000)
    assert isinstance(items[-1], Malformed) and items[-1].line == 2 and "longer than 1000 bytes" in items[-1].message


def test_garbage_bytes_as_otlp_proto_are_malformed(tmp_path: Path) -> None:
    target = tmp_path / "garbage.pb"
    target.write_bytes(b"\n\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01garbage")
    (item,) = _read(target)  # detected as otlp-proto from its first byte
    assert isinstance(item, Malformed)
    assert item.message == f"message 1: not a valid OTLP protobuf trace export ({target.stat().st_size} bytes)"
    other = tmp_path / "text.pb"
    other.write_bytes(b"\x08\x01\x10\x02")  # parses, but as unknown fields only
    (item,) = _read(other, "otlp-proto")
    assert isinstance(item, Malformed) and item.message == "message 1: 4 bytes hold no OTLP resource spans"


def test_proto_stream_bad_oversized_and_truncated_messages(tmp_path: Path) -> None:
    stream = (READERS / "spans.pbstream").read_bytes()
    first_len = struct.unpack(">I", stream[:4])[0]
    first = stream[: 4 + first_len]
    garbage = b"\xff" * 12
    oversized = b"\n" + b"\x00" * 3000
    target = tmp_path / "mixed.pbstream"
    target.write_bytes(
        first
        + struct.pack(">I", len(garbage))
        + garbage
        + struct.pack(">I", len(oversized))
        + oversized
        + first
        + struct.pack(">I", 500)
        + b"\n" * 100
    )
    items = _read(target, max_message_bytes=2048)
    messages = [m.message for m in _malformed(items)]
    assert "message 2: not a valid OTLP protobuf trace export (12 bytes)" in messages
    assert "message 3 is longer than 2048 bytes (3001); skipped" in messages
    assert messages[-1] == "input truncated in message 5"
    single = _read(tmp_path / "mixed.pbstream", max_message_bytes=2048)
    once = _read(READERS / "spans.pbstream")
    first_message_actions = [i for i in once if isinstance(i, Action)][
        : len([i for i in single if isinstance(i, Action)]) // 2
    ]
    assert [i.record for i in single if isinstance(i, Action)] == [a.record for a in first_message_actions] * 2


def test_proto_stream_cut_inside_a_length_prefix(tmp_path: Path) -> None:
    stream = (READERS / "spans.pbstream").read_bytes()
    target = tmp_path / "cut.pbstream"
    first_len = struct.unpack(">I", stream[:4])[0]
    target.write_bytes(stream[: 4 + first_len + 2])
    items = _read(target)
    assert isinstance(items[-1], Malformed) and items[-1].message == "input truncated in message 2"


def test_empty_and_whitespace_inputs_hold_nothing(tmp_path: Path) -> None:
    for content in (b"", b"\n\n  \n", b"# only a comment\n"):
        target = tmp_path / "empty"
        target.write_bytes(content)
        assert _read(target) == []


def test_text_that_is_not_json_is_read_as_an_action_log(tmp_path: Path) -> None:
    target = tmp_path / "notes.txt"
    # A leading newline is byte 0x0a, as a serialized request starts: text must still read as text.
    target.write_bytes(b"\nhello\nworld\n")
    items = _read(target)
    assert [(m.line, m.message.split(" (")[0]) for m in _malformed(items)] == [
        (2, "not valid JSON"),
        (3, "not valid JSON"),
    ]


def test_stdin_is_read_as_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    data = gzip.compress((READERS / "actions.jsonl").read_bytes())
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    items = list(read_input("-"))
    assert golden_lines(items) == golden_lines(_read(READERS / "actions.jsonl"))
    assert {item.origin for item in items} == {"<stdin>"}


def test_the_converter_given_is_used() -> None:
    only_durable = SpanConverter(ConvertOptions(genai=False, openinference=False, openllmetry=False))
    kinds = {
        i.record["kind"] for i in read_input(str(READERS / "spans.pb"), converter=only_durable) if isinstance(i, Action)
    }
    default_kinds = {i.record["kind"] for i in _read(READERS / "spans.pb") if isinstance(i, Action)}
    # Model calls come only from the GenAI profile; the durable spans remain.
    assert "llm_call" in default_kinds and "llm_call" not in kinds
    assert {"payment", "approval", "checkpoint", "email"} <= kinds


@pytest.mark.parametrize("name", ["actions.jsonl", *SPAN_FILES.values()])
def test_a_converter_factory_is_called_only_for_spans(name: str) -> None:
    made: list[SpanConverter] = []

    def make() -> SpanConverter:
        made.append(SpanConverter(ConvertOptions(genai=False, openinference=False, openllmetry=False)))
        return made[-1]

    items = [item for batch in read_batches(str(READERS / name), converter=make) for item in batch.items]
    if name == "actions.jsonl":
        # An action log needs no span converter: replay of one does not load protobuf.
        assert made == [] and sum(isinstance(i, Action) for i in items) == 5
    else:
        assert len(made) == 1
        kinds = {i.record["kind"] for i in items if isinstance(i, Action)}
        assert "llm_call" not in kinds and "payment" in kinds, "the converter made was not the one used"


def test_reading_is_lazy_and_closes_the_file(tmp_path: Path) -> None:
    target = tmp_path / "many.jsonl"
    line = b'{"session_id":"s","action_id":"a","kind":"write","status":"ok"}\n'
    target.write_bytes(line * 50_000)
    iterator = read_input(str(target))
    first = next(iterator)
    assert isinstance(first, Action) and first.line == 1
    iterator.close()  # type: ignore[attr-defined]
    count = sum(1 for _ in read_input(str(target)))
    assert count == 50_000


def _chunked(data: bytes, size: int) -> Iterator[bytes]:
    return iter([data[i : i + size] for i in range(0, len(data), size)])


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 64])
def test_line_splitting_does_not_depend_on_chunk_boundaries(chunk_size: int) -> None:
    data = b"one\r\n\ntwo two\n" + b"z" * 20 + b"\nlast-without-newline"
    result = [
        (number, raw if isinstance(raw, bytes) else ("too long", raw.size_at_least))
        for number, raw in lines(_chunked(data, chunk_size), max_line=10)
    ]
    assert result == [
        (1, b"one\r"),
        (2, b""),
        (3, b"two two"),
        (4, ("too long", 20)),
        (5, ("too long", 20)),
    ]
    exact = [raw for _, raw in lines(_chunked(b"0123456789\n", chunk_size), max_line=10)]
    assert exact == [b"0123456789"]


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 1000])
def test_frames_do_not_depend_on_chunk_boundaries(chunk_size: int) -> None:
    data = b"".join(struct.pack(">I", len(body)) + body for body in (b"abc", b"", b"x" * 40, b"defg"))
    result = [
        (frame.index, frame.data if isinstance(frame.data, bytes) else "too long")
        for frame in frames(_chunked(data, chunk_size), max_message=10)
    ]
    assert result == [(1, b"abc"), (2, b""), (3, "too long"), (4, b"defg")]


def test_attributes_nobody_reads_do_not_spoil_a_json_span(tmp_path: Path) -> None:
    document = orjson.loads((READERS / "spans.otlp.json").read_bytes())
    span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["attributes"].append({"key": "app.counter", "value": {"intValue": "not a number"}})
    target = tmp_path / "noise.json"
    target.write_bytes(orjson.dumps(document))
    assert golden_lines(_read(target)) == golden_lines(_read(READERS / "spans.otlp.json"))
    # Decoding everything (as a receiver that forwards spans must) still finds the bad value.
    _, problems = decode_traces(document)
    assert problems == [
        "resourceSpans[0].scopeSpans[0].spans[0].attributes[5].value.intValue: must be an integer or a decimal string"
        ' (span "ask traveller")'
    ]


def test_flattened_model_replies_survive_json_decoding_when_telemetry_is_the_log() -> None:
    converter = SpanConverter(ConvertOptions(telemetry_is_log=True))
    path = str(TESTDATA / "convert" / "openinference.otlp.json")
    items = list(read_input(path, converter=converter))
    chat = [i.record for i in items if isinstance(i, Action) and i.record["kind"] == "llm_call"]
    assert chat and all("result" in record for record in chat)
    assert not any(
        "result" in i.record for i in _read(path) if isinstance(i, Action) and i.record["kind"] == "llm_call"
    )


@pytest.mark.parametrize("seed", range(4))
def test_line_blocks_split_as_lines_does(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        data = bytes(rng.choice(b"ab\n\n\r ") for _ in range(rng.randint(0, 80)))
        data = data.replace(b"a", b"a" * rng.randint(1, 14))
        chunk_size = rng.randint(1, 24)
        max_line = rng.randint(0, 12)

        def shown(raw: bytes | TooLong) -> object:
            return raw if isinstance(raw, bytes) else ("too long", raw.size_at_least)

        expected = [shown(raw) for _, raw in lines(_chunked(data, chunk_size), max_line)]
        blocks = list(line_blocks(_chunked(data, chunk_size), max_line))
        assert [shown(raw) for block, _ in blocks for raw in block] == expected
        for block, has_too_long in blocks:
            assert has_too_long == any(isinstance(raw, TooLong) for raw in block)


def test_batches_count_their_actions_and_hold_the_items_in_order(tmp_path: Path) -> None:
    good = b'{"session_id":"s","action_id":"a%d","kind":"write","status":"ok"}\n'
    body = b"".join(good % n if n % 7 else b"not json\n" for n in range(10_000))
    target = tmp_path / "mixed.jsonl"
    target.write_bytes(body + b'{"session_id":"s"')  # a last line without its end
    batches = list(read_batches(str(target)))
    items = [item for batch in batches for item in batch.items]
    assert golden_lines(items) == golden_lines(read_input(str(target)))
    assert sum(batch.actions for batch in batches) == sum(isinstance(i, Action) for i in items) == 10_000 - 1_429
    assert sum(batch.malformed for batch in batches) == 1_429 + 1
    assert [i.line for i in items] == list(range(1, 10_002))
    assert [i.seq for i in items if isinstance(i, Action)] == list(range(8_571))
    assert max(len(batch.items) for batch in batches) <= 4096


def test_per_message_zstd_frames_as_the_file_exporter_writes_them(tmp_path: Path) -> None:
    """``compression: zstd`` without the native-compression gate: each message is its own zstd frame,
    length-prefixed, around protobuf (``format: proto``) or OTLP/JSON (``format: json``)."""
    stream = (READERS / "spans.pbstream").read_bytes()
    first = stream[4 : 4 + struct.unpack(">I", stream[:4])[0]]
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    as_json = otlp_json_from_request(ExportTraceServiceRequest.FromString(first))
    limit = max(len(first), len(as_json)) + 100
    squeeze = zstandard.ZstdCompressor()
    cut = squeeze.compress(first)[:-3]
    parts = [squeeze.compress(first), squeeze.compress(as_json), cut, squeeze.compress(b"{not json"),
             squeeze.compress(first + b"\n" * limit)]
    target = tmp_path / "traces.zst.out"
    target.write_bytes(b"".join(struct.pack(">I", len(p)) + p for p in parts))
    items = _read(target, max_message_bytes=limit)
    # (The spans themselves include some the converter rejects; these are about the frames.)
    messages = [m.message for m in _malformed(items) if m.message.startswith("message ")]
    assert len(messages) == 3, messages
    assert messages[0] == f"message 3: not valid zstd data ({len(cut)} bytes)"
    assert messages[1].startswith("message 4: not valid JSON")
    assert messages[2] == f"message 5 is longer than {limit} bytes once decompressed; skipped"
    plain = [i for i in _read(READERS / "spans.pbstream") if isinstance(i, Action)]
    per_message = len([i for i in items if isinstance(i, Action)]) // 2
    got = [i.record for i in items if isinstance(i, Action)]
    assert got == [a.record for a in plain[:per_message]] * 2, "protobuf and OTLP/JSON frames read alike"


def test_a_framed_protobuf_message_whose_length_byte_reads_as_a_brace(tmp_path: Path) -> None:
    """0x0a then a length of 123 (b"{"): protobuf all the same, not OTLP/JSON."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id = b"\x01" * 16, b"\x02" * 8
    attribute = span.attributes.add()
    attribute.key, attribute.value.string_value = "durable.action.kind", "tool_call"
    for size in range(1, 200):
        span.name = "n" * size
        data = request.SerializeToString()
        if data[1:2] == b"{":
            break
    assert data[:2] == b"\n{"
    target = tmp_path / "brace.pbstream"
    target.write_bytes(struct.pack(">I", len(data)) + data)
    items = _read(target)
    assert [m.message for m in _malformed(items) if m.message.startswith("message")] == []
    assert len(items) == 1
