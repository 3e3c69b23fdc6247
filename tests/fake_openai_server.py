"""A local stand-in for the OpenAI chat completions API, for driving real agent frameworks offline.

It answers ``POST /v1/chat/completions`` on 127.0.0.1 with a call of the next tool in
the script (the conversation's tool calls so far say which is next) and, once the
script is done, with a short text. Nothing leaves the machine.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_MAX_BODY = 1 << 20


@dataclass
class Script:
    """Tool calls the fake model makes, in order: (tool name, JSON arguments)."""

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
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{name}_{index + 1}",
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(arguments)},
                    }
                ],
            }
            finish = "tool_calls"
        else:
            message = {"role": "assistant", "content": "done"}
            finish = "stop"
        return {
            "id": f"chatcmpl-{next(self._ids)}",
            "object": "chat.completion",
            "created": 1_793_524_440,
            "model": body.get("model", "fake-model"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if not self.path.endswith("/chat/completions") or length > _MAX_BODY:
                self.send_error(404)
                return
            body = json.loads(self.rfile.read(length) or b"{}")
            results = sum(1 for m in body.get("messages") or [] if m.get("role") == "tool")
            if script.fail_after_results is not None and results >= script.fail_after_results:
                self.send_error(500)
                return
            payload = json.dumps(script.reply(body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet tests

    return Handler


@contextlib.contextmanager
def fake_openai(script: Script) -> Iterator[str]:
    """A server thread on a free loopback port; yields its base URL (``http://127.0.0.1:P/v1``)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(script))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
