"""Hostile input, second round: label values and ids of any length, sent by real OTLP exporters to a real serve.

The scrape of /metrics is read back by the Prometheus client's own parser; the operator view
is asked over loopback for a session whose id was sent 200,000 characters long.
"""

from __future__ import annotations

import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from prometheus_client.parser import text_string_to_metric_families

from processor.records import IDENTITY_MAX_CHARS, LABEL_MAX_CHARS
from tests.durable_support import ServeProcess
from tests.serve_support import read_jsonl, running, serve_config, wait_for
from tests.servers import free_port

TOKEN = "hostile-data-token-5c1e"


def _send(endpoint: str, service: str, spans: list[dict[str, Any]]) -> None:
    """Real SDK spans through the real OTLP/HTTP exporter, one export per span."""
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(HttpSpanExporter(endpoint=endpoint, timeout=30)))
    tracer = provider.get_tracer("hostile-data")
    for attributes in spans:
        with tracer.start_as_current_span("payment", attributes=attributes):
            pass
    provider.shutdown()


def _payment(session: str, action: str, **extra: Any) -> dict[str, Any]:
    # A payment without an idempotency key: DS002 fires once per session.
    return {"durable.session.id": session, "durable.action.id": action, "durable.action.kind": "payment", **extra}


# -- 3. label values ---------------------------------------------------------------------------


def test_label_values_are_bounded_in_length_and_stay_distinct(tmp_path: Path) -> None:
    config = serve_config(tmp_path, {"exporters": {"prometheus": {"endpoint": "127.0.0.1:0"}}})
    services = [f"svc-{i:02d}-" + "x" * 65_536 for i in range(12)]
    with running(config) as server:
        endpoint = f"http://127.0.0.1:{server.http_port}/v1/traces"
        for i, service in enumerate(services):
            _send(endpoint, service, [_payment(f"s-{i}", "pay-1")])
        assert wait_for(lambda: len(read_jsonl(tmp_path / "violations.jsonl")) >= len(services), 20)
        port = next(e for e in server.pipeline.exporters if e.name == "prometheus").port  # type: ignore[attr-defined]
        assert wait_for(lambda: "svc-11-" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text, 10)
        body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    labels = {sample.labels["service"] for family in text_string_to_metric_families(body)
              if family.name == "durable_check_actions" for sample in family.samples}
    assert len(labels) == len(services), "distinct services must stay distinct"
    assert all(len(value) <= LABEL_MAX_CHARS for value in labels), max(map(len, labels))
    # A readable prefix survives: an operator still sees which service it is.
    assert {value[:7] for value in labels} == {s[:7] for s in services}
    assert len(body) < 200_000, f"/metrics is {len(body)} bytes"


# -- 4. ids --------------------------------------------------------------------------------------


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_overlong_ids_are_digested_so_memory_per_session_is_bounded(tmp_path: Path) -> None:
    grpc_port, http_port, ui_port = free_port(), free_port(), free_port()
    jsonl = tmp_path / "violations.jsonl"
    settings = {
        "receivers": {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}"},
                               "http": {"endpoint": f"127.0.0.1:{http_port}"}}},
        "evaluate": {"tick_interval": "50ms"},
        "state": {"backend": "memory"},
        "exporters": {"jsonl": {"path": str(jsonl)}},
        "ui": {"endpoint": f"127.0.0.1:{ui_port}", "auth": {"bearer_token": TOKEN}},
    }
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(yaml.safe_dump(settings), encoding="utf-8")
    # Large buffers always mapped (and unmapped when freed): RSS then shows what is kept, not what passed.
    serve = ServeProcess(config_path, grpc_port, tmp_path / "serve.log", env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    endpoint = f"http://127.0.0.1:{http_port}/v1/traces"
    sessions = 150
    long_part = "z" * 200_000
    serve.start()
    try:
        serve.wait_ready()
        _send(endpoint, "svc", [_payment(f"warm-{i}", "pay-1") for i in range(sessions)])
        assert wait_for(lambda: len(read_jsonl(jsonl)) >= sessions, 30), serve.log()
        before = _rss_kib(serve.proc.pid)  # type: ignore[union-attr]
        spans = [_payment(f"long-{i:03d}-{long_part}", f"pay-{i}-{long_part}",
                          **{"durable.cache.key": f"cache-{long_part}-{i}"}) for i in range(sessions)]
        for start in range(0, sessions, 10):
            _send(endpoint, "svc", spans[start:start + 10])
        assert wait_for(lambda: len(read_jsonl(jsonl)) >= 2 * sessions, 60), serve.log()
        time.sleep(0.5)
        grown_kib = _rss_kib(serve.proc.pid) - before  # type: ignore[union-attr]
        found = [d for d in read_jsonl(jsonl) if d["session_id"].startswith("long-")]
        ids = {d["session_id"] for d in found}
        assert len(ids) == sessions, "distinct ids must stay distinct"
        assert all(len(d["session_id"]) <= IDENTITY_MAX_CHARS and len(d["action_id"]) <= IDENTITY_MAX_CHARS
                   for d in found)
        # The operator view shows such a session, under the id it was given.
        some = sorted(ids)[7]
        answer = httpx.get(f"http://127.0.0.1:{ui_port}/api/v1/sessions/{urllib.parse.quote(some, safe='')}",
                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert answer.status_code == 200, answer.text[:200]
        assert {v["rule"] for v in answer.json()["violations"]} == {"DS002"}
        # Three 200,000-character strings per session arrive (600 KB); what stays is bounded per session.
        assert grown_kib / sessions < 40, f"{grown_kib / sessions:.1f} KiB per session"
        assert serve.stop() == 0
    finally:
        serve.kill()
    assert "Traceback" not in serve.log()
