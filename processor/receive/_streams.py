"""Byte streams for the offline readers: chunked reading, gzip/zstd, lines, frames.

Everything here is a generator over bounded chunks, so memory stays flat however
large the input is. A read that fails or a compressed stream that ends early or
turns corrupt raises :class:`StreamEnded` at the point where it happened: the input
cannot be read past it, and the readers say so after the items read before it.
A length-prefixed stream whose last message is cut short raises :class:`MessageCut`:
the bytes were all read, the last message is incomplete (one malformed item).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO, Final

from backports.zstd import ZstdDecompressor, ZstdError

CHUNK_SIZE: Final = 1 << 20
GZIP_MAGIC: Final = b"\x1f\x8b"
ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"


class StreamEnded(Exception):
    """The input stopped being readable part-way: ``truncated`` or a decode/read error."""

    def __init__(self, reason: str, truncated: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.truncated = truncated


class MessageCut(StreamEnded):
    """A length-prefixed stream ends inside a length or a message: its last message is incomplete."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, truncated=True)


def raw_chunks(handle: BinaryIO) -> Iterator[bytes]:
    while True:
        try:
            chunk = handle.read(CHUNK_SIZE)
        except OSError as exc:
            raise StreamEnded(f"read failed ({exc.strerror or type(exc).__name__})", truncated=False) from None
        if not chunk:
            return
        yield chunk


def gunzip(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Every gzip member in turn (``cat a.gz b.gz`` is a valid gzip stream)."""
    decoder = zlib.decompressobj(wbits=31)
    pending_member = False
    members = 0  # members read to their end
    for chunk in chunks:
        data = chunk
        pending_member = pending_member or bool(data)
        while True:
            try:
                # Bounded output: a small compressed chunk may expand enormously.
                out = decoder.decompress(data, CHUNK_SIZE)
            except zlib.error:
                reason = "data after the last gzip member is not gzip" if members else "not valid gzip data"
                raise StreamEnded(reason, truncated=False) from None
            if out:
                yield out
            if decoder.eof:
                members += 1
                data = decoder.unused_data
                decoder = zlib.decompressobj(wbits=31)
                pending_member = bool(data)
                if not data:
                    break
                continue
            data = decoder.unconsumed_tail
            # A full output buffer may hide more output even when all input was taken.
            if not data and len(out) < CHUNK_SIZE:
                break
    if pending_member:
        # A member whose end marker never came: the file was cut short.
        raise StreamEnded("gzip stream truncated", truncated=True)


def unzstd(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Every zstd frame in turn, at most CHUNK_SIZE bytes per step.

    A zstd block can expand a few input bytes into 128 KiB, so a bound on the input
    fed is no bound on the output: the decoder is asked for bounded output instead.
    """
    decoder = ZstdDecompressor()
    pending_frame = False  # input has been fed to a frame that has not ended yet
    frames_done = 0
    for chunk in chunks:
        data = chunk
        while True:
            pending_frame = pending_frame or bool(data)
            try:
                out = decoder.decompress(data, CHUNK_SIZE)
            except ZstdError:
                reason = "data after the last zstd frame is not zstd" if frames_done else "not valid zstd data"
                raise StreamEnded(reason, truncated=False) from None
            data = b""
            if out:
                yield out
            if decoder.eof:
                frames_done += 1
                data = decoder.unused_data
                decoder = ZstdDecompressor()
                pending_frame = bool(data)
                if not data:
                    break
                continue
            if decoder.needs_input:
                break
    if pending_frame:
        raise StreamEnded("zstd stream truncated", truncated=True)


def decompressed(chunks: Iterator[bytes], encoding: str) -> Iterator[bytes]:
    """The decoded stream for a ``gzip`` or ``zstd`` encoding (anything else passes as is)."""
    if encoding == "gzip":
        return gunzip(chunks)
    if encoding == "zstd":
        return unzstd(chunks)
    return chunks


def decompress_whole(body: bytes, encoding: str, limit: int) -> bytes | TooLong:
    """Every member or frame of one compressed body, or TooLong as soon as it passes ``limit``.

    Unlike :func:`read_bounded` the rest is not decoded at all: a bomb costs at most
    ``limit`` bytes of work. Raises StreamEnded for a corrupt or truncated body.
    """
    out = bytearray()
    for piece in decompressed(iter((body,)) if body else iter(()), encoding):
        out += piece
        if len(out) > limit:
            return TooLong(len(out))
    return bytes(out)


@dataclass(slots=True)
class Peeked:
    """The first bytes of a stream, and the whole stream (those bytes included)."""

    head: bytes
    chunks: Iterator[bytes]


def peek(chunks: Iterator[bytes], size: int) -> Peeked:
    """Read at least ``size`` bytes (fewer at the end) without losing them.

    A StreamEnded raised while peeking is kept and raised again after the head is
    replayed, so the reader reports it in its place. Corruption before the first
    byte is raised at once: the input cannot be read at all.
    """
    head = bytearray()
    ended: StreamEnded | None = None
    try:
        for chunk in chunks:
            head += chunk
            if len(head) >= size:
                break
    except StreamEnded as exc:
        if not head and not exc.truncated:
            raise
        ended = exc
    first = bytes(head)

    def replay() -> Iterator[bytes]:
        if first:
            yield first
        if ended is not None:
            raise ended
        yield from chunks

    return Peeked(first, replay())


@dataclass(slots=True)
class TooLong:
    """A line over the bound: skipped without being held in memory."""

    size_at_least: int


def lines(chunks: Iterator[bytes], max_line: int) -> Iterator[tuple[int, bytes | TooLong]]:
    """(physical line number, line without its newline); a final unterminated line counts.

    Raises StreamEnded after the last complete line when the input stops early;
    ``StreamEnded.args`` is left as is, the caller knows the last line number it saw.
    """
    number = 0
    buffer = bytearray()
    skipping = 0  # bytes of an over-long line discarded so far; 0 when not skipping
    for chunk in chunks:
        start = 0
        while True:
            newline = chunk.find(b"\n", start)
            if newline < 0:
                break
            number += 1
            if skipping:
                yield number, TooLong(skipping + newline - start)
                skipping = 0
            elif len(buffer) + newline - start > max_line:
                yield number, TooLong(len(buffer) + newline - start)
                buffer.clear()
            elif buffer:
                buffer += chunk[start:newline]
                yield number, bytes(buffer)
                buffer.clear()
            else:
                yield number, chunk[start:newline]
            start = newline + 1
        rest = len(chunk) - start
        if skipping:
            skipping += rest
        elif len(buffer) + rest > max_line:
            skipping = len(buffer) + rest
            buffer.clear()
        elif rest:
            buffer += chunk[start:]
    if skipping:
        yield number + 1, TooLong(skipping)
    elif buffer:
        yield number + 1, bytes(buffer)


def line_blocks(chunks: Iterator[bytes], max_line: int) -> Iterator[tuple[Sequence[bytes | TooLong], bool]]:
    """The lines of ``lines``, numbered the same way (consecutively from 1), a block at a time.

    Each block comes with whether it holds a TooLong (else every line is bytes).

    A block is the complete lines of one chunk: splitting a whole chunk at once costs
    a fraction of finding each newline in turn, which is what an action log's
    millions of short lines need. An over-long line is a TooLong in its place, never
    held in memory beyond the chunk it was read in.
    """
    pending = bytearray()  # the start of a line that has not ended yet (at most max_line bytes)
    skipping = 0  # bytes of an over-long line discarded so far; 0 when not skipping
    for chunk in chunks:
        last = chunk.rfind(b"\n")
        if last < 0:
            if skipping:
                skipping += len(chunk)
            elif len(pending) + len(chunk) > max_line:
                skipping = len(pending) + len(chunk)
                pending.clear()
            else:
                pending += chunk
            continue
        parts = chunk[:last].split(b"\n")
        # The first line began in an earlier chunk when something is pending or skipped.
        first: bytes | TooLong = parts[0]
        carried = bool(skipping or pending)
        if skipping:
            first = TooLong(skipping + len(parts[0]))
            skipping = 0
        elif pending:
            length = len(pending) + len(parts[0])
            first = TooLong(length) if length > max_line else bytes(pending) + parts[0]
            pending.clear()
        rest = len(chunk) - last - 1
        if rest > max_line:
            skipping = rest
        elif rest:
            pending += chunk[last + 1 :]
        if isinstance(first, bytes) and max(map(len, parts)) <= max_line:
            parts[0] = first
            yield parts, False
            continue
        block: list[bytes | TooLong] = [TooLong(len(line)) if len(line) > max_line else line for line in parts]
        if carried:
            block[0] = first
        yield block, True
    if skipping:
        yield [TooLong(skipping)], True
    elif pending:
        yield [bytes(pending)], False


@dataclass(slots=True)
class Frame:
    index: int  # 1-based message number
    data: bytes | TooLong


def frames(chunks: Iterator[bytes], max_message: int) -> Iterator[Frame]:
    """Messages each preceded by a 4-byte big-endian length (the Collector file exporter).

    Raises MessageCut when the input ends inside a length or a message.
    """
    buffer = bytearray()
    index = 0
    need: int | None = None  # length of the message being read; None while reading a length
    skip = 0  # bytes of an oversized message still to discard
    for chunk in chunks:
        buffer += chunk
        while True:
            if skip:
                dropped = min(skip, len(buffer))
                del buffer[:dropped]
                skip -= dropped
                if skip:
                    break
                continue
            if need is None:
                if len(buffer) < 4:
                    break
                need = int.from_bytes(buffer[:4], "big")
                del buffer[:4]
                index += 1
                if need > max_message:
                    yield Frame(index, TooLong(need))
                    skip, need = need, None
                    continue
            if len(buffer) < need:
                break
            yield Frame(index, bytes(buffer[:need]))
            del buffer[:need]
            need = None
    if skip or need is not None or buffer:
        raise MessageCut(f"input truncated in message {index + (0 if need is not None or skip else 1)}")


def read_bounded(chunks: Iterator[bytes], limit: int) -> bytes | TooLong:
    """The whole stream, or TooLong once it passes ``limit`` (the rest is drained, not kept)."""
    data = bytearray()
    for chunk in chunks:
        data += chunk
        if len(data) > limit:
            size = len(data)
            data.clear()
            for more in chunks:
                size += len(more)
            return TooLong(size)
    return bytes(data)
