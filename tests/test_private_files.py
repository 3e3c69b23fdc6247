"""Serve's files are private and its own: modes under the usual umask, and a second user's link or directory.

Serve runs as a process (the umask is the child's); the other user is ``nobody``, reached by
dropping the uid in the child that plants the link or makes the directory.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tests.durable_support import ServeProcess
from tests.serve_support import wait_for
from tests.servers import free_port

REPO = Path(__file__).resolve().parent.parent


def _payment(session: str, action: str) -> dict[str, Any]:
    return {"durable.session.id": session, "durable.action.id": action, "durable.action.kind": "payment"}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _data_settings(data: Path, grpc_port: int) -> dict[str, Any]:
    return {
        "receivers": {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}"}, "http": {"endpoint": ""}}},
        "evaluate": {"tick_interval": "50ms"},
        "state": {"backend": "sqlite", "path": str(data / "state" / "state.db")},
        "exporters": {"jsonl": {"path": str(data / "out" / "violations.jsonl"), "rotate_max_size": "4KiB",
                                "rotate_keep": 2}},
    }


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def test_serve_keeps_its_files_private_whatever_the_umask(tmp_path: Path) -> None:
    data = tmp_path / "data"
    grpc_port = free_port()
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(yaml.safe_dump(_data_settings(data, grpc_port)), encoding="utf-8")
    serve = ServeProcess(config_path, grpc_port, tmp_path / "serve.log")
    with _umask(0o022):  # inherited by the child: the usual umask
        serve.start()
    try:
        serve.wait_ready()
        provider = TracerProvider(resource=Resource.create({"service.name": "svc"}))
        provider.add_span_processor(SimpleSpanProcessor(
            GrpcSpanExporter(endpoint=f"127.0.0.1:{grpc_port}", insecure=True, timeout=30)))
        tracer = provider.get_tracer("hostile-data")
        for i in range(40):
            with tracer.start_as_current_span("payment", attributes=_payment(f"s-{i}", "pay-1")):
                pass
        provider.shutdown()
        out = data / "out"
        assert wait_for(lambda: (out / "violations.jsonl.1").exists(), 30), serve.log()
        state = data / "state"
        files = [state / "state.db", state / "state.db-wal", state / "state.db-shm", state / "state.db.lock",
                 out / "violations.jsonl", out / "violations.jsonl.1"]
        assert {str(p): _mode(p) for p in files} == {str(p): 0o600 for p in files}
        assert {str(d): _mode(d) for d in (state, out)} == {str(state): 0o700, str(out): 0o700}
        assert serve.stop() == 0
    finally:
        serve.kill()
    # Looser permissions found at start are reported, one line each, and serving goes on.
    os.chmod(data / "out" / "violations.jsonl", 0o644)
    os.chmod(data / "state", 0o755)
    with _umask(0o022):
        serve.start()
    try:
        serve.wait_ready()
        assert serve.stop() == 0
    finally:
        serve.kill()
    log = serve.log()
    assert sum("open to other users" in line and "violations.jsonl" in line for line in log.splitlines()) == 1, log
    assert sum("open to other users" in line and str(data / "state") in line for line in log.splitlines()) == 1, log


# -- 7. links and shared directories ------------------------------------------------------------


def _as_nobody() -> None:
    nobody = pwd.getpwnam("nobody")
    os.setgroups([])
    os.setgid(nobody.pw_gid)
    os.setuid(nobody.pw_uid)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A world-writable directory without the sticky bit, reachable by another user."""
    path = Path(tempfile.mkdtemp(prefix="dc-shared-", dir="/tmp"))
    os.chmod(path, 0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _plant_link(link: Path, target: Path) -> None:
    subprocess.run(["ln", "-s", str(target), str(link)], preexec_fn=_as_nobody, check=True, timeout=30)


def _serve_cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "processor.cli", "serve", "--config", str(config), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_a_link_planted_by_another_user_is_refused_by_check_and_at_start(tmp_path: Path, shared_dir: Path) -> None:
    victim = tmp_path / "private.txt"
    victim.write_bytes(b'{"kept": 1}\nlast line without newline')
    os.chmod(victim, 0o600)
    original = victim.read_bytes()
    _plant_link(shared_dir / "violations.jsonl", victim)
    assert (shared_dir / "violations.jsonl").lstat().st_uid == pwd.getpwnam("nobody").pw_uid
    settings = {
        "receivers": {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{free_port()}"}, "http": {"endpoint": ""}}},
        "state": {"backend": "memory"},
        "exporters": {"jsonl": {"path": str(shared_dir / "violations.jsonl")}},
    }
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(settings), encoding="utf-8")
    checked = _serve_cli(config, "--check")
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert "exporters.jsonl.path" in checked.stderr and "symbolic link" in checked.stderr, checked.stderr
    assert "writable by others" in checked.stderr, checked.stderr
    started = _serve_cli(config)
    assert started.returncode == 2, started.stderr
    assert "symbolic link" in started.stderr and "Traceback" not in started.stderr, started.stderr
    assert victim.read_bytes() == original and _mode(victim) == 0o600


def test_a_shared_directory_is_refused_even_without_a_link(tmp_path: Path, shared_dir: Path) -> None:
    settings = {
        "receivers": {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{free_port()}"}, "http": {"endpoint": ""}}},
        "state": {"backend": "sqlite", "path": str(shared_dir / "state.db")},
    }
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(settings), encoding="utf-8")
    checked = _serve_cli(config, "--check")
    assert checked.returncode == 2
    assert "state.path" in checked.stderr and str(shared_dir) in checked.stderr, checked.stderr
    assert "writable by others" in checked.stderr and "sticky" in checked.stderr, checked.stderr
    # A directory that belongs to another user is refused too, whatever its mode.
    theirs = shared_dir / "theirs"
    subprocess.run(["mkdir", "-m", "755", str(theirs)], preexec_fn=_as_nobody, check=True, timeout=30)
    os.chmod(shared_dir, 0o1777)  # sticky now: the shared directory itself is fine
    settings["state"] = {"backend": "sqlite", "path": str(theirs / "state.db")}
    config.write_text(yaml.safe_dump(settings), encoding="utf-8")
    checked = _serve_cli(config, "--check")
    assert checked.returncode == 2 and "belongs to another user" in checked.stderr, checked.stderr
    settings["state"] = {"backend": "sqlite", "path": str(shared_dir / "mine" / "state.db")}
    config.write_text(yaml.safe_dump(settings), encoding="utf-8")
    assert _serve_cli(config, "--check").returncode == 0
