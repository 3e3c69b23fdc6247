"""Convert: action-log lines and OTLP spans become Actions (or Malformed items)."""

from processor.convert.actionlog import parse_line
from processor.convert.classify import ToolClassifier
from processor.convert.options import DEFAULT_TOOL_KINDS, KNOWN_KINDS, ConvertOptions, ToolKindRule
from processor.convert.otlp_json import OtlpJsonError, decode_traces
from processor.convert.spans import ConvertResult, SpanConverter
from processor.convert.timefmt import format_rfc3339, parse_rfc3339

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
