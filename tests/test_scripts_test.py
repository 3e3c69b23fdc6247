"""The README's test command (scripts/test): what CI runs, and how it stops when it cannot set up.

The happy path is the suite itself: CI runs this very command on a fresh machine, and every
test here runs inside it. These tests check the contract around it: CI calls exactly the
README's command, a missing piece stops it with one line before any test runs, and the quick
subset leaves out what starts real peers.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "test"
NOBODY = 65534


def readme_test_command() -> str:
    """The one command in the README's fenced block that follows 'Run the tests'."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    after = readme[readme.index("Run the tests"):]
    block = re.search(r"```sh\n(.*?)```", after, re.DOTALL)
    assert block is not None, "README: no ```sh block after 'Run the tests'"
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(lines) == 1, f"README: the test command block holds {len(lines)} lines, not one"
    return lines[0].strip()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    command = readme_test_command()
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    steps = [line.strip() for line in ci.splitlines()
             if line.strip() and not line.lstrip().startswith("#")
             and not line.startswith(("set ", "cd "))]
    assert steps == [f"exec {command}"]
    assert os.access(REPO / command.split()[0], os.X_OK), f"{command} is not executable"


@pytest.fixture
def bare_tree() -> Iterator[Path]:
    """A copy of the script in a directory a dropped uid can read, and a PATH of chosen tools."""
    with tempfile.TemporaryDirectory(prefix="scripts-test-") as name:
        root = Path(name)
        (root / "scripts").mkdir()
        shutil.copy2(SCRIPT, root / "scripts" / "test")
        (root / "bin").mkdir()
        for path in (root, root / "scripts", root / "bin"):
            path.chmod(0o755)
        yield root


def tools_on_path(root: Path, *, leave_out: set[str]) -> str:
    """A PATH holding links to what the script calls before its first install, less ``leave_out``."""
    wanted = ["bash", "env", "dirname", "sed", "sort", "id", "ls", "mktemp", "tail", "cat", "printf",
              "prometheus", "promtool", "prometheus-alertmanager", "openssl", "chromium", "go", "cc", "sudo",
              "apt-get"]
    for tool in wanted:
        found = shutil.which(tool)
        if tool not in leave_out and found is not None:
            (root / "bin" / tool).symlink_to(found)
    return str(root / "bin")


def run_script(root: Path, path: str, *args: str, uid: int | None = None,
               python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    def drop() -> None:
        if uid is not None:
            os.setgid(NOBODY)
            os.setuid(uid)
    env = {"PATH": path, "PYTHON": python, "HOME": str(root), "LANG": "C.UTF-8"}
    return subprocess.run(["bash", str(root / "scripts" / "test"), *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False, preexec_fn=drop, cwd=root)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    return lines[0]


def test_a_missing_debian_package_without_root_stops_with_one_line_naming_it(bare_tree: Path) -> None:
    path = tools_on_path(bare_tree, leave_out={"prometheus", "sudo"})
    # Debian's own Python: a dropped uid cannot read an interpreter under root's home.
    done = run_script(bare_tree, path, uid=NOBODY, python="/usr/bin/python3")
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_line(done.stderr)
    assert line.startswith("scripts/test: missing Debian packages prometheus:")
    assert "apt-get install -y prometheus" in line
    assert "tests" not in done.stdout  # stopped before any test ran


def test_no_go_stops_with_one_line_before_any_test(bare_tree: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("this test runs as root, as CI does (it must not try to install with apt-get as another user)")
    path = tools_on_path(bare_tree, leave_out={"go"})
    done = run_script(bare_tree, path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert one_line(done.stderr).startswith("scripts/test: Go is not on PATH:")
    assert "Python packages" not in done.stdout and "tests" not in done.stdout


def test_a_python_too_old_or_absent_is_named(bare_tree: Path) -> None:
    path = tools_on_path(bare_tree, leave_out=set())
    done = run_script(bare_tree, path, python=str(bare_tree / "no-such-python"))
    assert done.returncode == 2
    assert "Python 3.11 or newer" in one_line(done.stderr)


def test_unknown_arguments_are_a_usage_error(bare_tree: Path) -> None:
    done = run_script(bare_tree, tools_on_path(bare_tree, leave_out=set()), "--fast")
    assert done.returncode == 2
    assert one_line(done.stderr) == (
        "scripts/test: unknown argument '--fast' (pass pytest arguments after --; see scripts/test --help)")


def test_quick_in_an_environment_without_the_project_says_how_to_prepare_it(bare_tree: Path) -> None:
    venv = bare_tree / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    done = run_script(bare_tree, tools_on_path(bare_tree, leave_out=set()), "--quick",
                      python=str(venv / "bin" / "python"))
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert "the project is not installed in" in line and "run scripts/test once" in line


def collected(*args: str) -> tuple[set[str], int]:
    """Node ids pytest would run with ``args``, and how many it deselected."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode in (0, 5), done.stdout + done.stderr
    ids = {line.strip() for line in done.stdout.splitlines() if "::" in line}
    match = re.search(r"(\d+) deselected", done.stdout)
    return ids, int(match.group(1)) if match else 0


def test_quick_leaves_out_real_peers_and_keeps_the_rest() -> None:
    slow_modules = ["tests/test_soak.py", "tests/test_collector.py", "tests/test_operate_view.py"]
    everything, _ = collected(*slow_modules, "tests/test_rulefmt.py")
    quick, deselected = collected("--quick", *slow_modules, "tests/test_rulefmt.py")
    assert quick == {node for node in everything if node.startswith("tests/test_rulefmt.py::")}
    assert deselected == len(everything - quick) > 0


def test_quick_leaves_out_the_tests_that_start_a_server_and_keeps_their_neighbours() -> None:
    quick, deselected = collected("--quick", "tests/test_state_postgres.py")
    # The module's tests that take the PostgreSQL server fixture are left out; the one that does not stays.
    assert quick == {"tests/test_state_postgres.py::test_the_password_never_appears_in_messages"}
    assert deselected > 0
