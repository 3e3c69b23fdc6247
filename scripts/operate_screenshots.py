"""The operator view's screenshots in docs/images, made again: ``python scripts/operate_screenshots.py``.

Starts ``durable-check serve`` with the view on 127.0.0.1, sends it a few sessions over OTLP
(a wait with no deadline, a wait whose deadline passes, a resolved approval, a session with
violations), and photographs Waiting now, Violations, a session and the Pipeline page with
Playwright on the system's Chromium (``chromium`` on PATH; Playwright's own browser download
is not needed).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from playwright.sync_api import sync_playwright

IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _emit(provider: TracerProvider, session: str, action: str, kind: str, **attributes: Any) -> None:
    attrs = {"durable.session.id": session, "durable.action.id": action, "durable.action.kind": kind, **attributes}
    with provider.get_tracer("screenshots").start_as_current_span(f"{kind} {action}", attributes=attrs):
        pass


def main() -> int:
    grpc, http, ui = _free_port(), _free_port(), _free_port()
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "serve.yaml"
        config.write_text(
            f"receivers: {{otlp: {{grpc: {{endpoint: 127.0.0.1:{grpc}}}, http: {{endpoint: 127.0.0.1:{http}}}}}}}\n"
            f"ui: {{endpoint: 127.0.0.1:{ui}}}\n"
            f"evaluate: {{allowed_lateness: 1s, tick_interval: 100ms}}\n"
            f"state: {{backend: memory}}\n"
            f"exporters: {{jsonl: {{path: {scratch}/violations.jsonl}}}}\n", encoding="utf-8")
        server = subprocess.Popen([sys.executable, "-m", "processor.cli", "serve", "--config", str(config)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{ui}"
            for _ in range(200):
                try:
                    if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            provider = TracerProvider(resource=Resource.create({"service.name": "billing-agent"}))
            provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"127.0.0.1:{grpc}",
                                                                             insecure=True)))
            _emit(provider, "order-7731", "approval:refund:call_1", "approval", **{
                "durable.workflow.state": "awaiting_approval", "durable.plan.version": "call_1"})
            _emit(provider, "visa-2209", "wait:visa:call_4", "tool_call", **{
                "durable.workflow.state": "waiting_on_external", "durable.wait.timeout_s": 2})
            _emit(provider, "order-7790", "approval:charge:call_2", "approval", **{
                "durable.workflow.state": "awaiting_approval", "durable.wait.timeout_s": 86400})
            _emit(provider, "order-7802", "charge-7802", "payment")
            _emit(provider, "order-7802", "ask-7802", "user_prompt")
            provider.shutdown()
            time.sleep(4)  # the external wait's deadline passes; DS107 fires
            executable = shutil.which("chromium")
            if executable is None:
                sys.stderr.write("chromium is not on PATH\n")
                return 1
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
                page = browser.new_page(viewport={"width": 1280, "height": 720})
                for path, name in (("/", "operate-waiting-now"), ("/violations", "operate-violations"),
                                   ("/sessions/order-7802", "operate-session"), ("/pipeline", "operate-pipeline")):
                    page.goto(base + path)
                    page.wait_for_selector("h1")
                    page.wait_for_timeout(300)
                    page.screenshot(path=str(IMAGES / f"{name}.png"), full_page=True)
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
