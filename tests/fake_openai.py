"""A local OpenAI-compatible server for framework tests: canned chat completions, no network.

``POST /v1/chat/completions`` answers with the next canned reply whose ``when`` accepts the
request (the default reply policy: offer the scripted tool calls while the conversation
has no tool result since its last user message, then a plain text answer). Every request
body is kept in ``requests`` so a test can check what the framework sent. Bound to
127.0.0.1 on a free port; ``stop()`` (or leaving the ``with`` block) ends it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


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
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None, "the fake server is not running"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    def reply(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat completion for one request body."""
        messages = body.get("messages") or []
        # Tools were already called when a tool result follows the last user message.
        roles = [m.get("role") for m in messages if isinstance(m, dict)]
        last_user = max((i for i, r in enumerate(roles) if r == "user"), default=-1)
        answered = "tool" in roles[last_user + 1 :]
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if self.tool_calls and body.get("tools") and not answered:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                }
                for call in self.tool_calls
            ]
            finish = "tool_calls"
        else:
            message["content"] = self.answer
            finish = "stop"
        number = len(self.requests)
        return {
            "id": f"chatcmpl-fake-{number}",
            "object": "chat.completion",
            "created": 1_700_000_000 + number,
            "model": body.get("model") or self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
        }

    def start(self) -> FakeOpenAI:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(min(length, 1 << 20)) or b"{}")
                if self.path.rstrip("/").endswith("/chat/completions") and not body.get("stream"):
                    payload = fake.reply(body)
                    fake.requests.append(body)
                    status = 200
                else:
                    payload = {"error": {"message": "the fake server answers non-streaming chat completions only"}}
                    status = 404
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-openai", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None


@contextmanager
def fake_openai(tool_calls: Sequence[ToolCall] = (), answer: str = "done") -> Iterator[FakeOpenAI]:
    """A running fake server for the ``with`` block."""
    server = FakeOpenAI(tool_calls=tool_calls, answer=answer).start()
    try:
        yield server
    finally:
        server.stop()
