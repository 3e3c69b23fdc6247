"""RFC 3339 timestamps <-> Unix nanoseconds, exact to the nanosecond.

``datetime`` keeps microseconds only and its parser rejects some RFC 3339 forms
(nine fractional digits, a lowercase ``z``), so both directions are done by hand.
"""

from __future__ import annotations

import calendar
import re
import time
from typing import Final

_NS_PER_S: Final = 1_000_000_000

# [0-9], not \d: \d matches any Unicode digit (full-width ones among them).
_RFC3339: Final = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})"
    r"(?:\.([0-9]{1,9})[0-9]*)?(?:([Zz])|([+-])([0-9]{2}):([0-9]{2}))"
)
# Times are signed 64-bit nanoseconds everywhere downstream (state stores, OTLP, JSON
# readers): a timestamp outside 1677-09-21 .. 2262-04-11 is taken as unknown.
_MIN_NS: Final = -(2**63)
_MAX_NS: Final = 2**63 - 1


def format_rfc3339(time_ns: int) -> str:
    """UTC, fraction trimmed of trailing zeros: ``...T09:14:00Z``, ``...T09:14:00.25Z``."""
    seconds, fraction = divmod(time_ns, _NS_PER_S)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    if fraction:
        text += "." + f"{fraction:09d}".rstrip("0")
    return text + "Z"


# Records of one log mostly share their second: the parsed "YYYY-MM-DDTHH:MM:SS" of the
# common UTC forms is remembered, so most timestamps cost a dict lookup and an int().
_SECOND_CACHE: dict[str, int | None] = {}
_SECOND_CACHE_LIMIT: Final = 4096
_SECONDS_END: Final = 19  # len("YYYY-MM-DDTHH:MM:SS")


def parse_rfc3339(text: str) -> int | None:
    """Unix nanoseconds of an RFC 3339 date-time, or None when ``text`` is not one."""
    # Fast path for UTC with an ASCII fraction ("...:SSZ", "...:SS.fffZ"); the general
    # parse below decides everything else, so both give the same answer.
    tail = text[_SECONDS_END:]
    if tail[-1:] in ("Z", "z") and (len(tail) == 1 or (tail[0] == "." and tail[1:-1].isdigit() and tail.isascii())):
        head = text[:_SECONDS_END]
        try:
            start = _SECOND_CACHE[head]
        except KeyError:
            start = _parse(head + "Z")
            if len(_SECOND_CACHE) >= _SECOND_CACHE_LIMIT:
                _SECOND_CACHE.clear()
            _SECOND_CACHE[head] = start
        if start is None:
            # Out of range at the second (or not a date): the fraction may still bring the
            # first second of the range in, so the general parse decides.
            return _parse(text)
        if len(tail) == 1:
            return start
        time_ns = start + int(tail[1:-1][:9].ljust(9, "0"))
        return time_ns if time_ns <= _MAX_NS else None
    return _parse(text)


def _parse(text: str) -> int | None:
    match = _RFC3339.fullmatch(text)
    if match is None:
        return None
    year, month, day, hour, minute, second = map(int, match.group(1, 2, 3, 4, 5, 6))
    if year < 1 or not (1 <= month <= 12 and 1 <= day <= calendar.monthrange(year, month)[1]):
        return None
    # 60 is a leap second; Unix time folds it onto the next second like every parser does.
    if hour > 23 or minute > 59 or second > 60:
        return None
    seconds = calendar.timegm((year, month, day, hour, minute, 0, 0, 0, 0)) + second
    if match.group(9) is not None:
        offset_h, offset_m = int(match.group(10)), int(match.group(11))
        if offset_h > 23 or offset_m > 59:
            return None
        offset = offset_h * 3600 + offset_m * 60
        seconds -= offset if match.group(9) == "+" else -offset
    fraction = match.group(7) or ""
    time_ns = seconds * _NS_PER_S + (int(fraction.ljust(9, "0")) if fraction else 0)
    return time_ns if _MIN_NS <= time_ns <= _MAX_NS else None
