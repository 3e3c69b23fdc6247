"""A skipped test is a failed test, unless tests/allowed-skips.yaml names it with its reason.

A skip hides a missing install step: on the machine where a package or server happened to be
installed by hand the test ran, on a fresh one it silently did not. So every skip is listed at the
end of the run with its reason, and any skip the allow-list does not name fails the session.
``--allow-skips`` turns the failure into a warning for a partial local environment; CI never
passes it.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ALLOW_LIST = Path(__file__).with_name("allowed-skips.yaml")
ALLOW_LIST_INI = "skip_allow_list"


@dataclass(frozen=True)
class AllowedSkip:
    """One allow-list entry: a node id (``fnmatch`` pattern) and why skipping it is right."""

    test: str
    reason: str

    def matches(self, nodeid: str) -> bool:
        return fnmatch.fnmatchcase(nodeid, self.test)


def load_allow_list(path: Path = ALLOW_LIST) -> list[AllowedSkip]:
    """Read the allow-list; a malformed one is a usage error that names the file and the entry."""
    document = yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None
    entries = (document or {}).get("allowed", []) if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise pytest.UsageError(f"{path}: expected a mapping with a list under 'allowed'")
    allowed: list[AllowedSkip] = []
    for index, entry in enumerate(entries):
        if not (isinstance(entry, dict) and isinstance(entry.get("test"), str) and entry["test"]
                and isinstance(entry.get("reason"), str) and entry["reason"].strip()):
            raise pytest.UsageError(f"{path}: allowed[{index}]: needs a non-empty 'test' and 'reason'")
        allowed.append(AllowedSkip(entry["test"], entry["reason"].strip()))
    return allowed


@dataclass(frozen=True)
class Skip:
    nodeid: str
    reason: str


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr: Any = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


class SkipPolicy:
    def __init__(self, allowed: list[AllowedSkip], enforce: bool, source: Path) -> None:
        self.allowed = allowed
        self.source = source
        self.enforce = enforce
        self.skips: list[Skip] = []

    def unexpected(self) -> list[Skip]:
        return [s for s in self.skips if not any(a.matches(s.nodeid) for a in self.allowed)]

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append(Skip(report.nodeid, _skip_reason(report)))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.enforce and self.unexpected() and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.skips:
            return
        unexpected = {s.nodeid for s in self.unexpected()}
        terminalreporter.section("skipped tests and their reasons")
        for skip in self.skips:
            mark = "NOT ALLOWED" if skip.nodeid in unexpected else "allowed"
            terminalreporter.write_line(f"{mark}: {skip.nodeid}: {skip.reason}")
        if unexpected:
            verdict = "fails the run" if self.enforce else "allowed by --allow-skips"
            terminalreporter.write_line(
                f"{len(unexpected)} skip(s) not named in {self.source}: {verdict}. Install what the "
                "test needs (scripts/test installs everything), or add the test with its "
                "reason to the allow-list.",
                red=self.enforce, bold=True,
            )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(ALLOW_LIST_INI, "the allow-list of skipped tests, relative to the rootdir", default="")
    parser.addoption(
        "--allow-skips", action="store_true", default=False,
        help="report skips not named in tests/allowed-skips.yaml instead of failing the run (local use only)",
    )


def pytest_configure(config: pytest.Config) -> None:
    configured = str(config.getini(ALLOW_LIST_INI))
    source = config.rootpath / configured if configured else ALLOW_LIST
    policy = SkipPolicy(load_allow_list(source), enforce=not config.getoption("--allow-skips"), source=source)
    config.pluginmanager.register(policy, "durable-check-skip-policy")
