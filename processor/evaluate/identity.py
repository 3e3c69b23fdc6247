"""Session identity and tool-call ids across the spans of a trace, resolved at ingest.

Instrumentations name the session on some spans only: OpenLLMetry on its workflow and
tool spans, openai-v2 with ``opentelemetry-util-genai`` on the ``invoke_agent`` span. A
span that names no session belongs to the session its trace names: the nearest ancestor
that names one, else the first session any span of the trace named. A conversation
carried over several traces (one agent run per trace) stays one session because each
trace names it.

Likewise an OpenInference TOOL span without ``tool_call.id`` takes its id from the LLM
span that asked for the call (``llm.output_messages.N.message.tool_calls.M``): the LLM
span that started last before the tool, preferring the tool's parent, then its siblings,
whose output asks for a call of that tool name not yet taken, in call order.

Spans arrive in any order (the span naming the session is often the root, which ends and
is exported last). An action still missing its session or its call id is *held* here,
before the engine sees it, until the span it waits for arrives, or until it has waited
the allowed lateness (in event time; in serve also in wall time), or the input ends.
Released without an answer it keeps what the converter gave it: the trace id as its
session, a made-up action id still marked as made up. Nothing held is dropped.

The same stage applies what a durable runtime recorded (processor/convert/frameworks.py
reads it from the spans). A DBOS step that completed is numbered within its workflow's run
(DBOS's own step ids are not on the spans); the same step of the same workflow seen again
in a later run (a recovered process) was served from DBOS's record, so its record and the
action whose span holds it are marked ``replayed``, and that action's outcome is recorded
(``result_ref`` names the step). A LangGraph model or tool span is held until the
checkpoint of its node is seen, and its outcome is recorded by it; a node that never
completed saved nothing, and after the allowed lateness the span goes on as it was. A DBOS
workflow id also joins sessions: a trace of the workflow that names no session takes the
one another trace of the workflow named, else the workflow id. And one tool call is one
action: a framework's tool span with an annotated action inside it (``durable_check.annotate``)
is that action's container, not a second action.

What is remembered lives in :class:`IdentityState`, part of the engine-wide state a
store persists, so serve resumes after a crash with the same traces and held actions.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Final

from processor.convert.timefmt import format_rfc3339
from processor.records import (
    COVERED_BY_STEP_BESIDE,
    ROLE_ANNOTATED,
    ROLE_DEFERRED,
    ROLE_TOOL,
    Action,
    Malformed,
    SessionMark,
    SpanLinks,
)

# Traces remembered (least recently touched forgotten first; their held actions are released).
MAX_TRACES: Final = 2048
# How many of the least recently touched traces are looked at for one that holds nothing.
_EVICTION_SCAN: Final = 256
# A trace holding nothing is forgotten once event time is this far past its latest span
# (at least): its spans have arrived. It keeps the state a store writes per batch small.
MIN_TRACE_KEEP_NS: Final = 60 * 1_000_000_000
# Per trace: spans whose parent or named session is remembered, and LLM spans' offered calls.
MAX_SPANS_PER_TRACE: Final = 512
MAX_OFFERS_PER_TRACE: Final = 128
# Actions held at once (the oldest is released first beyond it).
MAX_HELD: Final = 65536
# Durable runtimes' workflows remembered (least recently touched forgotten first), and per
# workflow its runs (process and trace) and step names counted.
MAX_WORKFLOWS: Final = 1024
MAX_RUNS_PER_WORKFLOW: Final = 8
MAX_STEPS_PER_RUN: Final = 64
# Spans looked through, between a framework's tool span and the annotated action inside it.
_HOLDER_DEPTH: Final = 4
# Sessions with deferred tool calls awaiting a decision remembered, and calls per session.
MAX_DEFERRED_SESSIONS: Final = 4096
MAX_DEFERRED_PER_SESSION: Final = 64
# Derived decision records are numbered from here in their span's delivery key (past events and
# the converter's derived records).
_DECISION_INDEX: Final = 1 << 25
# Ancestors walked for the nearest one that names a session.
_MAX_DEPTH: Final = 64
_NEVER: Final = -(2**63)

Item = Action | Malformed | SessionMark


class _Offer:
    """An LLM span's requested tool calls and which of them a tool span took already."""

    __slots__ = ("calls", "parent", "start_ns", "taken")

    def __init__(self, parent: str, start_ns: int, calls: list[tuple[str, str]], taken: list[bool]) -> None:
        self.parent = parent
        self.start_ns = start_ns
        self.calls = calls
        self.taken = taken


class _Held:
    __slots__ = ("action", "received_ns")

    def __init__(self, action: Action, received_ns: int) -> None:
        self.action = action
        self.received_ns = received_ns


class _Workflow:
    """A durable runtime's workflow: the session it belongs to, and per run its completed steps counted."""

    __slots__ = ("runs", "session")

    def __init__(self, session: str = "", runs: dict[str, dict[str, int]] | None = None) -> None:
        self.session = session
        self.runs: dict[str, dict[str, int]] = runs if runs is not None else {}

    def to_plain(self) -> list[Any]:
        return [self.session, {run: dict(steps) for run, steps in self.runs.items()}]


class _Trace:
    __slots__ = (
        "annotated", "covers", "first", "held", "last_ns", "linked", "named", "offers", "parents", "plain",
        "step_spans", "steps", "workflow",
    )

    def __init__(self) -> None:
        # The spans that may be ancestors of others (agent and workflow runs, session marks,
        # spans that name a session; leaf actions are not kept), in one of two maps: a span
        # that names a session is in ``named`` (the walk up stops there, its parent is never
        # read), one that names none in ``parents`` (the walk goes on to its parent). A span
        # is in one of them only, so a trace's row does not carry the named spans twice.
        self.parents: dict[str, str] = {}
        # Tool spans linked to a call id: a span delivered again takes the same one.
        self.linked: dict[str, str] = {}
        self.last_ns = _NEVER
        self.named: dict[str, str] = {}
        self.first: str | None = None
        self.offers: dict[str, _Offer] = {}
        self.held: list[_Held] = []
        # The durable runtime's workflow the trace runs ("" none); the checkpoints of completed
        # steps seen (what they cover is recorded); per span holding a completed step, that
        # step's record id and whether it was served from the record; the parents of annotated
        # actions (a framework's tool span among them is no action of its own).
        self.workflow = ""
        self.covers: set[str] = set()
        self.steps: dict[str, tuple[str, bool]] = {}
        # Per parent span, its completed steps: (began, ended, record id, served from the record).
        self.step_spans: dict[str, list[tuple[int, int, str, bool]]] = {}
        self.annotated: set[str] = set()
        # Its plain form as last written, None once changed: a store writes the whole state
        # every batch, and only the traces a batch touched are converted again.
        self.plain: dict[str, Any] | None = None

    def to_plain(self) -> dict[str, Any]:
        if self.plain is None:
            self.plain = {
                "parents": dict(self.parents),
                "named": dict(self.named),
                "first": self.first,
                "linked": dict(self.linked),
                "last_ns": self.last_ns,
                "offers": [
                    [span, o.parent, o.start_ns, o.calls, list(o.taken)]
                    for span, o in self.offers.items()
                ],
                "held": [[_action_to_plain(h.action), h.received_ns] for h in self.held],
            }
            # What durable runtimes and annotated actions added: most traces have none of it.
            if self.workflow:
                self.plain["workflow"] = self.workflow
            if self.covers:
                self.plain["covers"] = sorted(self.covers)
            if self.steps:
                self.plain["steps"] = {span: list(step) for span, step in self.steps.items()}
                self.plain["step_spans"] = {span: [list(s) for s in spans] for span, spans in self.step_spans.items()}
            if self.annotated:
                self.plain["annotated"] = sorted(self.annotated)
        return self.plain


class IdentityState:
    """What the resolution remembers: recent traces, held actions, the latest event time seen."""

    def __init__(self) -> None:
        self.traces: OrderedDict[str, _Trace] = OrderedDict()
        self.workflows: OrderedDict[str, _Workflow] = OrderedDict()
        # Per session, the deferred tool calls awaiting approval: call id -> (tool, when the wait began).
        self.deferred: OrderedDict[str, dict[str, tuple[str, int]]] = OrderedDict()
        self.held = 0
        self.max_event_ns = _NEVER
        # (event time, seq, trace id) of held actions, earliest first; entries of actions
        # released meanwhile are skipped when they come up. Rebuilt on load, never stored.
        self.expiry: list[tuple[int, int, str]] = []
        # Trace changes since a durable store last wrote the traces (None: nobody asked, nothing
        # kept): the traces changed (every change also drops a trace's cached plain form), and
        # those forgotten. A store then converts and compares those, not every recent trace.
        self.touched: set[str] | None = None
        self.forgotten: set[str] | None = None

    def to_plain(self, *, traces: bool = True) -> dict[str, Any]:
        """Plain data; ``traces=False`` leaves the traces out (a store that writes them by change)."""
        return {
            "max_event_ns": self.max_event_ns,
            "workflows": [[workflow_id, workflow.to_plain()] for workflow_id, workflow in self.workflows.items()],
            "deferred": [[session, {call: list(wait) for call, wait in calls.items()}]
                         for session, calls in self.deferred.items()],
            "traces": [[trace_id, trace.to_plain()] for trace_id, trace in self.traces.items()] if traces else [],
        }

    def track_changes(self) -> None:
        """From now on, note the traces changed and forgotten (until :meth:`take_changes`)."""
        self.touched = set()
        self.forgotten = set()

    def take_changes(self) -> tuple[list[list[Any]] | None, list[str]]:
        """The traces changed since the last call, as ``[trace id, plain]`` in their order, and the ids
        forgotten; the first is None when a changed trace is not among the newest (it changed in
        place, not moved), which a store that keeps the rows in order must handle by comparing all.
        Tracking starts again from here."""
        touched, forgotten = self.touched, self.forgotten
        assert touched is not None and forgotten is not None, "track_changes() first"
        self.touched, self.forgotten = set(), set()
        traces = self.traces
        newest = list(itertools.islice(reversed(traces), len(touched)))
        if len(newest) != len(touched) or not touched.issuperset(newest):
            return None, list(forgotten)
        newest.reverse()
        return [[trace_id, traces[trace_id].to_plain()] for trace_id in newest], list(forgotten)

    def changed(self, trace_id: str) -> None:
        if self.touched is not None:
            self.touched.add(trace_id)

    def forget(self, trace_id: str) -> _Trace:
        trace = self.traces.pop(trace_id)
        if self.forgotten is not None:
            assert self.touched is not None
            self.forgotten.add(trace_id)
            self.touched.discard(trace_id)
        return trace

    @classmethod
    def from_plain(cls, plain: Mapping[str, Any] | None) -> IdentityState:
        state = cls()
        if not plain:
            return state
        state.max_event_ns = int(plain["max_event_ns"])
        for session_id, calls in plain.get("deferred", ()):
            state.deferred[str(session_id)] = {str(c): (str(w[0]), int(w[1])) for c, w in calls.items()}
        for workflow_id, (session, runs) in plain.get("workflows", ()):
            state.workflows[str(workflow_id)] = _Workflow(
                str(session), {str(run): {str(n): int(c) for n, c in steps.items()} for run, steps in runs.items()}
            )
        for trace_id, body in plain["traces"]:
            trace = _Trace()
            trace.named = {str(k): str(v) for k, v in body["named"].items()}
            # Rows written before a named span left ``parents`` hold it in both maps.
            trace.parents = {str(k): str(v) for k, v in body["parents"].items() if k not in trace.named}
            trace.first = body["first"]
            trace.linked = {str(k): str(v) for k, v in body["linked"].items()}
            trace.last_ns = int(body["last_ns"])
            for span, parent, start_ns, calls, taken in body["offers"]:
                trace.offers[str(span)] = _Offer(
                    str(parent), int(start_ns), [(str(n), str(i)) for n, i in calls], [bool(t) for t in taken]
                )
            trace.held = [_Held(_action_from_plain(a), int(received)) for a, received in body["held"]]
            # Rows written before durable runtimes were read have none of these.
            trace.workflow = str(body.get("workflow", ""))
            trace.covers = {str(c) for c in body.get("covers", ())}
            trace.steps = {str(s): (str(step[0]), bool(step[1])) for s, step in body.get("steps", {}).items()}
            trace.annotated = {str(a) for a in body.get("annotated", ())}
            trace.step_spans = {
                str(s): [(int(b), int(e), str(r), bool(x)) for b, e, r, x in spans]
                for s, spans in body.get("step_spans", {}).items()
            }
            state.held += len(trace.held)
            state.traces[str(trace_id)] = trace
            state.expiry.extend((h.action.time_ns or 0, h.action.seq, str(trace_id)) for h in trace.held)
        heapq.heapify(state.expiry)
        return state


class IdentityResolver:
    """Fills in sessions and tool-call ids from other spans of the trace; see the module docstring."""

    def __init__(self, state: IdentityState, lateness_ns: int) -> None:
        self.state = state
        self._lateness_ns = lateness_ns
        self._keep_ns = max(2 * lateness_ns, MIN_TRACE_KEEP_NS)
        # Held actions of a trace forgotten to make room, released with the next output.
        self._pending_release: list[Action] = []

    def admit(self, items: Iterable[Item], now_ns: int) -> list[Action | Malformed]:
        """The items ready for the engine, in order: those resolved now and those released from holding.

        ``now_ns``: the wall time they arrive (serve), recorded on what is held.
        """
        out: list[Action | Malformed] = []
        state = self.state
        traces = state.traces
        touched = state.touched
        if not isinstance(items, list | tuple):
            items = list(items)
        self._prepare(items)
        # Runs of sessions with deferred calls that began (where in ``out``, session, when).
        runs: list[tuple[int, str, int]] = []
        deferring = False
        for item in items:
            if isinstance(item, Malformed):
                out.append(item)
                continue
            time_ns = item.time_ns
            if time_ns is not None and time_ns > state.max_event_ns:
                state.max_event_ns = time_ns
                if state.held:
                    self._release_expired(time_ns - self._lateness_ns, out)
                self._forget_quiet(time_ns - self._keep_ns)
            if isinstance(item, SessionMark):
                trace = self._trace(item.trace_id, time_ns)
                self._remember(trace, item.span_id, item.parent_span_id, item.session_id or None, ancestor=True)
                if item.workflow:
                    self._join_workflow(trace, item.workflow)
                if trace.annotated and item.span_id in trace.annotated and item.parent_span_id:
                    trace.annotated.add(item.parent_span_id)
                if (deferring or state.deferred) and item.session_id and time_ns is not None:
                    runs.append((len(out), item.session_id, time_ns))
                self._retry(trace, out)
                self._flush_forgotten(out)
                continue
            links = item.links
            if links is None or item.delivery_key is None:
                out.append(item)
                continue
            trace_id, span_id, _ = item.delivery_key
            known = traces.get(trace_id)
            if known is None:
                trace = self._trace(trace_id, time_ns)
            else:  # _trace's update of a known trace, inline: this runs for every span
                trace = known
                traces.move_to_end(trace_id)
                trace.plain = None
                if touched is not None:
                    touched.add(trace_id)
                if time_ns is not None and time_ns > trace.last_ns:
                    trace.last_ns = time_ns
            if links.role == ROLE_DEFERRED:
                deferring = True
            elif links.role and self._one_per_call(trace, span_id, links):
                # A tool span whose annotated action stands for the call: a place in the trace only.
                self._remember(trace, span_id, links.parent_span_id, item.session_id if links.session_named else None,
                               ancestor=True)
                if trace.held:
                    self._retry(trace, out)
                continue
            if trace.steps:
                self._record_of_step(trace, span_id, item)
            if links.session_named and links.tool_name is None and not links.offered and not links.covered_by:
                # Nothing to resolve (the usual span names its session): remembered for its trace, passed on.
                self._remember(trace, span_id, links.parent_span_id, item.session_id, ancestor=True)
                out.append(item)
                if trace.held:
                    self._retry(trace, out)
                if self._pending_release:
                    self._flush_forgotten(out)
                continue
            if links.session_named:
                self._remember(trace, span_id, links.parent_span_id, item.session_id, ancestor=True)
            if links.offered:
                self._offer(trace, span_id, links, time_ns)
            if self._resolve(trace, item):
                out.append(item)
            else:
                self._hold(trace, item, now_ns, out)
            if (links.session_named or links.offered or links.step) and trace.held:
                self._retry(trace, out)
            self._flush_forgotten(out)
        if state.deferred or deferring:
            out = self._decide_deferred(out, runs)
        return out

    def holding(self, session_ids: Collection[str]) -> set[str]:
        """Which of these sessions a held span belongs to (one without a session yet may belong to any)."""
        if not self.state.held:
            return set()
        wanted = set(session_ids)
        found: set[str] = set()
        for trace in self.state.traces.values():
            for held in trace.held:
                links = held.action.links
                if links is None or not links.session_named:
                    return wanted  # its session is what its trace will say
                session = held.action.session_id
                if session in wanted:
                    found.add(session)
        return found

    def release_due(self, now_ns: int) -> list[Action]:
        """Serve's clock: what has been held for the allowed lateness of wall time, unresolved."""
        out: list[Action | Malformed] = []
        if self.state.held:
            limit = now_ns - self._lateness_ns
            self._release_where(lambda held: held.received_ns <= limit, out)
        return [a for a in self._decide_released(out) if isinstance(a, Action)]

    def release_all(self) -> list[Action]:
        """End of input: everything held, as it is."""
        out: list[Action | Malformed] = []
        if self.state.held:
            self._release_where(lambda held: True, out)
        return [a for a in self._decide_released(out) if isinstance(a, Action)]

    def _decide_released(self, out: list[Action | Malformed]) -> list[Action | Malformed]:
        """Released actions take part in deferred calls' decisions as admitted ones do."""
        if self.state.deferred or any(
            isinstance(a, Action) and a.links is not None and a.links.role == ROLE_DEFERRED for a in out
        ):
            return self._decide_deferred(out, [])
        return out

    # -- traces ---------------------------------------------------------------------------

    def _trace(self, trace_id: str, time_ns: int | None) -> _Trace:
        traces = self.state.traces
        trace = traces.get(trace_id)
        if trace is not None:
            traces.move_to_end(trace_id)
            trace.plain = None  # whatever this item does to it
            self.state.changed(trace_id)
            if time_ns is not None and time_ns > trace.last_ns:
                trace.last_ns = time_ns
            return trace
        if len(traces) >= MAX_TRACES:
            # A trace still holding spans waits for its root: forget one that holds nothing first.
            victim = next(iter(traces))
            for tid, t in itertools.islice(traces.items(), _EVICTION_SCAN):
                if not t.held:
                    victim = tid
                    break
            forgotten = self.state.forget(victim)
            self.state.held -= len(forgotten.held)
            # Released with what it can tell: a forgotten trace cannot answer any more.
            for held in forgotten.held:
                self._resolve(forgotten, held.action, final=True)
                self._pending_release.append(held.action)
        trace = _Trace()
        if time_ns is not None:
            trace.last_ns = time_ns
        traces[trace_id] = trace
        self.state.changed(trace_id)
        return trace

    def _forget_quiet(self, before_ns: int) -> None:
        """Forget the least recently touched traces that hold nothing and went quiet before ``before_ns``."""
        traces = self.state.traces
        while traces:
            trace_id, trace = next(iter(traces.items()))
            if trace.held or trace.last_ns >= before_ns:
                return
            self.state.forget(trace_id)

    def _remember(self, trace: _Trace, span_id: str, parent: str, session: str | None, *, ancestor: bool) -> None:
        if ancestor and _remembered(trace) < MAX_SPANS_PER_TRACE:
            if session:
                trace.named[span_id] = session
                if trace.parents:
                    trace.parents.pop(span_id, None)
            elif span_id not in trace.named:
                trace.parents[span_id] = parent
        if session and trace.first is None:
            trace.first = session
            if trace.workflow:
                workflow = self.state.workflows.get(trace.workflow)
                if workflow is not None and not workflow.session:
                    workflow.session = session

    def _offer(self, trace: _Trace, span_id: str, links: SpanLinks, time_ns: int | None) -> None:
        if span_id in trace.offers or len(trace.offers) >= MAX_OFFERS_PER_TRACE:
            return
        calls = list(links.offered)
        trace.offers[span_id] = _Offer(links.parent_span_id, time_ns or 0, calls, [False] * len(calls))

    # -- resolution ---------------------------------------------------------------------------

    def _resolve(self, trace: _Trace, action: Action, final: bool = False) -> bool:
        """Fill in what the trace can tell now; True when nothing is missing any more.

        ``final``: the action is released whatever is missing; the session falls back to any
        session the trace named, and what is still unknown stays as the converter made it.
        """
        links = action.links
        assert links is not None
        complete = True
        if not links.session_named:
            session = self._session_of(trace, links.parent_span_id, final)
            if session is None:
                complete = False
            else:
                action.record["session_id"] = session
                action.links = links = links._replace(session_named=True)
        if links.covered_by == COVERED_BY_STEP_BESIDE:
            if links.parent_span_id in trace.parents or links.parent_span_id in trace.named or final:
                self._step_beside(trace, action)
                action.links = links = links._replace(covered_by="")
            else:
                complete = False
        elif links.covered_by:
            if links.covered_by in trace.covers:
                record = action.record
                if "result" not in record and not record.get("result_ref"):
                    record["result_ref"] = links.covered_by
                action.links = links = links._replace(covered_by="")
            elif not final:
                complete = False
        if links.tool_name is not None:
            call_id = self._take_call(trace, links, action)
            if call_id is None:
                complete = False
            else:
                action.record["action_id"] = call_id
                action.synthetic_action_id = False
                action.links = links._replace(tool_name=None)
        return complete

    def _session_of(self, trace: _Trace, parent: str, final: bool) -> str | None:
        """The session the nearest ancestor names, else the first one the trace named.

        None (wait) while an ancestor has not arrived yet: it may name another session.
        """
        named = trace.named
        parents = trace.parents
        span = parent
        for _ in range(_MAX_DEPTH):
            if not span:
                break
            session = named.get(span)
            if session is not None:
                return session
            grandparent = parents.get(span)
            if grandparent is None:
                if not final and _remembered(trace) < MAX_SPANS_PER_TRACE:
                    return None
                break
            span = grandparent
        if trace.first is not None:
            return trace.first
        return self._workflow_session(trace, final)

    def _take_call(self, trace: _Trace, links: SpanLinks, action: Action) -> str | None:
        span_id = action.delivery_key[1] if action.delivery_key is not None else ""
        earlier = trace.linked.get(span_id)
        if earlier is not None:
            return earlier  # the same span delivered again
        time_ns = action.time_ns
        name = links.tool_name
        parent = links.parent_span_id
        best: tuple[int, int] | None = None
        chosen: tuple[_Offer, int] | None = None
        for span, offer in trace.offers.items():
            if time_ns is not None and offer.start_ns > time_ns:
                continue  # asked after the tool ran: not its call
            index = _untaken_call(offer, name)
            if index is None:
                continue
            closeness = 2 if span == parent else 1 if offer.parent == parent else 0
            rank = (closeness, offer.start_ns)
            if best is None or rank > best:
                best, chosen = rank, (offer, index)
        if chosen is None:
            return None
        offer, index = chosen
        offer.taken[index] = True
        call_id = offer.calls[index][1]
        if len(trace.linked) < MAX_SPANS_PER_TRACE:
            trace.linked[span_id] = call_id
        return call_id

    # -- what a durable runtime recorded -------------------------------------------------------

    def _prepare(self, items: Sequence[Item]) -> None:
        """What ``items`` say about their traces before any of them is admitted: the parents of
        annotated actions, durable runtimes' workflows and completed steps.

        A span ends, and is exported, before its parent; but one request groups its spans by
        instrumentation scope, so an annotated action or a step may come after the framework's
        span that holds it, or beside it, within the same request.
        """
        annotating = False
        for item in items:
            if not isinstance(item, Action):
                if isinstance(item, SessionMark) and item.workflow:
                    self._join_workflow(self._trace(item.trace_id, item.time_ns), item.workflow)
                continue
            links = item.links
            if links is None or item.delivery_key is None:
                continue
            if links.role == ROLE_ANNOTATED and links.parent_span_id:
                trace = self._trace(item.delivery_key[0], item.time_ns)
                if len(trace.annotated) < MAX_SPANS_PER_TRACE:
                    trace.annotated.add(links.parent_span_id)
                    annotating = True
            if links.workflow or links.step:
                self._runtime(self._trace(item.delivery_key[0], item.time_ns), item, links)
        if annotating:
            self._propagate_annotated(items)

    def _propagate_annotated(self, items: Sequence[Item]) -> None:
        """A step or a container span holding an annotated action holds it for its parent too."""
        # Spans between a tool span and the annotated action it holds: (trace id, span id, parent).
        between: list[tuple[str, str, str]] = []
        for item in items:
            if isinstance(item, SessionMark):
                if item.parent_span_id:
                    between.append((item.trace_id, item.span_id, item.parent_span_id))
            elif isinstance(item, Action) and item.links is not None and item.links.step and item.delivery_key:
                between.append((item.delivery_key[0], item.delivery_key[1], item.links.parent_span_id))
        for _ in range(_HOLDER_DEPTH):
            grew = False
            for trace_id, span_id, parent in between:
                holder = self.state.traces.get(trace_id)
                if (
                    holder is not None
                    and span_id in holder.annotated
                    and parent not in holder.annotated
                    and len(holder.annotated) < MAX_SPANS_PER_TRACE
                ):
                    holder.annotated.add(parent)
                    grew = True
            if not grew:
                break

    @staticmethod
    def _one_per_call(trace: _Trace, span_id: str, links: SpanLinks) -> bool:
        """True for a framework's tool span that holds an annotated action (that action is the call)."""
        return links.role == ROLE_TOOL and span_id in trace.annotated

    def _join_workflow(self, trace: _Trace, workflow_id: str) -> _Workflow:
        workflows = self.state.workflows
        workflow = workflows.get(workflow_id)
        if workflow is None:
            if len(workflows) >= MAX_WORKFLOWS:
                workflows.popitem(last=False)
            workflow = workflows[workflow_id] = _Workflow()
        else:
            workflows.move_to_end(workflow_id)
        if not trace.workflow:
            trace.workflow = workflow_id
        if trace.first is not None and not workflow.session:
            workflow.session = trace.first
        return workflow

    def _workflow_session(self, trace: _Trace, final: bool) -> str | None:
        """The session of the trace's workflow, named by another of its traces; finally the workflow id."""
        if not trace.workflow:
            return None
        workflow = self.state.workflows.get(trace.workflow)
        if workflow is not None and workflow.session:
            return workflow.session
        return trace.workflow if final else None

    def _runtime(self, trace: _Trace, action: Action, links: SpanLinks) -> None:
        """A span of a durable runtime's workflow, or the record of a step that completed."""
        if (
            links.step
            and action.delivery_key is not None
            and action.delivery_key[1] in trace.annotated
            and len(trace.annotated) < MAX_SPANS_PER_TRACE
        ):
            trace.annotated.add(links.parent_span_id)  # the step holds an annotated action: so does its parent
        workflow = self._join_workflow(trace, links.workflow) if links.workflow else None
        if not links.step:
            return
        if workflow is None:  # a LangGraph node's checkpoint: what the node's spans produced is recorded
            if len(trace.covers) < MAX_SPANS_PER_TRACE:
                trace.covers.add(action.action_id)
            return
        # The k-th completion of this step in this run; the same step's k-th completion in another
        # run of the workflow came first (the runs replay in order), so this one is its replay.
        record = action.record
        run = f"{record.get('instance') or ''}/{action.delivery_key[0] if action.delivery_key else ''}"
        steps = workflow.runs.get(run)
        if steps is None:
            if len(workflow.runs) >= MAX_RUNS_PER_WORKFLOW:
                del workflow.runs[next(iter(workflow.runs))]
            steps = workflow.runs[run] = {}
        if links.step not in steps and len(steps) >= MAX_STEPS_PER_RUN:
            return
        count = steps[links.step] = steps.get(links.step, 0) + 1
        replayed = any(other.get(links.step, 0) >= count for key, other in workflow.runs.items() if key != run)
        record_id = f"{record['action_id']}#{count}"
        record["action_id"] = record_id
        if replayed:
            record["replayed"] = True
        if links.parent_span_id and len(trace.steps) < MAX_SPANS_PER_TRACE:
            trace.steps[links.parent_span_id] = (record_id, replayed)
            trace.step_spans.setdefault(links.parent_span_id, []).append(
                (links.step_start_ns, action.time_ns or 0, record_id, replayed)
            )

    @staticmethod
    def _step_beside(trace: _Trace, action: Action) -> None:
        """A completed step under the same parent that was running when the action began records it."""
        assert action.links is not None
        began = action.time_ns or 0
        for start_ns, end_ns, record_id, replayed in trace.step_spans.get(action.links.parent_span_id, ()):
            if start_ns <= began <= end_ns:
                record = action.record
                if "result" not in record and not record.get("result_ref"):
                    record["result_ref"] = record_id
                if replayed:
                    record["replayed"] = True
                return

    @staticmethod
    def _record_of_step(trace: _Trace, span_id: str, action: Action) -> None:
        """An action whose span holds a completed step: the step recorded its outcome, or served it."""
        step = trace.steps.get(span_id)
        if step is None:
            return
        record_id, replayed = step
        record = action.record
        if "result" not in record and not record.get("result_ref"):
            record["result_ref"] = record_id
        if replayed:
            # Served from the record: recovery stepped over the work (no effect ran again).
            record["replayed"] = True
            record.setdefault("replay", "skip")

    # -- decisions on deferred tool calls ---------------------------------------------------------

    def _decide_deferred(
        self, out: list[Action | Malformed], runs: list[tuple[int, str, int]]
    ) -> list[Action | Malformed]:
        """The decisions a framework shows by what the session's next run did with a deferred call.

        pydantic-ai ends a run that needs approval with the calls deferred (a wait each, from
        the converter) and resumes in the session's next run: an approved call runs there (its
        span carries the call id), a denied one does not run. So the call's execution is its
        grant, and a later run of the session that ends without executing it, its denial. A
        decision the code recorded itself (``approval_decision`` with the call as plan) is the
        decision: nothing is derived for that call.
        """
        deferred = self.state.deferred
        # Decisions the code recorded, wherever they are in this batch (a request groups its spans
        # by instrumentation scope, so the helper's decision may come after the run it allowed).
        recorded = {
            (str(a.record.get("session_id", "")), str(a.record.get("plan_version")))
            for a in out
            if isinstance(a, Action) and a.record.get("approval_decision") is not None
        }
        result: list[Action | Malformed] = []
        pending_runs = iter(runs)
        run = next(pending_runs, None)
        for index, item in enumerate(out):
            while run is not None and run[0] <= index:
                self._deny_before(run, result)
                run = next(pending_runs, None)
            if isinstance(item, Action):
                record = item.record
                session = str(record.get("session_id", ""))
                links = item.links
                if links is not None and links.role == ROLE_DEFERRED:
                    if (session, str(record.get("plan_version"))) not in recorded:
                        self._defer(session, item)
                elif session in deferred:
                    calls = deferred[session]
                    plan = record.get("plan_version")
                    if record.get("approval_decision") is not None and isinstance(plan, str) and plan in calls:
                        del calls[plan]  # the code recorded the decision itself
                    elif record.get("kind") != "approval" and item.action_id in calls:
                        tool, _ = calls.pop(item.action_id)
                        result.append(_decision(item, session, tool=tool, call=item.action_id, decision="granted",
                                                time_ns=(item.time_ns or 1) - 1))
                    if not calls:
                        del deferred[session]
            result.append(item)
        while run is not None:
            self._deny_before(run, result)
            run = next(pending_runs, None)
        return result

    def _defer(self, session: str, wait: Action) -> None:
        plan = wait.record.get("plan_version")
        if not isinstance(plan, str):
            return
        deferred = self.state.deferred
        calls = deferred.get(session)
        if calls is None:
            if len(deferred) >= MAX_DEFERRED_SESSIONS:
                deferred.popitem(last=False)
            calls = deferred[session] = {}
        if len(calls) < MAX_DEFERRED_PER_SESSION:
            tool = wait.action_id.split(":", 2)[1] if wait.action_id.count(":") >= 2 else ""
            calls[plan] = (tool, wait.time_ns or 0)

    def _deny_before(self, run: tuple[int, str, int], result: list[Action | Malformed]) -> None:
        """A later run of the session ended: the deferred calls it did not execute were denied."""
        _, session, time_ns = run
        calls = self.state.deferred.get(session)
        if not calls:
            return
        for call, (tool, waited_ns) in list(calls.items()):
            if waited_ns < time_ns:
                del calls[call]
                result.append(_decision(None, session, tool=tool, call=call, decision="denied", time_ns=time_ns))
        if not calls:
            del self.state.deferred[session]

    # -- holding ---------------------------------------------------------------------------

    def _hold(self, trace: _Trace, action: Action, now_ns: int, out: list[Action | Malformed]) -> None:
        trace.held.append(_Held(action, now_ns))
        self.state.held += 1
        assert action.delivery_key is not None
        heapq.heappush(self.state.expiry, (action.time_ns or 0, action.seq, action.delivery_key[0]))
        if self.state.held > MAX_HELD:
            self._release_oldest(out)
        self._flush_forgotten(out)

    def _retry(self, trace: _Trace, out: list[Action | Malformed]) -> None:
        still: list[_Held] = []
        for held in trace.held:
            if self._resolve(trace, held.action):
                out.append(held.action)
                self.state.held -= 1
            else:
                still.append(held)
        trace.held = still
        self._flush_forgotten(out)

    def _release_expired(self, watermark_ns: int, out: list[Action | Malformed]) -> None:
        """Release what the event-time watermark passed, found through the expiry heap (not every trace)."""
        heap = self.state.expiry
        if not heap or heap[0][0] >= watermark_ns:
            return
        due_traces: dict[str, None] = {}
        while heap and heap[0][0] < watermark_ns:
            due_traces[heapq.heappop(heap)[2]] = None
        traces = self.state.traces
        released: list[Action] = []
        for trace_id in due_traces:
            trace = traces.get(trace_id)
            if trace is not None and trace.held:
                self._release_in(trace_id, trace, lambda held: (held.action.time_ns or 0) < watermark_ns, released)
        self._emit(released, out)

    def _release_where(self, due: Any, out: list[Action | Malformed]) -> None:
        released: list[Action] = []
        for trace_id, trace in self.state.traces.items():
            if trace.held:
                self._release_in(trace_id, trace, due, released)
        self._emit(released, out)

    def _release_in(self, trace_id: str, trace: _Trace, due: Any, released: list[Action]) -> None:
        keep = [held for held in trace.held if not due(held)]
        if len(keep) != len(trace.held):
            trace.plain = None
            self.state.changed(trace_id)
            for held in trace.held:
                if due(held):
                    self._resolve(trace, held.action, final=True)
                    released.append(held.action)
            trace.held = keep

    def _emit(self, released: list[Action], out: list[Action | Malformed]) -> None:
        self.state.held -= len(released)
        released.sort(key=lambda a: a.seq)
        out.extend(released)
        self._flush_forgotten(out)

    def _release_oldest(self, out: list[Action | Malformed]) -> None:
        oldest: tuple[int, str, _Trace] | None = None
        for trace_id, trace in self.state.traces.items():
            if trace.held and (oldest is None or trace.held[0].action.seq < oldest[0]):
                oldest = (trace.held[0].action.seq, trace_id, trace)
        if oldest is not None:
            _, trace_id, trace = oldest
            trace.plain = None
            self.state.changed(trace_id)
            action = trace.held.pop(0).action
            self._resolve(trace, action, final=True)
            out.append(action)
            self.state.held -= 1

    def _flush_forgotten(self, out: list[Action | Malformed]) -> None:
        if self._pending_release:
            out.extend(self._pending_release)
            self._pending_release.clear()


def _decision(
    trigger: Action | None, session: str, *, tool: str, call: str, decision: str, time_ns: int
) -> Action:
    """The decision on a deferred call, as the annotate helper would record it, placed where it shows."""
    record: dict[str, Any] = {
        "session_id": session,
        # Not the helper's id: a decision the code also records is a record of its own.
        "action_id": f"approval:{tool}:{call}:shown",
        "kind": "approval",
        "status": "ok",
        "approval_decision": decision,
        "plan_version": call,
        "time": format_rfc3339(time_ns),
    }
    key: tuple[str, str, int] | None = None
    seq = 0
    if trigger is not None:
        for field in ("trace_id", "span_id", "service", "instance"):
            if field in trigger.record:
                record[field] = trigger.record[field]
        if trigger.delivery_key is not None:
            key = (trigger.delivery_key[0], trigger.delivery_key[1], _DECISION_INDEX)
        seq = trigger.seq
    else:
        key = (session, call, _DECISION_INDEX)
    return Action(record, "span", trigger.origin if trigger is not None else "", None, time_ns, seq, key)


def _remembered(trace: _Trace) -> int:
    """Spans a trace remembers as possible ancestors (bounded by MAX_SPANS_PER_TRACE)."""
    return len(trace.parents) + len(trace.named)


def _action_to_plain(action: Action) -> dict[str, Any]:
    links = action.links
    return {
        "record": action.record,
        "origin": action.origin,
        "time_ns": action.time_ns,
        "seq": action.seq,
        "delivery_key": None if action.delivery_key is None else list(action.delivery_key),
        "synthetic_action_id": action.synthetic_action_id,
        "links": None
        if links is None
        else [
            links.parent_span_id,
            links.session_named,
            links.tool_name,
            [list(c) for c in links.offered],
            links.role,
            links.covered_by,
            links.workflow,
            links.step,
            links.step_start_ns,
        ],
    }


def _action_from_plain(plain: Mapping[str, Any]) -> Action:
    key = plain.get("delivery_key")
    links = plain.get("links")
    return Action(
        record=dict(plain["record"]),
        source="span",
        origin=str(plain.get("origin", "")),
        time_ns=plain.get("time_ns"),
        seq=int(plain.get("seq", 0)),
        delivery_key=None if key is None else (str(key[0]), str(key[1]), int(key[2])),
        synthetic_action_id=bool(plain.get("synthetic_action_id", False)),
        links=None
        if links is None
        else SpanLinks(
            str(links[0]),
            bool(links[1]),
            links[2],
            tuple((str(n), str(i)) for n, i in links[3]),
            *_links_tail(links),
        ),
    )


def _links_tail(links: list[Any]) -> tuple[int, str, str, str, int]:
    """role, covered_by, workflow, step, step_start_ns (absent from rows written before they existed)."""
    if len(links) < 9:
        return 0, "", "", "", 0
    return int(links[4]), str(links[5]), str(links[6]), str(links[7]), int(links[8])


def _untaken_call(offer: _Offer, name: str | None) -> int | None:
    """The first call of ``name`` the offer holds that no tool span has taken yet."""
    for i, (n, _) in enumerate(offer.calls):
        if n == name and not offer.taken[i]:
            return i
    return None
