"""Waivers and baselines: findings an operator has accepted, still reported, no longer errors.

A waiver file is the operator's, never the agent's: findings are waived by rule id and
patterns on where they are (session, action, kind, service), each with a reason and an
optional expiry date. A baseline is the list of today's findings under a stable identity
(see ``finding_key``); a later run fails only on findings it does not hold.

A waived finding keeps its place in every report with ``details["waived"]`` set to
``{"reason": ..., "by": ...}`` (``by`` names the waiver's ``file:line`` or the baseline),
is counted apart from the violations that fail a run, and becomes a SARIF suppression.
"""

from __future__ import annotations

import datetime
import fnmatch
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from processor.configfmt import YamlProblem, decode, key_places, load_yaml_strict, placed
from processor.errors import ConfigError, Problem
from processor.violations import WAIVED, Violation

log = logging.getLogger("durable_check.waivers")

BASELINE_FORMAT: Final = "durable-check-baseline/v1"
_RULE_ID = re.compile(r"DS\d{3}|[A-Z][A-Z0-9_-]{1,31}")
# A baseline or waiver file is small; anything larger is a mistake.
MAX_FILE_BYTES: Final = 4 * 1024 * 1024


@dataclass
class WaiverEntry:
    rule: str
    reason: str
    # Shell-style patterns (``*``, ``?``, ``[...]``); an absent one matches everything.
    session: str = "*"
    action: str = "*"
    kind: str = "*"
    service: str = "*"
    # The last day the waiver holds (YYYY-MM-DD, UTC); empty: no expiry.
    expires: str = ""

    def validate(self, path: str) -> list[Problem]:
        problems: list[Problem] = []
        if not _RULE_ID.fullmatch(self.rule):
            problems.append(Problem(f"{path}.rule", f"not a rule id: {self.rule!r} (e.g. DS002)"))
        if not self.reason.strip():
            problems.append(Problem(f"{path}.reason", "a waiver says why: give a reason"))
        if self.expires:
            try:
                datetime.date.fromisoformat(self.expires)
            except ValueError:
                problems.append(Problem(f"{path}.expires", f"not a date: {self.expires!r} (YYYY-MM-DD)"))
        return problems


@dataclass
class WaiverDocument:
    waivers: list[WaiverEntry] = field(default_factory=list)


@dataclass(frozen=True)
class Waiver:
    entry: WaiverEntry
    where: str  # file:line:col of the entry

    @property
    def expiry(self) -> datetime.date | None:
        return datetime.date.fromisoformat(self.entry.expires) if self.entry.expires else None

    def covers(self, v: Violation) -> bool:
        e = self.entry
        return (
            e.rule == v.rule
            and fnmatch.fnmatchcase(v.session_id, e.session)
            and fnmatch.fnmatchcase(v.action_id, e.action)
            and fnmatch.fnmatchcase(v.kind, e.kind)
            and fnmatch.fnmatchcase(v.service, e.service)
        )


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError([Problem(path, "no such file")], f"cannot read the {what}") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise ConfigError([Problem(path, reason)], f"cannot read the {what}") from None
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError([Problem(path, f"larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB")],
                          f"cannot read the {what}")
    return text


def _dates_as_text(raw: Any) -> Any:
    """YAML reads 2027-01-31 as a date: the decoder takes it as the text it was written as."""
    if isinstance(raw, dict):
        return {key: _dates_as_text(value) for key, value in raw.items()}
    if isinstance(raw, list):
        return [_dates_as_text(value) for value in raw]
    if isinstance(raw, datetime.date):
        return raw.isoformat()
    return raw


def load_waivers(path: str) -> list[Waiver]:
    """The waivers in ``path``; ConfigError lists every problem at its ``file:line:col``."""
    text = _read(path, "waivers")
    try:
        raw = load_yaml_strict(text, path)
    except YamlProblem as exc:
        raise ConfigError([Problem(exc.where, exc.message)], "invalid waivers") from None
    problems: list[Problem] = []
    doc = decode(WaiverDocument, _dates_as_text(raw), "", problems)
    places = key_places(text, path)
    if problems:
        raise ConfigError(placed(problems, places), f"invalid waivers in {path}:")
    return [Waiver(entry, places.get(f"waivers[{i}]", path)) for i, entry in enumerate(doc.waivers)]


_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
# A run of letters and digits with a digit in it, eight or more long: an id a run made up.
_MINTED = re.compile(r"[A-Za-z0-9]*[0-9][A-Za-z0-9]*")


def _stable(text: str) -> str:
    text = _UUID.sub("*", text)
    return _MINTED.sub(lambda m: "*" if len(m.group()) >= 8 else m.group(), text)


def finding_key(v: Violation) -> str:
    """A finding's identity across runs: rule, session and action with the ids a run mints
    (UUIDs, long tokens with digits) masked, and the action's kind; never a line number,
    trace id or span id, which change when the same run is recorded again."""
    return "\x1f".join((v.rule, _stable(v.session_id), _stable(v.action_id), v.kind))


def write_baseline(path: str, violations: Iterable[Violation]) -> int:
    """Write today's findings as a baseline; returns how many it holds."""
    counts: Counter[tuple[str, str, str, str]] = Counter()
    for v in violations:
        if WAIVED in v.details:
            continue  # a waiver already accepts it, with its reason and expiry
        rule, session, action, kind = finding_key(v).split("\x1f")
        counts[(rule, session, action, kind)] += 1
    entries = [{"rule": r, "session": s, "action": a, "kind": k, "count": n}
               for (r, s, a, k), n in sorted(counts.items())]
    with open(path, "wb") as handle:
        handle.write(orjson.dumps({"format": BASELINE_FORMAT, "findings": entries}, option=orjson.OPT_INDENT_2))
        handle.write(b"\n")
    return counts.total()


def load_baseline(path: str) -> Counter[str]:
    """A baseline's findings by identity, each with how many times it may match."""
    text = _read(path, "baseline")
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ConfigError([Problem(f"{path}:{exc.lineno}:{exc.colno}", f"not JSON: {exc.msg}")],
                          "invalid baseline") from None
    if not isinstance(doc, dict) or doc.get("format") != BASELINE_FORMAT or not isinstance(doc.get("findings"), list):
        raise ConfigError([Problem(path, f"not a baseline (an object with format {BASELINE_FORMAT!r} and findings)")],
                          "invalid baseline")
    counts: Counter[str] = Counter()
    problems: list[Problem] = []
    for index, entry in enumerate(doc["findings"]):
        fields = ("rule", "session", "action", "kind")
        if (not isinstance(entry, dict) or not all(isinstance(entry.get(f), str) for f in fields)
                or not isinstance(entry.get("count"), int) or entry["count"] < 1):
            problems.append(Problem(f"{path}: findings[{index}]",
                                    "needs rule, session, action, kind (strings) and count (at least 1)"))
            continue
        counts["\x1f".join(entry[f] for f in fields)] += entry["count"]
    if problems:
        raise ConfigError(problems, "invalid baseline")
    return counts


class Exemptions:
    """Marks the findings waivers or a baseline accept (``details["waived"]``); the rest fail a run.

    A baseline entry matches as many findings as it counted when it was written: a flaw
    that appears more often than before is new.
    """

    def __init__(self, waivers: list[Waiver] | None = None, baseline: Counter[str] | None = None,
                 baseline_name: str = "", today: Callable[[], datetime.date] | None = None) -> None:
        # serve runs for days: a waiver that expires while it runs stops waiving that day.
        self._today = today or (lambda: datetime.datetime.now(datetime.UTC).date())
        self._live: list[Waiver] = list(waivers or [])
        self.expired: list[Waiver] = []
        self._checked: datetime.date | None = None
        self._expire()
        self._baseline = Counter(baseline) if baseline is not None else None
        self._baseline_name = baseline_name

    def _expire(self) -> None:
        today = self._today()
        if today == self._checked:
            return
        self._checked = today
        for waiver in [w for w in self._live if w.expiry is not None and w.expiry < today]:
            self._live.remove(waiver)
            self.expired.append(waiver)
            log.warning("waiver at %s for %s expired on %s: its findings are errors again",
                        waiver.where, waiver.entry.rule, waiver.entry.expires)

    def apply(self, violations: Iterable[Violation]) -> int:
        """Mark the waived violations; returns how many were."""
        self._expire()
        waived = 0
        for v in violations:
            mark = self._mark(v)
            if mark is not None:
                v.details = {**v.details, WAIVED: mark}
                waived += 1
        return waived

    def _mark(self, v: Violation) -> dict[str, str] | None:
        for waiver in self._live:
            if waiver.covers(v):
                return {"reason": waiver.entry.reason, "by": waiver.where}
        if self._baseline is not None:
            key = finding_key(v)
            if self._baseline[key] > 0:
                self._baseline[key] -= 1
                return {"reason": "in the baseline", "by": self._baseline_name}
        return None


def is_waived(v: Violation) -> bool:
    return WAIVED in v.details


def waiver_of(v: Violation) -> dict[str, str] | None:
    mark = v.details.get(WAIVED)
    return mark if isinstance(mark, dict) else None
