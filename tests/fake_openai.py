"""A local OpenAI-compatible server for framework tests: canned chat completions, no network.

One HTTP server (:func:`serve_chat`) answers ``POST /v1/chat/completions`` on 127.0.0.1 with
what a reply policy gives; two policies drive the frameworks:

- :class:`FakeOpenAI` (with :func:`fake_openai`): every scripted tool call at once while the
  conversation has no tool result since its last user message, then a plain text answer;
- :class:`Script` (with :func:`scripted_openai`): one tool call per turn in order (the
  conversation's tool calls so far say which is next), then a short text, and optionally
  HTTP 500 after a number of tool results (the provider fails).

Every request body is kept in ``requests`` so a test can check what the framework sent.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_MAX_BODY = 1 << 20

# A reply policy: a request body -> (HTTP status, JSON body or None for an empty error).
Respond = Callable[[dict[str, Any]], tuple[int, dict[str, Any] | None]]


@contextmanager
def serve_chat(respond: Respond) -> Iterator[str]:
    """A server thread on a free loopback port; yields its base URL (``http://127.0.0.1:P/v1``)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if not self.path.rstrip("/").endswith("/chat/completions") or length > _MAX_BODY:
                self.send_error(404)
                return
            status, payload = respond(json.loads(self.rfile.read(length) or b"{}"))
            if payload is None:
                self.send_error(status)
                return
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return  # quiet tests

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-openai",
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5.0)


def _completion(number: int, model: str, message: dict[str, Any], finish: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-fake-{number}",
        "object": "chat.completion",
        "created": 1_700_000_000 + number,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
    }


def _tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


@dataclass(frozen=True)
class ToolCall:
    """One tool call the fake model asks for."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class FakeOpenAI:
    """Scripted model: ``tool_calls`` on the first turn after a user message, then ``answer``."""

    tool_calls: Sequence[ToolCall] = ()
    answer: str = "done"
    model: str = "gpt-fake"
    requests: list[dict[str, Any]] = field(default_factory=list)
    base_url: str = ""

    def reply(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat completion for one request body."""
        messages = body.get("messages") or []
        # Tools were already called when a tool result follows the last user message.
        roles = [m.get("role") for m in messages if isinstance(m, dict)]
        last_user = max((i for i, r in enumerate(roles) if r == "user"), default=-1)
        answered = "tool" in roles[last_user + 1 :]
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if self.tool_calls and body.get("tools") and not answered:
            message["tool_calls"] = [_tool_call(call.id, call.name, call.arguments) for call in self.tool_calls]
            finish = "tool_calls"
        else:
            message["content"] = self.answer
            finish = "stop"
        return _completion(len(self.requests), body.get("model") or self.model, message, finish)

    def respond(self, body: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
        if body.get("stream"):
            return 404, {"error": {"message": "the fake server answers non-streaming chat completions only"}}
        payload = self.reply(body)
        self.requests.append(body)
        return 200, payload


@contextmanager
def fake_openai(tool_calls: Sequence[ToolCall] = (), answer: str = "done") -> Iterator[FakeOpenAI]:
    """A running :class:`FakeOpenAI` for the ``with`` block."""
    fake = FakeOpenAI(tool_calls=tool_calls, answer=answer)
    with serve_chat(fake.respond) as url:
        fake.base_url = url
        yield fake


@dataclass
class Script:
    """Tool calls the fake model makes one per turn, in order: (tool name, JSON arguments)."""

    calls: Sequence[tuple[str, dict[str, Any]]] = ()
    requests: list[dict[str, Any]] = field(default_factory=list)
    # Answer the request after this many tool results with HTTP 500 (the provider fails).
    fail_after_results: int | None = None
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def reply(self, body: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(body)
        messages = body.get("messages") or []
        index = sum(1 for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))
        message: dict[str, Any]
        if index < len(self.calls):
            name, arguments = self.calls[index]
            message = {"role": "assistant", "content": None,
                       "tool_calls": [_tool_call(f"call_{name}_{index + 1}", name, arguments)]}
            finish = "tool_calls"
        else:
            message = {"role": "assistant", "content": "done"}
            finish = "stop"
        return _completion(next(self._ids), body.get("model", "fake-model"), message, finish)

    def respond(self, body: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
        results = sum(1 for m in body.get("messages") or [] if m.get("role") == "tool")
        if self.fail_after_results is not None and results >= self.fail_after_results:
            return 500, None
        return 200, self.reply(body)


@contextmanager
def scripted_openai(script: Script) -> Iterator[str]:
    """A server answering with ``script``; yields its base URL."""
    with serve_chat(script.respond) as url:
        yield url
