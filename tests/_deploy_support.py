"""Run ``durable-check serve`` the way the image and the chart run it, on 127.0.0.1.

The deployment tests take a configuration the project ships (config/container.yaml,
the chart's rendered ConfigMap), change only what ties it to a container (listen
addresses and file paths), and run the real server in a subprocess: as an
unprivileged user when the tests run as root, like the image's USER 10001, so that a
write outside the data and tmp directories fails as it would on a read-only root
filesystem.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.servers import free_port

LOCALHOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent
# uid/gid "nobody": owns nothing on the machine but the test's own directories.
UNPRIVILEGED_ID = 65534
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 40.0


def rewrite_for_localhost(config: Any, path_map: Mapping[str, Path]) -> tuple[Any, dict[int, int]]:
    """A copy of ``config`` bound to 127.0.0.1 free ports, with container paths mapped to local ones.

    Every string ``<host>:<port>`` whose host is ``0.0.0.0`` becomes ``127.0.0.1:<free
    port>``; a string starting with a key of ``path_map`` gets that prefix replaced.
    Nothing else changes. Returns the new config and the chosen port of each original
    port (4318 -> the HTTP receiver's test port).
    """
    ports: dict[int, int] = {}

    def rewrite(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: rewrite(item) for key, item in value.items()}
        if isinstance(value, list):
            return [rewrite(item) for item in value]
        if isinstance(value, str):
            host, sep, port = value.rpartition(":")
            if sep and host == "0.0.0.0" and port.isdigit():
                original = int(port)
                ports.setdefault(original, free_port())
                return f"{LOCALHOST}:{ports[original]}"
            for prefix, local in path_map.items():
                if value == prefix or value.startswith(prefix + "/"):
                    return str(local) + value[len(prefix):]
        return value

    return rewrite(config), ports


@contextlib.contextmanager
def unprivileged_workdir() -> Iterator[Path]:
    """A fresh directory the unprivileged user owns and can reach (pytest's tmp_path is root's, 0700).

    The server checks writability with access(2), which ignores capabilities: every
    directory on the way must be searchable by the user itself, as in the image.
    """
    path = Path(tempfile.mkdtemp(prefix="durable-check-deploy-test-"))
    try:
        if os.geteuid() == 0:
            os.chown(path, UNPRIVILEGED_ID, UNPRIVILEGED_ID)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def give_to_unprivileged(*paths: Path) -> None:
    """Make directories (and what is in them) owned by the unprivileged user, when we are root."""
    if os.geteuid() != 0:
        return
    for top in paths:
        for root, dirs, files in os.walk(top):
            for name in [*dirs, *files]:
                os.chown(os.path.join(root, name), UNPRIVILEGED_ID, UNPRIVILEGED_ID)
        os.chown(top, UNPRIVILEGED_ID, UNPRIVILEGED_ID)


def unprivileged_prefix() -> list[str]:
    """The command prefix that drops root, or nothing when the tests already run unprivileged.

    The process keeps CAP_DAC_READ_SEARCH only, so that it can read this machine's
    Python installation wherever it lives (in the image it is world-readable); every
    write is still checked against uid 65534.
    """
    if os.geteuid() != 0:
        return []
    return [
        "setpriv", f"--reuid={UNPRIVILEGED_ID}", f"--regid={UNPRIVILEGED_ID}", "--clear-groups",
        "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
    ]


def write_yaml(path: Path, document: Any) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path


def serve_command(args: list[str]) -> list[str]:
    """The image's ``durable-check serve ...`` as this checkout runs it."""
    return [*unprivileged_prefix(), sys.executable, "-m", "processor.cli", *args]


def base_env(extra: Mapping[str, str] | None = None, tmp_dir: Path | None = None) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(REPO),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        # Like the image: no home directory to write to.
        "HOME": "/nonexistent",
    }
    if tmp_dir is not None:
        env["TMPDIR"] = str(tmp_dir)
    env.update(extra or {})
    return env


def check_config(config_path: Path, env: Mapping[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        serve_command(["serve", "--config", str(config_path), "--check"]),
        cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=120, check=False,
    )


class ServeProcess:
    """``durable-check serve --config FILE`` in a subprocess; ``stop()`` sends SIGTERM and returns the exit code."""

    def __init__(self, config_path: Path, env: Mapping[str, str], cwd: Path, log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            serve_command(["serve", "--config", str(config_path)]),
            cwd=cwd, env=dict(env), stdout=self._log, stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_for(
        self, url: str, *, client: httpx.Client | None = None, timeout_s: float = START_TIMEOUT_S,
    ) -> httpx.Response:
        """GET ``url`` until it answers 200; fails with the server's output if it exits or never does."""
        own_client = client is None
        http = client or httpx.Client(timeout=2.0)
        deadline = time.monotonic() + timeout_s
        last: object = None
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
                try:
                    response = http.get(url)
                    if response.status_code == 200:
                        return response
                    last = f"{response.status_code} {response.text[:200]}"
                except httpx.HTTPError as exc:
                    last = exc
                time.sleep(0.1)
        finally:
            if own_client:
                http.close()
        raise AssertionError(f"{url} did not answer 200 within {timeout_s}s (last: {last!r}):\n{self.output()[-4000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(
                f"serve did not exit within {STOP_TIMEOUT_S}s of SIGTERM:\n{self.output()[-4000:]}"
            ) from None
        finally:
            self._log.close()
        return code

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if not self._log.closed:
            self._log.close()
