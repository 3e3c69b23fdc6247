"""The quickstart runs as written, in a fresh virtual environment.

The commands are read from docs/quickstart.md and the README (not copied here), run in a
new virtual environment and a scratch directory, and their output compared with what the
page shows. Offline: the environment sees the packages already installed
(``--system-site-packages``), pip uses no index and builds with the installed backend, and
the build skips the optional mypyc compilation (minutes; the compiled build has tests of
its own). serve listens on its documented default ports on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import site
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "docs" / "quickstart.md"
README = ROOT / "README.md"
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def _commands(block: str) -> list[tuple[str, list[str]]]:
    """A console block: (command, the output lines shown after it), for each ``$ `` line."""
    out: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line)
    return out


def _without_comment(command: str) -> str:
    return command.split("  #", 1)[0].strip()


def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    page = QUICKSTART.read_text(encoding="utf-8")
    consoles = [_commands(b) for b in _blocks(page, "console")]
    (install, _), (serve, serve_shown) = consoles[0][0], consoles[0][1]
    (agent_command, agent_shown) = consoles[1][0]
    (extra_install, _) = consoles[2][0]
    (jq_command, jq_shown) = consoles[4][0]
    stop_shown = next(line for line in _blocks(page, "console")[3].splitlines() if "stopped:" in line)
    agent_source = _blocks(page, "python")[0]
    # The README's own first command is the quickstart's install, then serve.
    readme_first = _blocks(README.read_text(encoding="utf-8"), "sh")[0].strip()
    assert readme_first.startswith(_without_comment(install) + " && durable-check serve"), readme_first

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    # --system-site-packages shows the base interpreter's packages only: when the tests run in
    # a virtual environment (as the README allows), its packages (the build backend among
    # them) are shown too, after the new environment's own.
    (new_site,) = (venv / "lib").glob("python*/site-packages")
    (new_site / "_running_environment.pth").write_text(
        "".join(f"{path}\n" for path in dict.fromkeys(site.getsitepackages())), encoding="utf-8"
    )
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
           "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "DURABLE_CHECK_COMPILE": "0"}
    env.pop("PYTHONPATH", None)
    for command in (_without_comment(install), _without_comment(extra_install)):
        done = subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                              check=False)
        assert done.returncode == 0, f"{command}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    # The venv's own copy, not the checkout: run from a scratch directory.
    work = tmp_path / "work"
    work.mkdir()
    (work / "agent.py").write_text(agent_source, encoding="utf-8")
    serve_args = shlex.split(_without_comment(serve))
    assert serve_args[0] == "durable-check"
    server = subprocess.Popen([str(venv / "bin" / "durable-check"), *serve_args[1:]], cwd=work, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert server.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = server.stdout.readline()
            assert line, "serve exited:\n" + "".join(lines)
            lines.append(line)
            if "agents: OTEL_EXPORTER_OTLP_ENDPOINT" in line:
                break
        # The start-up lines the page shows, in order (their timestamps left out there).
        shown = [line.split(": ", 1)[1] for line in serve_shown if ": " in line]
        said = [line.rstrip("\n").split(": ", 1)[1] for line in lines if ": " in line]
        assert said[: len(shown) - 1] == shown[:-1], "\n".join(said)
        variable, _, value = agent_command.split(" ", 1)[0].partition("=")
        agent = subprocess.run(shlex.split(agent_command.split(" ", 1)[1]), cwd=work, env={**env, variable: value},
                               capture_output=True, text=True, timeout=120, check=False)
        assert agent.returncode == 0, agent.stderr[-3000:]
        assert agent.stdout.strip().splitlines()[-1] == agent_shown[0]
        time.sleep(1.0)  # the BatchSpanProcessor's export has been acknowledged by then; serve's queue drains
        server.send_signal(signal.SIGINT)
        rest, _ = server.communicate(timeout=60)
        lines.append(rest)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)
    output = "".join(lines)
    assert server.returncode == 0, output
    assert stop_shown.split(": ", 1)[1] in output, output
    jq = subprocess.run(jq_command, shell=True, cwd=work, env=env, capture_output=True, text=True, timeout=60,
                        check=True)

    def summary(rows: list[str]) -> Counter[tuple[str, str, str, str]]:
        out: Counter[tuple[str, str, str, str]] = Counter()
        for row in rows:
            v = json.loads(row)
            session = "<conversation id>" if UUID.match(v["session_id"]) else v["session_id"]
            action = "<span id>" if v["action_id"].startswith("span-") else v["action_id"]
            out[(v["rule"], v["severity"], session, action)] += 1
        return out

    assert summary(jq.stdout.splitlines()) == summary(jq_shown)
