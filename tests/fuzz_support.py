"""Fuzzing with hypothesis: a kept corpus per target, mutated byte by byte.

Each target has a directory under ``tests/fuzz/corpus/``: small valid (and some
invalid) inputs. A fuzz test replays every corpus file as it is, then draws inputs
that are corpus files after a few random mutations (bit flips, insertions,
deletions, truncation, splices of two files, repeats, boundary bytes), or plain
random bytes. An input that ever found a bug is added to the corpus, so it is
replayed on every run.

The number of inputs per target is bounded (``FUZZ_EXAMPLES``, default 150) so the
whole fuzz job stays around a minute on two cores; set it higher for a longer hunt.
Nothing is stored between runs (no example database), so a failure is reported with
the input that caused it, ready to be kept in the corpus.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

CORPUS = Path(__file__).parent / "fuzz" / "corpus"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))

# Slow inputs are what fuzzing looks for, so no per-input deadline: the test's
# timeout marker is the bound on time, and memory is checked around each target.
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Bytes that sit on boundaries of the formats: lengths, varints, UTF-8, JSON and YAML syntax.
_INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\xc3", b"\xed\xa0\x80", b"{", b"}", b"[", b'"', b"\\", b"\n",
                b":", b"-", b"&a", b"*a", b"!!", b"${env:X}", b"\xff\xff\xff\x7f", b"\x00\x00\x00\x00"]


def corpus(target: str) -> list[Path]:
    files = sorted(p for p in (CORPUS / target).iterdir() if p.is_file())
    assert files, f"no corpus for {target}"
    return files


def seeds(target: str) -> list[bytes]:
    return [p.read_bytes() for p in corpus(target)]


@st.composite
def mutated(draw: Any, originals: list[bytes]) -> bytes:
    """A corpus input after zero to five random mutations."""
    data = bytearray(draw(st.sampled_from(originals)))
    for _ in range(draw(st.integers(0, 5))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "splice", "repeat", "interesting"]))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            at = min(at, len(data) - 1)
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif op == "truncate":
            del data[at:]
        elif op == "splice":
            other = draw(st.sampled_from(originals))
            start = draw(st.integers(0, len(other)))
            data[at:] = other[start:]
        elif op == "repeat":
            piece = bytes(data[at : at + draw(st.integers(1, 32))])
            data[at:at] = piece * draw(st.integers(1, 64))
        else:
            data[at:at] = draw(st.sampled_from(_INTERESTING))
    return bytes(data)


def inputs(target: str) -> st.SearchStrategy[bytes]:
    originals = seeds(target)
    return st.one_of(mutated(originals), st.binary(max_size=256))


def text_of(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextmanager
def bounded_memory(limit_bytes: int = 512 << 20) -> Iterator[None]:
    """Fail when the process's peak memory grew by more than ``limit_bytes`` inside the block."""
    before = _peak_rss_bytes()
    yield
    grown = _peak_rss_bytes() - before
    assert grown <= limit_bytes, f"peak memory grew by {grown >> 20} MiB while fuzzing"


def only_raises(fn: Callable[[], Any], *allowed: type[BaseException]) -> Any:
    """``fn()``, where an exception of an ``allowed`` type is an answer too (returned, not raised)."""
    try:
        return fn()
    except allowed as exc:
        return exc
