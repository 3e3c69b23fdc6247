"""Convert: action-log lines and OTLP spans become Actions (or Malformed items).

The names below are loaded when first used: replay of an action log never needs the
span converter's protobuf modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from processor.convert.actionlog import parse_line
    from processor.convert.classify import ToolClassifier
    from processor.convert.options import DEFAULT_TOOL_KINDS, KNOWN_KINDS, ConvertOptions, ToolKindRule
    from processor.convert.otlp_json import OtlpJsonError, decode_traces
    from processor.convert.spans import ConvertResult, SpanConverter
    from processor.convert.timefmt import format_rfc3339, parse_rfc3339

_HOMES = {
    "parse_line": "actionlog",
    "ToolClassifier": "classify",
    "DEFAULT_TOOL_KINDS": "options",
    "KNOWN_KINDS": "options",
    "ConvertOptions": "options",
    "ToolKindRule": "options",
    "OtlpJsonError": "otlp_json",
    "decode_traces": "otlp_json",
    "ConvertResult": "spans",
    "SpanConverter": "spans",
    "format_rfc3339": "timefmt",
    "parse_rfc3339": "timefmt",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'processor.convert' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"processor.convert.{home}"), name)
    globals()[name] = value
    return value

__all__ = [
    "DEFAULT_TOOL_KINDS",
    "KNOWN_KINDS",
    "ConvertOptions",
    "ConvertResult",
    "OtlpJsonError",
    "SpanConverter",
    "ToolClassifier",
    "ToolKindRule",
    "decode_traces",
    "format_rfc3339",
    "parse_line",
    "parse_rfc3339",
]
