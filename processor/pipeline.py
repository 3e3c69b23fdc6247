"""The one pipeline both replay and serve drive: convert -> evaluate -> export.

Readers and receivers hand it converted items (``Action`` or ``Malformed``); the
engine turns them into violations; every exporter gets each batch. Exporters never
raise into the pipeline and never block it (each owns a bounded retry queue).

Serve's evaluator worker (processor.worker) calls :meth:`Pipeline.evaluate`, which does
not export: on a durable store it records violations in its outbox before any exporter
sees them, and builds the engine again with ``engine_factory`` after a failed commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from processor.records import Action, Malformed, SessionMark
from processor.violations import WAIVED, Violation

if TYPE_CHECKING:
    from exporters.base import Exporter
    from processor.evaluate.engine import Engine
    from processor.state.base import StateStore
    from processor.state.views import ViewStore
    from processor.telemetry import Telemetry
    from processor.violation_caps import ViolationCaps
    from processor.waivers import Exemptions


class Pipeline:
    def __init__(
        self,
        engine: Engine,
        exporters: Sequence[Exporter] = (),
        telemetry: Telemetry | None = None,
        engine_factory: Callable[[StateStore], Engine] | None = None,
        caps: ViolationCaps | None = None,
    ) -> None:
        self._engine = engine
        # Serve's caps on violations per request and per session; replay reports everything.
        self.caps = caps
        # The findings an operator's waivers or baseline accept: marked waived, counted apart.
        self.exemptions: Exemptions | None = None
        self.exporters = list(exporters)
        self.telemetry = telemetry
        # Builds the engine again, with the same rules and options, on a store (it loads the state).
        self.engine_factory = engine_factory
        self._actions_exporters = [e for e in self.exporters if getattr(e, "wants_actions", False)]
        # The operator view's read model (processor.state.views), fed with every batch when set.
        self._views: ViewStore | None = None
        self._keep_admitted()

    @property
    def engine(self) -> Engine:
        return self._engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        self._engine = engine
        self._keep_admitted()

    @property
    def views(self) -> ViewStore | None:
        return self._views

    @views.setter
    def views(self, views: ViewStore | None) -> None:
        self._views = views
        self._keep_admitted()

    def _keep_admitted(self) -> None:
        # The engine keeps the identity stage's output only while someone reads it.
        self._engine.keep_admitted = bool(self._actions_exporters) or self._views is not None

    def forget_ended_sessions(self) -> int:
        """Let go of what the pipeline keeps per session (the caps' counts) for sessions the engine ended."""
        return self.caps.retain(self.engine.holds_session) if self.caps is not None else 0

    def process(self, items: Iterable[Action | Malformed | SessionMark]) -> list[Violation]:
        """Evaluate a batch (one OTLP request, or a chunk of a file) and export what it found."""
        violations = self.evaluate(items)
        self.export(violations)
        self.hand_resolutions()
        return violations

    def evaluate(self, items: Iterable[Action | Malformed | SessionMark]) -> list[Violation]:
        """Evaluate a batch and return what it found, without exporting it (actions still go to their exporters)."""
        started = time.perf_counter()
        violations = self.engine.submit_many(items)
        if self.telemetry is not None:
            self.telemetry.evaluation_seconds.observe(time.perf_counter() - started)
        violations = self.capped(violations)
        self.record_views(self.admitted_actions(), violations)
        return violations

    def admitted_actions(self) -> list[Action]:
        """The actions the identity stage passed on since the last call, handed to the action exporters.

        The operator view and the action exporters see the records the rules evaluate (sessions
        and tool-call ids resolved across the trace), not the spans as converted.
        """
        actions = self.engine.take_admitted()
        if actions:
            for exporter in self._actions_exporters:
                exporter.export_actions(actions)
        return actions

    def capped(self, violations: list[Violation]) -> list[Violation]:
        """The violations to report of one request or tick (see processor.violation_caps), the
        waived ones marked (see processor.waivers)."""
        if self.caps is not None:
            violations = self.caps.apply(violations)
        waived = self.exemptions.apply(violations) if self.exemptions is not None and violations else 0
        if waived and self.telemetry is not None:
            for v in violations:
                if WAIVED in v.details:
                    self.telemetry.violations_waived.labels(rule=v.rule).inc()
        return violations

    def record_views(self, actions: Sequence[Action], violations: Sequence[Violation]) -> None:
        """Hand a batch to the operator view's read model (inside the batch's unit of work on a SQL store)."""
        if self.views is not None and (actions or violations):
            self.views.record(actions, violations, time.time_ns())

    def tick(self, now_ns: int) -> list[Violation]:
        """Serve's clock: fire the deadlines that passed in silence."""
        violations = self.capped(self.engine.tick(now_ns))
        self.record_views(self.admitted_actions(), violations)
        self.export(violations)
        self.hand_resolutions()
        return violations

    def finish(self) -> list[Violation]:
        """End of a replay's input: release what was held for ordering, fire due deadlines."""
        violations = self.capped(self.engine.finish())
        self.record_views(self.admitted_actions(), violations)
        self.export(violations)
        self.hand_resolutions()
        return violations

    def hand_resolutions(self) -> list[str]:
        """Tell the exporters which fired waits have since been resolved (an alert ends).

        Called after the batch's violations were exported: one batch can both fire a wait
        and resolve it, and an alert must exist before it can end.
        """
        resolved = self.engine.take_resolutions()
        if resolved:
            for exporter in self.exporters:
                exporter.resolve(resolved)
        return resolved

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush every exporter, sharing the time budget between them."""
        deadline = time.monotonic() + timeout_s
        for exporter in self.exporters:
            exporter.shutdown(max(0.1, deadline - time.monotonic()))

    def export(self, violations: list[Violation]) -> None:
        """Hand violations to every exporter (also serve's worker, when no outbox stands between)."""
        if not violations:
            return
        for exporter in self.exporters:
            exporter.export(violations)
