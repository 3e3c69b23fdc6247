"""Functions that rules call from CEL, beyond the language's own.

``timeDerived(key, time_ns)`` is true when an idempotency key encodes a time, so it
differs between the first run and its replay and keys nothing (DS103). It looks for:

- a UUID of version 1, 6 or 7 (their leading bits are a timestamp);
- a ULID (26 Crockford base32 characters whose first 48 bits are milliseconds since
  the epoch) decoding to a year between 1990 and 2200;
- an ISO-8601 calendar date, ``YYYY-MM-DD`` (a real date), or the basic form
  ``YYYYMMDDThhmm[ss]``; a bare ``YYYYMMDD`` counts only within 7 days of ``time_ns``
  (otherwise it is as likely an order number);
- a run of exactly 10, 13, 16 or 19 digits that, read as Unix seconds, milliseconds,
  microseconds or nanoseconds, lies within 7 days of ``time_ns``.

``time_ns`` is the record's event time in Unix nanoseconds; ``0`` (or less) means
unknown, and then only the self-describing forms (UUID, ULID, ISO date) count.
Everything is matched on token boundaries so that, for example, a hash that happens to
contain ten digits is not read as an epoch unless the time also fits.
"""

from __future__ import annotations

import datetime as _dt
import re
from collections.abc import Callable
from typing import Any, Final

# Keys longer than this are only scanned over their first part: a key is an identifier,
# and a bounded scan keeps one pathological record from costing more than any other.
MAX_SCANNED_CHARS: Final = 512
NEAR_WINDOW_NS: Final = 7 * 24 * 3600 * 1_000_000_000

_UUID = re.compile(
    r"(?<![0-9A-Fa-f])[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-([0-9A-Fa-f])[0-9A-Fa-f]{3}-[89ABab][0-9A-Fa-f]{3}-[0-9A-Fa-f]{12}"
    r"(?![0-9A-Fa-f])"
)
_TIME_UUID_VERSIONS: Final = frozenset("167")

_CROCKFORD: Final = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_ULID = re.compile(r"(?<![0-9A-Za-z])[0-7][0-9A-HJKMNP-TV-Za-hjkmnp-tv-z]{25}(?![0-9A-Za-z])")
_ULID_MIN_MS: Final = int(_dt.datetime(1990, 1, 1, tzinfo=_dt.UTC).timestamp() * 1000)
_ULID_MAX_MS: Final = int(_dt.datetime(2200, 1, 1, tzinfo=_dt.UTC).timestamp() * 1000)

_ISO_EXTENDED = re.compile(r"(?<!\d)(\d{4})-(\d{2})-(\d{2})(?!\d)")
_ISO_BASIC_DATETIME = re.compile(r"(?<!\d)(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})(\d{2})?(?!\d)")
_DIGIT_RUN = re.compile(r"(?<!\d)\d+(?!\d)")
_EPOCH_SCALE_NS: Final[dict[int, int]] = {10: 1_000_000_000, 13: 1_000_000, 16: 1_000, 19: 1}
# What every form but a UUID (36 characters) or a ULID (26) contains: an extended date, or a run
# of at least 8 digits (a basic date, an epoch). Most keys are short and hold neither: one search
# answers for them instead of four scans.
_MAY_HOLD_TIME = re.compile(r"\d{4}-\d{2}-\d{2}|\d{8}")
_ULID_CHARS: Final = 26


def _valid_date(year: str, month: str, day: str) -> _dt.date | None:
    try:
        return _dt.date(int(year), int(month), int(day))
    except ValueError:
        return None


def _date_ns(date: _dt.date) -> int:
    midnight = _dt.datetime(date.year, date.month, date.day, tzinfo=_dt.UTC)
    return int(midnight.timestamp()) * 1_000_000_000


def _has_time_uuid(key: str) -> bool:
    return any(m.group(1) in _TIME_UUID_VERSIONS for m in _UUID.finditer(key))


def _has_ulid(key: str) -> bool:
    for match in _ULID.finditer(key):
        millis = 0
        for char in match.group(0)[:10].upper():
            millis = millis * 32 + _CROCKFORD.index(char)
        if _ULID_MIN_MS <= millis <= _ULID_MAX_MS:
            return True
    return False


def _has_iso_date(key: str) -> bool:
    for match in _ISO_EXTENDED.finditer(key):
        if _valid_date(*match.groups()) is not None:
            return True
    for match in _ISO_BASIC_DATETIME.finditer(key):
        year, month, day, hour, minute, second = match.groups()
        if (
            _valid_date(year, month, day) is not None
            and int(hour) < 24
            and int(minute) < 60
            and (second is None or int(second) < 61)
        ):
            return True
    return False


def _near(value_ns: int, time_ns: int) -> bool:
    return abs(value_ns - time_ns) <= NEAR_WINDOW_NS


def _has_near_number(key: str, time_ns: int) -> bool:
    if time_ns <= 0:
        return False
    for match in _DIGIT_RUN.finditer(key):
        digits = match.group(0)
        scale = _EPOCH_SCALE_NS.get(len(digits))
        if scale is not None and _near(int(digits) * scale, time_ns):
            return True
        if len(digits) == 8:
            date = _valid_date(digits[:4], digits[4:6], digits[6:])
            if date is not None and _near(_date_ns(date), time_ns):
                return True
    return False


def time_derived(key: Any, time_ns: Any) -> bool:
    """True when ``key`` encodes a time (see the module docstring); non-strings never do."""
    if not isinstance(key, str) or not key:
        return False
    if isinstance(time_ns, bool) or not isinstance(time_ns, int):
        time_ns = 0
    scanned = key[:MAX_SCANNED_CHARS]
    if len(scanned) < _ULID_CHARS and _MAY_HOLD_TIME.search(scanned) is None:
        return False
    return _full_scan(scanned, time_ns)


def _full_scan(scanned: str, time_ns: int) -> bool:
    return _has_time_uuid(scanned) or _has_ulid(scanned) or _has_iso_date(scanned) or _has_near_number(scanned, time_ns)


# What rule expressions may call, in the shape the CEL environment takes: name -> (callable, arity).
RULE_FUNCTIONS: Final[dict[str, tuple[Callable[..., Any], int]]] = {
    "timeDerived": (time_derived, 2),
}
