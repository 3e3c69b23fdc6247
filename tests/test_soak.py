"""Soak: a real serve subprocess under valid load with hostile requests mixed in (see bench/soak.py).

Bounded to about a minute here; ``python -m bench.soak`` runs it longer and prints the figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import Soak
from processor.records import LABEL_MAX_CHARS

# What each hostile request must be answered; nothing else is acceptable. A request read after
# authentication may also be told to retry (503) while the large gRPC calls hold the byte budget,
# or find its kept-alive connection closed for a new one while the HTTP receiver is under siege
# (ReadError, RemoteProtocolError: the client reuses connections).
_CLOSED_WHILE_IDLE = {"ReadError", "RemoteProtocolError"}
EXPECTED_ANSWERS = {
    "gzip bomb": {"413", "503"} | _CLOSED_WHILE_IDLE,
    "zstd bomb": {"413", "503"} | _CLOSED_WHILE_IDLE,
    "over the span limit": {"400", "503"} | _CLOSED_WHILE_IDLE,
    "past the violation caps": {"200", "503"} | _CLOSED_WHILE_IDLE,  # accepted, or asked to retry when busy
    "garbage": {"400", "503"} | _CLOSED_WHILE_IDLE,
    "wrong token": {"401"} | _CLOSED_WHILE_IDLE,
    "no token over gRPC": {"UNAUTHENTICATED"},
    "cut mid-body": {"closed"},
    "slow body": {"closed"},
    # serve closes every one of them (past its share of the open files, or at the header timeout).
    "1,100 slow connections (HTTP receiver)": {"closed"},
    "1,100 slow connections (gRPC receiver)": {"closed"},
    "1,100 slow connections (operator view)": {"closed"},
    "1,100 slow connections (metrics)": {"closed"},
    # Refused with RetryInfo while the byte budget is spent, each through once it retried as told.
    "48 concurrent 15 MiB gRPC calls": {"all through"},
    "huge service name": {"200", "503"} | _CLOSED_WHILE_IDLE,
    "huge ids": {"200", "503"} | _CLOSED_WHILE_IDLE,
}
# Half of the Helm chart's default memory limit (1Gi): serve must stay well inside it.
MEMORY_BOUND_KIB = 512 * 1024


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sustained_load_with_hostile_requests_loses_nothing_and_stays_healthy(tmp_path: Path) -> None:
    result = Soak(tmp_path, seconds=45).run()
    summary = result.summary()
    assert result.exit_code == 0, result.log_tail
    assert result.unexpected == [], summary
    assert len(result.acknowledged) > 1000, summary
    assert result.lost == set(), f"{len(result.lost)} acknowledged spans were never evaluated: {summary}"
    assert result.health_probes >= 20 and result.health_failures == [], summary
    seen_kinds = set()
    for outcome, count in result.hostile.items():
        kind, answer = outcome.split(" -> ")
        seen_kinds.add(kind)
        assert answer in EXPECTED_ANSWERS[kind], (outcome, count)
    assert seen_kinds == set(EXPECTED_ANSWERS), summary
    assert 0 < result.peak_rss_kib < MEMORY_BOUND_KIB, summary
    # Label values are bounded: a 64 KiB service.name does not reach /metrics as sent.
    assert 0 < result.longest_label <= LABEL_MAX_CHARS and result.metrics_bytes < 1_000_000, summary
    assert result.tracebacks == 0, result.log_tail
