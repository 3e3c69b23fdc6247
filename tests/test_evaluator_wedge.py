"""Nothing may wedge the evaluator: a journaled request whose evaluation never comes back is set aside.

serve runs as a real subprocess on SQLite; one request (a session of its own) makes its
evaluation block for ever, in every process (tests/wedging_serve.py). The test plays the
orchestrator: it probes ``/healthz`` like a liveness probe and SIGKILLs and restarts serve
when the probe fails. The request comes back from the journal at every start; after a
bounded number of tries it must be set aside, counted and logged without its content,
and every other request evaluated as an uninterrupted run evaluates it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from processor.config import parse_config
from tests.durable_support import (
    REPO,
    RetryingSender,
    ServeProcess,
    memory_run_ids,
    send_sessions,
    serve_settings,
    workload,
    write_config,
)
from tests.serve_support import read_jsonl
from tests.servers import free_port

POISONED = "sess-wedge-poison"


@dataclass
class WedgingServe(ServeProcess):
    """serve on the store that hangs on ``POISONED`` (same ports, log and kill as ServeProcess)."""

    def start(self) -> None:
        import os

        env = {**os.environ, "PYTHONPATH": str(REPO), **self.env}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.wedging_serve", str(self.config_path), POISONED],
                cwd=REPO, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            )
        self.starts += 1


def _alive(http_port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{http_port}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _metric(metrics_port: int, sample: str) -> float | None:
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return None


def test_a_request_that_wedges_the_evaluator_is_set_aside_after_bounded_tries(tmp_path: Path) -> None:
    start_ns = time.time_ns()
    good = workload(61, 6, 4, start_ns)
    poison_request = trace_service_pb2.ExportTraceServiceRequest.FromString(
        next(iter(workload(62, 1, 1, start_ns).values()))[0])
    for kv in poison_request.resource_spans[0].resource.attributes:
        if kv.key == "durable.session.id":
            kv.value.string_value = POISONED
    poison_body = poison_request.SerializeToString()

    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    reference = serve_settings(reference_dir, 0, {"backend": "memory"}, reference_dir / "violations.jsonl")
    expected = set(memory_run_ids(parse_config(write_config(reference_dir / "c.yaml", reference).read_text(),
                                               "c.yaml"), good, settle_s=2.0))
    assert expected, "the workload must produce violations"

    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    jsonl = tmp_path / "violations.jsonl"
    settings: dict[str, Any] = serve_settings(tmp_path, grpc_port, {"backend": "sqlite",
                                                                    "path": str(tmp_path / "state.db")}, jsonl)
    settings["receivers"]["otlp"]["http"] = {"endpoint": f"127.0.0.1:{http_port}"}
    settings["evaluate"]["max_stall"] = "1s"
    settings["exporters"]["prometheus"] = {"endpoint": f"127.0.0.1:{metrics_port}"}
    serve = WedgingServe(write_config(tmp_path / "serve.yaml", settings), grpc_port, tmp_path / "serve.log")
    serve.start()
    serve.wait_ready()

    sender = RetryingSender(lambda: grpc_port, give_up_s=120.0)
    sender.send(poison_body)  # acknowledged once journaled: the checker now owns it
    sending = threading.Thread(target=send_sessions, args=(sender, good), kwargs={"workers": 2})
    sending.start()
    set_aside = None
    try:
        deadline = time.monotonic() + 150.0
        while time.monotonic() < deadline:
            # The orchestrator's liveness probe: a failing /healthz gets the process killed and started again.
            if not _alive(http_port):
                time.sleep(0.3)
                if not _alive(http_port):
                    serve.kill()
                    serve.start()
                    serve.wait_ready(60.0)
                    continue
            found = {str(d["violation_id"]) for d in read_jsonl(jsonl)}
            set_aside = _metric(metrics_port, 'durable_check_requests_set_aside_total{reason="crashed_evaluating"}')
            if not sending.is_alive() and expected <= found and set_aside:
                break
            time.sleep(0.3)
        sending.join(30.0)
        assert not sending.is_alive(), "the client could not deliver its requests"
        found_docs = read_jsonl(jsonl)
        log = serve.log()
        assert set_aside == 1, f"the wedging request must be set aside once (killed {serve.kills} times)\n{log}"
        assert expected <= {str(d["violation_id"]) for d in found_docs}, log
        assert not any(d["session_id"] == POISONED for d in found_docs)
        # Bounded: one kill for the first hang, one for the chunk replayed, max_tries alone.
        assert 2 <= serve.kills <= 4, log
        assert "was set aside" in log and "crashed_evaluating" in log
        assert POISONED not in log, "nothing of the request's content is logged"
        assert _alive(http_port)
    finally:
        serve.kill()
