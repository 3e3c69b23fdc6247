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

What is remembered lives in :class:`IdentityState`, part of the engine-wide state a
store persists, so serve resumes after a crash with the same traces and held actions.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, Final

from processor.records import Action, Malformed, SessionMark, SpanLinks

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


class _Trace:
    __slots__ = ("first", "held", "last_ns", "linked", "named", "offers", "parents", "plain")

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
        return self.plain


class IdentityState:
    """What the resolution remembers: recent traces, held actions, the latest event time seen."""

    def __init__(self) -> None:
        self.traces: OrderedDict[str, _Trace] = OrderedDict()
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
            if links.session_named and links.tool_name is None and not links.offered:
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
            if (links.session_named or links.offered) and trace.held:
                self._retry(trace, out)
            self._flush_forgotten(out)
        return out

    def release_due(self, now_ns: int) -> list[Action]:
        """Serve's clock: what has been held for the allowed lateness of wall time, unresolved."""
        out: list[Action | Malformed] = []
        if self.state.held:
            limit = now_ns - self._lateness_ns
            self._release_where(lambda held: held.received_ns <= limit, out)
        return [a for a in out if isinstance(a, Action)]

    def release_all(self) -> list[Action]:
        """End of input: everything held, as it is."""
        out: list[Action | Malformed] = []
        if self.state.held:
            self._release_where(lambda held: True, out)
        return [a for a in out if isinstance(a, Action)]

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
            victim = next(
                (tid for tid, t in itertools.islice(traces.items(), _EVICTION_SCAN) if not t.held),
                next(iter(traces)),
            )
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
        return trace.first

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
            index = next(
                (i for i, (n, _) in enumerate(offer.calls) if n == name and not offer.taken[i]),
                None,
            )
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
        else [links.parent_span_id, links.session_named, links.tool_name, [list(c) for c in links.offered]],
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
        else SpanLinks(str(links[0]), bool(links[1]), links[2], tuple((str(n), str(i)) for n, i in links[3])),
    )
