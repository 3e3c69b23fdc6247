"""The open-wait gauges, read from the operator view's read model when they are scraped.

Waiting now (the page and ``/api/v1/waiting``), the Pipeline page, ``/api/v1/pipeline`` and
Prometheus all answer "what is stuck" from one source: the read model's open waits
(processor.state.views), counted at the instant they are read. A wait with no deadline is
counted; one past its deadline stays counted (it is still open: nothing resolved it) and
is counted again among the expired; the oldest wait's age includes the expired ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Final

from processor.state.views import WAIT_STATES, ViewStore, WaitSummary
from processor.telemetry import Telemetry

# The gauges' state label: the read model's wait states, and "other" for any state it may add.
STATE_LABELS: Final = (*sorted(WAIT_STATES), "other")
# One scrape reads every child; one summary serves them all.
_SUMMARY_TTL_NS: Final = 200_000_000


class WaitGauges:
    """Binds ``durable_check_open_waits``, ``durable_check_expired_waits`` and
    ``durable_check_oldest_open_wait_age_seconds`` to ``views``."""

    def __init__(self, telemetry: Telemetry, views: ViewStore, clock: Callable[[], int] = time.time_ns) -> None:
        self._views = views
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: tuple[int, WaitSummary] | None = None
        for label in STATE_LABELS:
            telemetry.open_waits.labels(state=label).set_function(self._counter(label, expired=False))
            telemetry.expired_waits.labels(state=label).set_function(self._counter(label, expired=True))
        telemetry.oldest_open_wait_age.set_function(self._oldest_age_s)

    def _counter(self, label: str, *, expired: bool) -> Callable[[], float]:
        return lambda: self._count(label, expired)

    def _summary(self) -> tuple[int, WaitSummary]:
        now = self._clock()
        with self._lock:
            if self._cached is None or now - self._cached[0] > _SUMMARY_TTL_NS or now < self._cached[0]:
                self._cached = (now, self._views.wait_summary(now))
            return self._cached

    def _count(self, label: str, expired: bool) -> float:
        _, summary = self._summary()
        counts = summary.expired_by_state if expired else summary.by_state
        if label != "other":
            return float(counts.get(label, 0))
        return float(sum(n for state, n in counts.items() if state not in WAIT_STATES))

    def _oldest_age_s(self) -> float:
        now, summary = self._summary()
        if summary.oldest_since_ns is None:
            return 0.0
        return max(0.0, (now - summary.oldest_since_ns) / 1e9)
