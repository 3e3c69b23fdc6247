"""The skip policy: a skip the allow-list does not name fails the run, and every skip is listed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.skip_policy import ALLOW_LIST, load_allow_list

REPO = Path(__file__).resolve().parents[1]

TESTS = """
    import pytest

    def test_runs():
        assert 1 + 1 == 2

    def test_needs_a_server():
        pytest.skip("the server is not installed")
"""


def _run(tmp_path: Path, allow_list: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(TESTS), encoding="utf-8")
    ini = "[pytest]\n"
    if allow_list is not None:
        (tmp_path / "skips.yaml").write_text(textwrap.dedent(allow_list), encoding="utf-8")
        ini += "skip_allow_list = skips.yaml\n"
    (tmp_path / "pytest.ini").write_text(ini, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.skip_policy", "-p", "no:cacheprovider", "-q", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


def test_a_skip_not_on_the_list_fails_the_run_and_is_listed_with_its_reason(tmp_path: Path) -> None:
    result = _run(tmp_path, "allowed: []\n")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "NOT ALLOWED: test_sample.py::test_needs_a_server: the server is not installed" in result.stdout
    assert "1 passed, 1 skipped" in result.stdout


def test_a_skip_on_the_list_passes_and_is_still_listed(tmp_path: Path) -> None:
    allowed = """
        allowed:
          - test: "test_sample.py::test_needs_*"
            reason: this sample has no server on purpose
    """
    result = _run(tmp_path, allowed)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "allowed: test_sample.py::test_needs_a_server: the server is not installed" in result.stdout


def test_allow_skips_reports_without_failing(tmp_path: Path) -> None:
    result = _run(tmp_path, "allowed: []\n", "--allow-skips")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "allowed by --allow-skips" in result.stdout


def test_an_entry_without_a_reason_is_a_usage_error_naming_the_file(tmp_path: Path) -> None:
    result = _run(tmp_path, "allowed:\n  - test: test_sample.py::test_needs_a_server\n")
    assert result.returncode == 4, result.stdout + result.stderr
    assert "skips.yaml: allowed[0]: needs a non-empty 'test' and 'reason'" in result.stderr


def test_the_project_allow_list_is_short_and_every_entry_has_a_reason() -> None:
    entries = load_allow_list(ALLOW_LIST)
    assert len(entries) <= 5
    assert all(entry.reason for entry in entries)
