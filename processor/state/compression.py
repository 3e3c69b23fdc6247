"""The large bodies a durable store writes at every commit, compressed as zstd frames.

Two bodies dominate what serve writes per span: the inbox journal's copy of each request
(its protocol-buffer bytes, written before the request is acknowledged) and the
reordering buffer's segment of the spans a commit buffered (:mod:`processor.state.bufferrows`).
Both are written once and read back only after a restart, and both are repetitive
(attribute keys, session and trace ids, resource attributes in every request). Stored
as zstd frames at level 1 they take several times less disk and write-ahead log, for
about a microsecond of CPU per span to compress; fewer bytes written is also less work
for the database, which is where the CPU comes back (docs/performance.md).

How a reader knows what it has (since schema version 4; version 3 wrote both bodies as they were):

- a journal row says so in its ``kind`` column (``otlp+zstd``, :data:`COMPRESSED_SUFFIX`):
  a request's bytes are the sender's, and a protocol-buffer message can begin with any
  bytes, the zstd magic number included;
- a segment body is a JSON array (``[``) or a zstd frame: JSON never begins with the
  magic number's first byte, ``(``.

Decompression is bounded: by the request's size, which the journal row records, and for
a segment by what its frame declares, at most :data:`MAX_SEGMENT_BYTES`. A body that does
not decompress to what it declares is damaged, and the caller says which row it is.
"""

from __future__ import annotations

import threading
from typing import Final

from backports.zstd import ZstdCompressor, ZstdDecompressor, ZstdError, get_frame_info

# Level 1: on serve's requests, level 3 saved 2% more bytes for 25% more CPU (docs/performance.md).
LEVEL: Final = 1
ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
# Appended to a journal row's kind when its body is a zstd frame of the request.
COMPRESSED_SUFFIX: Final = "+zstd"
# A segment holds what one commit buffered: far below this even at the journal's largest bound.
MAX_SEGMENT_BYTES: Final = 1 << 31


class DamagedBody(ValueError):
    """A stored body is not the zstd frame it should be, or does not decompress to what it declares."""


_local = threading.local()


def compress(body: bytes) -> bytes:
    """``body`` as one zstd frame (its size recorded in the frame's header)."""
    compressor = getattr(_local, "compressor", None)
    if compressor is None:
        # One compressor per thread: creating one costs more than compressing a small request.
        compressor = _local.compressor = ZstdCompressor(level=LEVEL)
    return compressor.compress(body, mode=ZstdCompressor.FLUSH_FRAME)


def decompress(stored: bytes, size: int) -> bytes:
    """The ``size`` bytes that ``stored`` (one zstd frame) holds; DamagedBody if it holds anything else."""
    decompressor = ZstdDecompressor()
    try:
        body = decompressor.decompress(stored, max_length=size)
    except ZstdError as exc:
        raise DamagedBody(f"not a readable zstd frame ({exc})") from None
    if len(body) != size or not decompressor.eof or decompressor.unused_data:
        raise DamagedBody(f"a zstd frame that does not hold the {size} bytes recorded for it")
    return body


def decompress_segment(stored: bytes) -> bytes:
    """A segment body as JSON: a zstd frame decompressed (bounded by its declared size), or JSON as stored."""
    if not stored.startswith(ZSTD_MAGIC):
        return stored  # schema version 3 or earlier: the JSON itself
    try:
        size = get_frame_info(stored).decompressed_size
    except ZstdError as exc:
        raise DamagedBody(f"not a readable zstd frame ({exc})") from None
    if size is None or size > MAX_SEGMENT_BYTES:
        raise DamagedBody("a zstd frame that does not declare a plausible size")
    return decompress(stored, size)
