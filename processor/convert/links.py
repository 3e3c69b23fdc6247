"""What a span says about the tool calls around it: an LLM span's requested calls, a tool's answered call.

OpenInference TOOL spans of some frameworks (the OpenAI Agents SDK, LangChain) carry no
``tool_call.id``. The id is on the LLM span that asked for the call, flattened as
``llm.output_messages.N.message.tool_calls.M.tool_call.{id,function.name}``, and, for
LangChain, in the tool's own output (a ToolMessage with ``tool_call_id``). Both are read
here, bounded; the linking itself happens at ingest (processor.evaluate.identity).
"""

from __future__ import annotations

import re
from typing import Any, Final

import orjson

from processor.convert.profiles import OI_OUTPUT_MESSAGES_PREFIX, AnyValue, text

# llm.output_messages.<message>.message.tool_calls.<call>.tool_call.<id | function.name>
_CALL_KEY: Final = re.compile(
    re.escape(OI_OUTPUT_MESSAGES_PREFIX) + r"(\d{1,4})\.message\.tool_calls\.(\d{1,4})\.tool_call\.(id|function\.name)"
)
# An LLM span asks for at most this many calls that are linked; the rest keep made-up ids.
MAX_OFFERED: Final = 64
# A tool output larger than this is not parsed for its call id.
MAX_OUTPUT_BYTES: Final = 64 * 1024
MAX_ID_CHARS: Final = 256


def offered_tool_calls(attributes: Any, mapped: bool) -> tuple[tuple[str, str], ...]:
    """(tool name, call id) of each tool call an LLM span's output asks for, in message and call order."""
    calls: dict[tuple[int, int], dict[str, str]] = {}
    # A map yields its keys; a value is fetched only for a key that matches.
    keys = attributes if mapped else (kv.key for kv in attributes)
    values = None if mapped else {kv.key: kv.value for kv in attributes if kv.key.startswith(OI_OUTPUT_MESSAGES_PREFIX)}
    for key in keys:
        if not key.startswith(OI_OUTPUT_MESSAGES_PREFIX):
            continue
        match = _CALL_KEY.fullmatch(key)
        if match is None:
            continue
        value = attributes[key] if values is None else values[key]
        where = (int(match.group(1)), int(match.group(2)))
        if where not in calls and len(calls) >= MAX_OFFERED:
            continue
        field = text(value)
        if field and len(field) <= MAX_ID_CHARS:
            calls.setdefault(where, {})[match.group(3)] = field
    return tuple(
        (call["function.name"], call["id"])
        for _, call in sorted(calls.items())
        if "id" in call and "function.name" in call
    )


def lang_chain_call_id(output: AnyValue | None) -> str | None:
    """The ``tool_call_id`` of a LangChain ToolMessage serialized as a tool span's ``output.value``."""
    if output is None:
        return None
    raw = text(output)
    if not raw or len(raw) > MAX_OUTPUT_BYTES or "tool_call_id" not in raw:
        return None
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(document, dict):
        return None
    # Serialized as {"type": "tool", "data": {..., "tool_call_id": ...}} or as the message's own fields.
    data = document.get("data")
    for holder in (data, document) if isinstance(data, dict) else (document,):
        call_id = holder.get("tool_call_id")
        if isinstance(call_id, str) and 0 < len(call_id) <= MAX_ID_CHARS:
            return call_id
    return None
