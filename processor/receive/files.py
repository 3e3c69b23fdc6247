"""Offline readers: a file (or stdin) of action-log lines or OTLP spans, as Actions.

Formats, detected from the first bytes unless named:

- ``actions``: the durable-sessions skill's JSONL action log;
- ``otlp-json-lines``: one ExportTraceServiceRequest/TracesData JSON object per line
  (the Collector's file exporter);
- ``otlp-json``: one such JSON document, possibly pretty-printed;
- ``otlp-proto``: one serialized ExportTraceServiceRequest;
- ``otlp-proto-stream``: messages each preceded by its length as a 4-byte big-endian
  integer: the Collector's file exporter with ``format: proto``, and with
  ``compression: zstd`` in either format, where each message is compressed on its
  own (a zstd frame per message; the payload is then protobuf or OTLP/JSON).

Any of them may be gzip- or zstd-compressed as a whole (detected by magic bytes; the
file exporter writes such a file with its ``exporter.file.nativeCompression`` gate). Reading is
streaming: a bad line or message becomes a Malformed item naming its place and
reading goes on. An input that cannot be read raises InputError: at once when it
cannot be opened or recognised, or after the items read so far when a read fails or
a compressed stream is cut short or corrupt part-way (what came before the break is
checked; the input still counts as unreadable).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Final, cast

import orjson

from processor.convert.actionlog import parse_lines
from processor.errors import InputError
from processor.receive._streams import (
    GZIP_MAGIC,
    ZSTD_MAGIC,
    MessageCut,
    StreamEnded,
    TooLong,
    decompress_whole,
    frames,
    gunzip,
    line_blocks,
    lines,
    peek,
    raw_chunks,
    read_bounded,
    unzstd,
)
from processor.records import STDIN_ORIGIN, Action, Malformed, SessionMark

if TYPE_CHECKING:
    # Loaded by the span readers when they run: an action log needs no protobuf.
    from processor.convert.spans import ConvertResult, SpanConverter

FORMATS: Final = ("actions", "otlp-json-lines", "otlp-json", "otlp-proto", "otlp-proto-stream")
DEFAULT_MAX_LINE_BYTES: Final = 16 << 20
DEFAULT_MAX_MESSAGE_BYTES: Final = 64 << 20
STDIN: Final = "-"

# Enough to see a first line of ordinary size, or that the first line is a long one.
_DETECT_BYTES: Final = 64 << 10
_UTF8_BOM: Final = b"\xef\xbb\xbf"
_WHITESPACE: Final = b" \t\r\n"
_OTLP_KEYS: Final = (b'"resourceSpans"', b'"resource_spans"')
# Every byte a text file may hold; what remains after deleting them marks binary data.
_TEXT_BYTES: Final = bytes([9, 10, 13, *range(0x20, 0x100)])
# A stream's first length prefix above this is not a length but text.
_STREAM_LENGTH_LIMIT: Final = 1 << 30
_TRACE_KEYS: Final = ("resourceSpans", "resource_spans")
_OTHER_SIGNAL_KEYS: Final = ("resourceLogs", "resourceMetrics", "resourceProfiles", "resource_logs", "resource_metrics")

Item = Action | Malformed | SessionMark
# Lines parsed and handed on at a time: big enough that per-batch costs vanish, small
# enough that a batch's records stay a few megabytes.
LINES_PER_BATCH: Final = 4096


@dataclass(slots=True)
class Batch:
    """Consecutive items of one input, and how many of them are actions."""

    items: Sequence[Item]
    actions: int

    @property
    def malformed(self) -> int:
        # Session marks (spans naming a session, no action) are neither.
        return sum(1 for item in self.items if isinstance(item, Malformed))


def read_input(
    path: str,
    input_format: str | None = None,
    converter: SpanConverter | None = None,
    *,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> Iterator[Action | Malformed]:
    """Items of ``path`` (``-`` is stdin) in file order.

    The input is opened and its format detected before this returns, so an
    unreadable input raises InputError here, not half-way through a report.
    """
    batches = read_batches(
        path, input_format, converter, max_line_bytes=max_line_bytes, max_message_bytes=max_message_bytes
    )
    return _each_item(batches)


def _each_item(batches: Generator[Batch, None, None]) -> Iterator[Action | Malformed]:
    try:
        for batch in batches:
            # Session marks link a trace's spans for the engine (read_batches keeps them); an item is a span's outcome.
            for item in batch.items:
                if not isinstance(item, SessionMark):
                    yield item
    finally:
        batches.close()  # closes the file when the reader of items stops early


def read_batches(
    path: str,
    input_format: str | None = None,
    converter: SpanConverter | Callable[[], SpanConverter] | None = None,
    *,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> Generator[Batch, None, None]:
    """The items of ``read_input``, a batch at a time (a block of lines, one OTLP message).

    What replay reads: handing items on in batches saves a generator step per item,
    and each batch says how many of its items are actions. ``converter`` may be a function
    that makes the span converter: it is called only for an input of spans, so that an
    action log does not load protobuf and the converter (about 0.07 CPU-s).
    """
    handle, chunks, chosen, origin = open_input(path, input_format)
    return _batches(
        handle,
        path,
        input_format=chosen,
        chunks=chunks,
        origin=origin,
        converter=converter,
        max_line=max_line_bytes,
        max_message=max_message_bytes,
    )


def _span_converter(given: SpanConverter | Callable[[], SpanConverter] | None) -> SpanConverter:
    if given is None:
        from processor.convert.spans import SpanConverter

        return SpanConverter()
    # A converter is not callable: a callable is the function that makes one.
    return given() if callable(given) else given


def open_input(path: str, input_format: str | None = None) -> tuple[BinaryIO, Iterator[bytes], str, str]:
    """``path`` opened, decompressed and its format detected: (handle, content chunks, format, origin).

    Raises InputError when it cannot be opened or recognised; the caller closes the handle
    (``close_input``) once it has read the chunks.
    """
    if input_format is not None and input_format not in FORMATS:
        raise InputError(f"unknown input format {input_format!r}; use one of {', '.join(FORMATS)}")
    origin = STDIN_ORIGIN if path == STDIN else path
    handle = _open(path, origin)
    try:
        try:
            peeked = peek(raw_chunks(handle), len(ZSTD_MAGIC))
            chunks = peeked.chunks
            if peeked.head.startswith(GZIP_MAGIC):
                chunks = gunzip(chunks)
            elif peeked.head.startswith(ZSTD_MAGIC):
                chunks = unzstd(chunks)
            content = peek(chunks, _DETECT_BYTES)
        except StreamEnded as exc:
            raise InputError(f"{origin}: {exc.reason}") from None
        chosen = input_format or _detect(content.head, origin)
    except BaseException:
        _close(handle, path)
        raise
    return handle, content.chunks, chosen, origin


def close_input(handle: BinaryIO, path: str) -> None:
    _close(handle, path)


def action_line_blocks(
    chunks: Iterator[bytes], origin: str, max_line: int = DEFAULT_MAX_LINE_BYTES
) -> Iterator[tuple[int, Sequence[bytes | TooLong], bool]]:
    """An action log's lines a block at a time: (number of the block's first line, lines, whether
    one is a TooLong). A read that fails part-way raises the InputError ``read_batches`` raises."""
    last = 0
    try:
        for block, has_too_long in line_blocks(chunks, max_line):
            yield last + 1, block, has_too_long
            last += len(block)
    except StreamEnded as exc:
        raise _broken(exc, origin, _after_line(last)) from None


def too_long_line(size: TooLong, max_line: int) -> str:
    """The message of a Malformed line past the line bound."""
    return _too_long("line", size, max_line)


def _open(path: str, origin: str) -> BinaryIO:
    if path == STDIN:
        return sys.stdin.buffer
    try:
        return open(path, "rb")  # closed by the generator that reads it
    except OSError as exc:
        raise InputError(f"{origin}: cannot open ({exc.strerror or type(exc).__name__})") from None


def _close(handle: BinaryIO, path: str) -> None:
    if path != STDIN:
        handle.close()


def _detect(head: bytes, origin: str) -> str:
    text = head[len(_UTF8_BOM) :] if head.startswith(_UTF8_BOM) else head
    stripped = text.lstrip(_WHITESPACE)
    if not stripped or stripped[:1] == b"#":
        return "actions"
    if stripped[:1] == b"{":
        return _detect_json(stripped, complete=len(head) < _DETECT_BYTES)
    binary = _looks_binary(text)
    # A serialized request opens with field 1 (resource_spans), length-delimited: byte 0x0a.
    if binary and text[:1] == b"\n":
        return "otlp-proto"
    if binary and len(text) >= 5 and text[4:5] == b"\n" and int.from_bytes(text[:4], "big") < _STREAM_LENGTH_LIMIT:
        return "otlp-proto-stream"
    # The file exporter's per-message compression: a length, then a zstd frame.
    if binary and text[4:8] == ZSTD_MAGIC and int.from_bytes(text[:4], "big") < _STREAM_LENGTH_LIMIT:
        return "otlp-proto-stream"
    if binary:
        raise InputError(
            f"{origin}: binary data that is not an action log, OTLP JSON or OTLP protobuf (nor gzip or zstd)"
        )
    # Text that is not JSON: read as an action log, so each line gets its own clear message.
    return "actions"


def _detect_json(text: bytes, complete: bool) -> str:
    newline = text.find(b"\n")
    first_line = text if newline < 0 else text[:newline]
    if newline >= 0 or complete:
        try:
            first = orjson.loads(first_line)
        except orjson.JSONDecodeError:
            # A first line that is not a whole JSON value: a pretty-printed document.
            return "otlp-json" if any(key in text for key in _OTLP_KEYS) else "actions"
        if isinstance(first, dict) and any(key in first for key in _TRACE_KEYS):
            return "otlp-json-lines"
        return "actions"
    # One long first line: an OTLP export line if it opens like one (one document on one
    # line reads the same either way).
    return "otlp-json-lines" if any(key in first_line[:4096] for key in _OTLP_KEYS) else "actions"


def _looks_binary(data: bytes) -> bool:
    """Control bytes (other than tab, newline, carriage return) or invalid UTF-8: not text."""
    return bool(data.translate(None, _TEXT_BYTES)) or not _is_utf8(data)


def _is_utf8(data: bytes) -> bool:
    # The head may end inside a multi-byte character; forgive up to three trailing bytes.
    for cut in range(4):
        try:
            data[: len(data) - cut].decode("utf-8")
            return True
        except UnicodeDecodeError:
            continue
    return False


def _batches(
    handle: BinaryIO,
    path: str,
    *,
    input_format: str,
    chunks: Iterator[bytes],
    origin: str,
    converter: SpanConverter | Callable[[], SpanConverter] | None,
    max_line: int,
    max_message: int,
) -> Generator[Batch, None, None]:
    try:
        if input_format == "actions":
            yield from _read_actions(chunks, origin, max_line)
            return
        spans = _span_converter(converter)
        if input_format == "otlp-proto-stream":
            yield from _read_proto_stream(chunks, origin, spans, max_message)
        elif input_format == "otlp-json-lines":
            yield from _in_batches(_read_json_lines(chunks, origin, spans, max_line))
        elif input_format == "otlp-json":
            yield from _in_batches(_read_json_document(chunks, origin, spans, max_message))
        else:
            yield from _in_batches(_read_proto(chunks, origin, spans, max_message))
    finally:
        _close(handle, path)


def _in_batches(items: Iterator[Item]) -> Iterator[Batch]:
    batch: list[Item] = []
    actions = 0
    for item in items:
        batch.append(item)
        actions += isinstance(item, Action)
        if len(batch) >= LINES_PER_BATCH:
            yield Batch(batch, actions)
            batch, actions = [], 0
    if batch:
        yield Batch(batch, actions)


def _broken(exc: StreamEnded, origin: str, where: str) -> InputError:
    """The input stopped being readable part-way; ``where`` names the last good place."""
    return InputError(f"{origin}: {exc.reason} {where}; the input could not be read to its end")


def _after_line(last_line: int) -> str:
    return f"after line {last_line}" if last_line else "before its first line"


def _too_long(what: str, size: TooLong, limit: int) -> str:
    return f"{what} is longer than {limit} bytes (at least {size.size_at_least}); skipped"


def _read_actions(chunks: Iterator[bytes], origin: str, max_line: int) -> Iterator[Batch]:
    seq = 0
    last = 0  # number of the last line read
    try:
        for block, has_too_long in line_blocks(chunks, max_line):
            for start in range(0, len(block), LINES_PER_BATCH):
                part = block[start : start + LINES_PER_BATCH]
                items: list[Action | Malformed] = []
                before = seq
                if not has_too_long:
                    seq = parse_lines(cast(Sequence[bytes], part), origin, last + 1, seq, items)
                    last += len(part)
                else:
                    for raw in part:
                        last += 1
                        if isinstance(raw, TooLong):
                            items.append(Malformed(_too_long("line", raw, max_line), origin=origin, line=last))
                        else:
                            seq = parse_lines((raw,), origin, last, seq, items)
                if items:
                    yield Batch(items, seq - before)
    except StreamEnded as exc:
        raise _broken(exc, origin, _after_line(last)) from None


def _converted(converter: SpanConverter, traces: Any, origin: str, seq: int, line: int | None) -> Iterator[Item]:
    for item in converter.convert(traces, origin, seq).items:
        if not isinstance(item, SessionMark):
            item.line = line
        yield item


def _decoded(converter: SpanConverter, document: Any, origin: str, seq: int, line: int | None) -> Iterator[Item]:
    """Spans of one OTLP/JSON object, after one Malformed per part that did not decode."""
    from processor.convert.otlp_json import OtlpJsonError, decode_traces

    if isinstance(document, dict) and not any(key in document for key in _TRACE_KEYS):
        # The Collector may write other signals to the same file: those are not ours to judge.
        if not any(key in document for key in _OTHER_SIGNAL_KEYS):
            yield Malformed("not an OTLP trace export: no resourceSpans", origin=origin, line=line, source="span")
        return
    try:
        traces, problems = decode_traces(document, keep=converter.reads_attribute)
    except OtlpJsonError as exc:
        yield Malformed(f"not an OTLP trace export: {exc}", origin=origin, line=line, source="span")
        return
    for problem in problems:
        yield Malformed(problem, origin=origin, line=line, source="span")
    yield from _converted(converter, traces, origin, seq, line)


def _json_error(exc: orjson.JSONDecodeError) -> str:
    if "UTF-8" in exc.msg:
        return "not valid UTF-8"
    return f"not valid JSON ({exc.msg}) at line {exc.lineno} column {exc.colno}"


def _read_json_lines(chunks: Iterator[bytes], origin: str, converter: SpanConverter, max_line: int) -> Iterator[Item]:
    seq = 0
    last = 0
    try:
        for number, raw in lines(chunks, max_line):
            last = number
            if isinstance(raw, TooLong):
                yield Malformed(_too_long("line", raw, max_line), origin=origin, line=number, source="span")
                continue
            if not raw.strip():
                continue
            try:
                document = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                message = _json_error(exc).replace(" at line 1 column", " at column")
                yield Malformed(message, origin=origin, line=number, source="span")
                continue
            for item in _decoded(converter, document, origin, seq, number):
                seq += isinstance(item, Action)
                yield item
    except StreamEnded as exc:
        raise _broken(exc, origin, _after_line(last)) from None


def _read_whole(chunks: Iterator[bytes], origin: str, max_message: int, what: str) -> bytes | Malformed:
    try:
        data = read_bounded(chunks, max_message)
    except StreamEnded as exc:
        raise _broken(exc, origin, f"inside the {what}") from None
    if isinstance(data, TooLong):
        return Malformed(_too_long(f"the {what}", data, max_message), origin=origin, source="span")
    return data


def _read_json_document(
    chunks: Iterator[bytes], origin: str, converter: SpanConverter, max_message: int
) -> Iterator[Item]:
    data = _read_whole(chunks, origin, max_message, "document")
    if isinstance(data, Malformed):
        yield data
        return
    if not data.strip():
        return
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        yield Malformed(_json_error(exc), origin=origin, line=exc.lineno, source="span")
        return
    yield from _decoded(converter, document, origin, 0, None)


def _convert_message(
    converter: SpanConverter, data: bytes, index: int, origin: str, seq: int
) -> ConvertResult | Malformed:
    from google.protobuf.message import DecodeError

    try:
        result = converter.convert_serialized(data, origin, seq)
    except DecodeError:
        return Malformed(
            f"message {index}: not a valid OTLP protobuf trace export ({len(data)} bytes)",
            origin=origin,
            source="span",
            extra={"message_index": index},
        )
    if data and not result.resource_spans:
        # Bytes that happen to parse as unknown fields: nothing of OTLP in them.
        return Malformed(
            f"message {index}: {len(data)} bytes hold no OTLP resource spans",
            origin=origin,
            source="span",
            extra={"message_index": index},
        )
    return result


def _read_proto(chunks: Iterator[bytes], origin: str, converter: SpanConverter, max_message: int) -> Iterator[Item]:
    data = _read_whole(chunks, origin, max_message, "message")
    if isinstance(data, Malformed):
        yield data
        return
    if not data:
        return
    result = _convert_message(converter, data, 1, origin, 0)
    if isinstance(result, Malformed):
        yield result
        return
    yield from result.items


def _stream_message(
    converter: SpanConverter, data: bytes, index: int, origin: str, seq: int, *, max_message: int
) -> ConvertResult | Malformed:
    """One framed message: protobuf, or (with the exporter's compression) zstd around protobuf or OTLP/JSON."""
    from processor.convert.spans import ConvertResult

    if data.startswith(ZSTD_MAGIC):
        try:
            plain = decompress_whole(data, "zstd", max_message)
        except StreamEnded:
            return Malformed(f"message {index}: not valid zstd data ({len(data)} bytes)", origin=origin,
                             source="span", extra={"message_index": index})
        if isinstance(plain, TooLong):
            return Malformed(f"message {index} is longer than {max_message} bytes once decompressed; skipped",
                             origin=origin, source="span", extra={"message_index": index})
        data = plain
    # JSON opens with "{" at once (the exporter writes no leading space); a protobuf request
    # never does (0x7b would be field 15 as a group), while it may open with whitespace bytes.
    if data[:1] != b"{":
        return _convert_message(converter, data, index, origin, seq)
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        return Malformed(f"message {index}: {_json_error(exc)}", origin=origin, source="span",
                         extra={"message_index": index})

    items = list(_decoded(converter, document, origin, seq, None))
    actions = [i for i in items if isinstance(i, Action)]
    return ConvertResult(actions=actions, rejected=[i for i in items if isinstance(i, Malformed)], items=items)


def _read_proto_stream(
    chunks: Iterator[bytes], origin: str, converter: SpanConverter, max_message: int
) -> Iterator[Batch]:
    seq = 0
    done = 0  # messages read whole
    try:
        for frame in frames(chunks, max_message):
            done = frame.index
            if isinstance(frame.data, TooLong):
                too_long = Malformed(
                    f"message {frame.index} is longer than {max_message} bytes ({frame.data.size_at_least}); skipped",
                    origin=origin,
                    source="span",
                    extra={"message_index": frame.index},
                )
                yield Batch([too_long], 0)
                continue
            result = _stream_message(converter, frame.data, frame.index, origin, seq, max_message=max_message)
            if isinstance(result, Malformed):
                yield Batch([result], 0)
                continue
            # Items of a protobuf message have no line: their line stays None.
            seq += len(result.actions)
            if result.items:
                yield Batch(result.items, len(result.actions))
    except MessageCut as exc:
        yield Batch([Malformed(exc.reason, origin=origin, source="span")], 0)
    except StreamEnded as exc:
        raise _broken(exc, origin, f"after message {done}" if done else "before its first message") from None


__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "FORMATS",
    "STDIN",
    "Batch",
    "read_batches",
    "read_input",
]
