"""Soak: a real serve subprocess under valid load with hostile requests mixed in (see bench/soak.py).

Bounded to about a minute here; ``python -m bench.soak`` runs it longer and prints the figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import Soak
from processor.records import LABEL_MAX_CHARS

# What each hostile request must be answered; nothing else is acceptable.
EXPECTED_ANSWERS = {
    "gzip bomb": {"413"},
    "zstd bomb": {"413"},
    "over the span limit": {"400"},
    "past the violation caps": {"200", "503"},  # accepted, or asked to retry when busy
    "garbage": {"400"},
    "wrong token": {"401"},
    "no token over gRPC": {"UNAUTHENTICATED"},
    "cut mid-body": {"closed"},
    "slow body": {"closed"},
    "huge service name": {"200", "503"},
    "huge ids": {"200", "503"},
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
