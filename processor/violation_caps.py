"""Caps on how many violations one request or one session can raise in serve.

One request of minimal spans can trip a rule on every span: 262,000 violations
from 16 MiB, each written, alerted and stored. Past a cap the violations are not
reported one by one; instead the cap raises ONE summary violation, rule DS113,
saying how many were held back and where, and the rest are counted in
``durable_check_violations_capped_total``. The summary itself is never capped.

- Per session: the first ``per_session`` violations of a session are reported; the
  next one is replaced by the session's summary; later ones are only counted. The
  counts live in memory, for at most ``max_sessions`` sessions (the least recently
  seen is forgotten first), and start again after a restart. A session the engine no
  longer holds (expired, evicted) has its count forgotten at the next :meth:`retain`
  (serve calls it every 60 ticks: a minute at the default ``tick_interval``); a session
  id seen again after that is a new session to the engine, and to the cap. Without it,
  serve with sessions coming and going kept a count for each of the last
  ``max_sessions`` sessions it had ever seen (about 20 MiB at 100,000, filled over the
  first half hour of its soak).
- Per request: of what one request (or one clock tick) raised, at most
  ``per_request`` are reported, then one summary for the request.

Summary ids are derived from what they summarise, so a request evaluated again
after a crash gives the same summary, which the exporters deliver once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from processor.violations import Violation, make_violation_id

if TYPE_CHECKING:
    from processor.telemetry import Telemetry

CAP_RULE: Final = "DS113"
CAP_NAME: Final = "violations-capped"


@dataclass(frozen=True, slots=True)
class CapLimits:
    per_request: int
    per_session: int
    max_sessions: int


class ViolationCaps:
    def __init__(self, limits: CapLimits, telemetry: Telemetry | None = None) -> None:
        self.limits = limits
        self._telemetry = telemetry
        self._counts: OrderedDict[str, int] = OrderedDict()

    def apply(self, violations: list[Violation]) -> list[Violation]:
        """What to report of one request's (or tick's) violations, summaries included.

        Only violations the request cap lets through count towards their session's cap.
        """
        if not violations:
            return violations
        kept: list[Violation] = []
        held: list[Violation] = []  # past the request cap
        reported = 0
        for violation in violations:
            if violation.rule == CAP_RULE:
                kept.append(violation)
            elif reported >= self.limits.per_request:
                held.append(violation)
            else:
                seen = self._count(violation.session_id)
                if seen <= self.limits.per_session:
                    kept.append(violation)
                    reported += 1
                elif seen == self.limits.per_session + 1:
                    kept.append(self._session_summary(violation))
                else:
                    self._counted("session", 1)
        if held:
            kept.append(self._request_summary(held, reported))
        return kept

    def _count(self, session_id: str) -> int:
        seen = self._counts.pop(session_id, 0) + 1
        self._counts[session_id] = seen
        if len(self._counts) > self.limits.max_sessions:
            self._counts.popitem(last=False)
        return seen

    def retain(self, holds: Callable[[str], bool]) -> int:
        """Forget the counts of sessions ``holds`` says are gone; how many were forgotten."""
        gone = [session_id for session_id in self._counts if not holds(session_id)]
        for session_id in gone:
            del self._counts[session_id]
        return len(gone)

    def __len__(self) -> int:
        """Sessions whose count is kept."""
        return len(self._counts)

    def _request_summary(self, held: list[Violation], reported: int) -> Violation:
        self._counted("request", len(held))
        limit = self.limits.per_request
        first = held[0]
        sessions = len({v.session_id for v in held})
        return self._summary(
            first,
            identity=f"cap:request:{first.violation_id}",
            message=(f"this request raised more than {limit} violations; {reported} are reported and "
                     f"{len(held)} more (in {sessions} sessions) are only counted "
                     f"(evaluate.max_violations_per_request)"),
            details={"cap": "request", "limit": limit, "held_back": len(held), "sessions": sessions},
        )

    def _session_summary(self, first_held: Violation) -> Violation:
        self._counted("session", 1)
        limit = self.limits.per_session
        return self._summary(
            first_held,
            identity="cap:session",
            message=(f"session raised more than {limit} violations; later ones are only counted "
                     f"(evaluate.max_violations_per_session)"),
            details={"cap": "session", "limit": limit},
        )

    def _counted(self, scope: str, count: int) -> None:
        if self._telemetry is not None:
            self._telemetry.violations_capped.labels(scope).inc(count)

    @staticmethod
    def _summary(first: Violation, identity: str, message: str, details: dict[str, object]) -> Violation:
        return Violation(
            rule=CAP_RULE,
            name=CAP_NAME,
            severity="warning",
            session_id=first.session_id,
            action_id=first.action_id,
            message=message,
            violation_id=make_violation_id(CAP_RULE, first.session_id, "", identity),
            time_ns=first.time_ns,
            origin=first.origin,
            trace_id=first.trace_id,
            span_id=first.span_id,
            service=first.service,
            details={**details, "first_held_back": first.violation_id, "first_held_back_rule": first.rule},
        )
