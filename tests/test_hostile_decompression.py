"""Compressed input decoded whole and in bounded steps: several gzip members or zstd frames, bombs, cut bodies."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import zstandard

from processor.receive._streams import CHUNK_SIZE, StreamEnded, decompress_whole, gunzip, unzstd
from tests.serve_support import keys_of, make_request, read_jsonl, running, serve_config

PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _payment(session: str, action: str) -> dict[str, Any]:
    return {"durable.session.id": session, "durable.action.id": action, "durable.action.kind": "payment"}


def _zstd_frames(*parts: bytes) -> bytes:
    return b"".join(zstandard.ZstdCompressor().compress(part) for part in parts)


def test_http_decodes_every_gzip_member_and_zstd_frame_and_refuses_cut_bodies(tmp_path: Path) -> None:
    # Concatenated protobuf messages merge into one request: each member holds one span.
    first = [make_request(_payment("s-gz", f"gz-{i}")).SerializeToString() for i in range(3)]
    second = [make_request(_payment("s-zst", f"zst-{i}")).SerializeToString() for i in range(3)]
    several_members = b"".join(gzip.compress(part) for part in first)
    several_frames = _zstd_frames(*second)
    cut_zstd = several_frames[:-7]
    cut_gzip = several_members[:-5]
    corrupt_zstd = several_frames[:6] + b"\x00" * 12 + several_frames[18:]
    with running(serve_config(tmp_path)) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/traces"
        with httpx.Client() as client:
            ok_gzip = client.post(url, content=several_members, headers={**PROTOBUF, "Content-Encoding": "gzip"})
            ok_zstd = client.post(url, content=several_frames, headers={**PROTOBUF, "Content-Encoding": "zstd"})
            refused = {
                name: client.post(url, content=body, headers={**PROTOBUF, "Content-Encoding": encoding})
                for name, body, encoding in (
                    ("cut zstd", cut_zstd, "zstd"), ("cut gzip", cut_gzip, "gzip"),
                    ("corrupt zstd", corrupt_zstd, "zstd"),
                )
            }
    assert ok_gzip.status_code == 200, ok_gzip.text
    assert ok_zstd.status_code == 200, ok_zstd.text
    for name, response in refused.items():
        assert response.status_code == 400, (name, response.status_code, response.text)
    found = {key for key in keys_of(read_jsonl(tmp_path / "violations.jsonl")) if key[0] == "DS002"}
    assert {key for key in found if key[1] == "s-gz"} == {("DS002", "s-gz", f"gz-{i}") for i in range(3)}
    assert {key for key in found if key[1] == "s-zst"} == {("DS002", "s-zst", f"zst-{i}") for i in range(3)}


def test_every_decompression_step_is_bounded() -> None:
    """A few KiB of zstd or gzip that expand to 64 MiB come out in steps of at most CHUNK_SIZE."""
    zeros = b"\x00" * (64 << 20)
    for decode, packed in ((unzstd, zstandard.ZstdCompressor(level=19).compress(zeros)),
                           (gunzip, gzip.compress(zeros, compresslevel=9))):
        sizes = [len(piece) for piece in decode(iter([packed[i:i + 4096] for i in range(0, len(packed), 4096)]))]
        assert sum(sizes) == len(zeros)
        assert max(sizes) <= CHUNK_SIZE, (decode.__name__, max(sizes))


def test_one_body_helper_stops_at_the_limit_and_says_why_it_failed() -> None:
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * (256 << 20))
    too_long = decompress_whole(bomb, "zstd", 1 << 20)
    assert not isinstance(too_long, bytes)
    assert too_long.size_at_least <= (1 << 20) + CHUNK_SIZE
    assert decompress_whole(_zstd_frames(b"ab", b"cd"), "zstd", 10) == b"abcd"
    assert decompress_whole(gzip.compress(b"ab") + gzip.compress(b"cd"), "gzip", 10) == b"abcd"
    for body, encoding, reason in ((_zstd_frames(b"abc" * 100)[:-3], "zstd", "truncated"),
                                   (gzip.compress(b"abc" * 100)[:-3], "gzip", "truncated"),
                                   (b"\x28\xb5\x2f\xfd garbage", "zstd", "not valid zstd"),
                                   (gzip.compress(b"ab") + b"trailing", "gzip", "after the last gzip member")):
        try:
            decompress_whole(body, encoding, 1 << 20)
        except StreamEnded as exc:
            assert reason in exc.reason, (encoding, exc.reason)
        else:
            raise AssertionError(f"{encoding} body {body[:8]!r} decoded")


_PEAK_PROBE = """
import sys
from processor.receive.files import read_input
items = list(read_input(sys.argv[1]))
hwm = next(line for line in open('/proc/self/status') if line.startswith('VmHWM'))
print(len(items), int(hwm.split()[1]))
"""


def test_replay_of_a_small_zst_file_keeps_memory_flat(tmp_path: Path) -> None:
    """A ~20 KB .zst action log that expands to 512 MiB (one huge line, then a real one) is read in bounded memory."""
    line = orjson.dumps({"session_id": "s-1", "action_id": "a-1", "kind": "read", "tool": "lookup"}) + b"\n"
    compressor = zstandard.ZstdCompressor(level=19).compressobj()
    packed = bytearray()
    block = b" " * (16 << 20)
    for _ in range(32):
        packed += compressor.compress(block)
    packed += compressor.compress(b"\n" + line)
    packed += compressor.flush()
    path = tmp_path / "actions.jsonl.zst"
    path.write_bytes(bytes(packed))
    assert path.stat().st_size < 200_000
    done = subprocess.run([sys.executable, "-c", _PEAK_PROBE, str(path)], capture_output=True, text=True,
                          timeout=120, check=True)
    count, peak_kib = map(int, done.stdout.split())
    assert count == 2  # the over-long line (a malformed item) and the action
    assert peak_kib < 250 * 1024, f"peak RSS {peak_kib} KiB"
