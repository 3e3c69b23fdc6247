"""Durable Check in an agent's own test suite: ``pytest --durable-check``.

Off until asked (``--durable-check`` or ``durable_check = true`` in the ini file): it then adds
an in-memory span processor to the global OpenTelemetry tracer provider (setting up an SDK
provider when there is none), and after each test checks the spans the test ended with the
rules ``replay`` runs, with the same engine and options. Findings at or above ``fail_on``
fail the test, naming rule, session and action; the others are listed at the end. A finding
a waiver accepts fails nothing and is listed as waived. Each finding is also a property of
the test in the JUnit XML (``durable_check.DS002``).

``@pytest.mark.durable_check(packs=[...], fail_on="critical")`` changes packs and threshold
for one test; ``fail_on="never"`` lists findings without failing. The ``durable_findings``
fixture hands the findings to a test that asserts on them itself (that test then owns them:
they do not fail it a second time).
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import pytest

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider

    from processor.config import Config
    from processor.evaluate.engine import EngineOptions
    from processor.evaluate.model import RuleSet
    from processor.violations import Violation
    from processor.waivers import Exemptions

THRESHOLDS: Final = ("critical", "error", "warning", "info", "never")
_RANK: Final = {"critical": 0, "error": 1, "warning": 2, "info": 3}
_FINDINGS: Final = pytest.StashKey["Findings"]()
_PLUGIN_NAME: Final = "durable-check-run"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("durable-check", "Durable Check: would the agent's sessions survive a crash?")
    group.addoption("--durable-check", action="store_true", default=None,
                    help="check the spans of each test with Durable Check's rules")
    group.addoption("--durable-check-fail-on", choices=THRESHOLDS, default=None,
                    help="fail a test on findings at or above this severity (default: error; never: only list them)")
    group.addoption("--durable-check-pack", action="append", default=None, metavar="NAME",
                    help="run only this shipped pack's rules (repeatable)")
    group.addoption("--durable-check-waivers", default=None, metavar="FILE", help="the operator's waiver file")
    group.addoption("--durable-check-config", default=None, metavar="FILE",
                    help="configuration whose convert: and evaluate: sections apply, as for replay")
    group.addoption("--durable-check-baseline", default=None, metavar="FILE",
                    help="fail only on findings not in this baseline (written with --durable-check-write-baseline)")
    group.addoption("--durable-check-write-baseline", default=None, metavar="FILE",
                    help="write the findings of this run as a baseline to FILE")
    group.addoption("--durable-check-dump", default=None, metavar="FILE",
                    help="also write the spans of every test to FILE (OTLP protobuf stream) for `durable-check replay`")
    parser.addini("durable_check", "check the spans of each test with Durable Check's rules", type="bool",
                  default=False)
    parser.addini("durable_check_fail_on", "fail a test on findings at or above this severity", default="error")
    parser.addini("durable_check_packs", "shipped packs whose rules run (default: all)", type="linelist",
                  default=[])
    parser.addini("durable_check_rules", "extra rule files", type="paths", default=[])
    parser.addini("durable_check_waivers", "the operator's waiver file", default="")
    parser.addini("durable_check_config", "configuration whose convert: and evaluate: sections apply", default="")
    parser.addini("durable_check_baseline", "fail only on findings not in this baseline", default="")
    parser.addini("durable_check_dump", "also write the spans of every test to this file (OTLP protobuf stream)",
                  default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "durable_check(packs=None, fail_on=None): Durable Check's packs and failing severity for a test")
    enabled = config.getoption("--durable-check") or config.getini("durable_check")
    if enabled and not config.pluginmanager.has_plugin(_PLUGIN_NAME):
        from processor.errors import DurableCheckError

        try:
            plugin = DurableCheckSession(config)
        except DurableCheckError as exc:
            # A mistake in a rule, waiver, baseline or configuration file: said with its place, no traceback.
            raise pytest.UsageError(f"durable-check: {exc}") from None
        config.pluginmanager.register(plugin, _PLUGIN_NAME)


def _setting(config: pytest.Config, option: str, ini: str) -> Any:
    value = config.getoption(option)
    return value if value not in (None, []) else config.getini(ini)


@dataclass
class Findings:
    """What Durable Check found in one test's spans (``durable_findings``)."""

    violations: list[Violation] = field(default_factory=list)
    fail_on: str = "error"
    owned: bool = False  # the test asserts on them through the fixture

    @property
    def rules(self) -> set[str]:
        """The rule ids of the findings no waiver accepts."""
        return {v.rule for v in self.active}

    @property
    def active(self) -> list[Violation]:
        from processor.waivers import is_waived

        return [v for v in self.violations if not is_waived(v)]

    @property
    def waived(self) -> list[Violation]:
        from processor.waivers import is_waived

        return [v for v in self.violations if is_waived(v)]

    @property
    def failing(self) -> list[Violation]:
        if self.fail_on == "never":
            return []
        bound = _RANK[self.fail_on]
        return [v for v in self.active if _RANK.get(v.severity, 3) <= bound]

    def __iter__(self) -> Iterator[Violation]:
        return iter(self.violations)

    def __len__(self) -> int:
        return len(self.violations)


def describe(v: Violation) -> str:
    from processor.report import printable, waived_note

    where = f"session {v.session_id or '-'} action {v.action_id or '-'}"
    return printable(f"{v.rule} {v.name} ({v.severity}) at {where}: {v.message}{waived_note(v)}")


class _Collector:
    """A span processor that keeps the spans ended while a test runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReadableSpan] = []
        self._active = False

    def start(self) -> None:
        with self._lock:
            self._spans = []
            self._active = True

    def take(self) -> list[ReadableSpan]:
        with self._lock:
            spans, self._spans = self._spans, []
            return spans

    def stop(self) -> list[ReadableSpan]:
        with self._lock:
            self._active = False
            spans, self._spans = self._spans, []
            return spans

    def peek(self) -> list[ReadableSpan]:
        with self._lock:
            return list(self._spans)

    def keep(self, span: ReadableSpan) -> None:
        with self._lock:
            if self._active:
                self._spans.append(span)


def _span_processor(collector: _Collector) -> SpanProcessor:
    """The SDK span processor that hands ended spans to ``collector`` (the SDK loaded only when the plugin is on)."""
    from opentelemetry.sdk.trace import SpanProcessor

    class Keeper(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            collector.keep(span)

    return Keeper()


def _provider_to_watch() -> TracerProvider:
    """The global SDK tracer provider the agent uses, set up when there is none yet."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        return provider
    mine = TracerProvider()
    trace.set_tracer_provider(mine)
    # set_tracer_provider is once per process: what it kept is the provider to watch.
    found = trace.get_tracer_provider()
    return found if isinstance(found, TracerProvider) else mine


class DurableCheckSession:
    """The plugin once enabled: the span collector, the rules, and each test's findings."""

    def __init__(self, config: pytest.Config) -> None:
        from processor.cmd_replay import load_config_or_none, load_exemptions
        from processor.convert import ConvertOptions

        self.config = config
        fail_on = str(_setting(config, "--durable-check-fail-on", "durable_check_fail_on"))
        if fail_on not in THRESHOLDS:
            raise pytest.UsageError(f"durable_check_fail_on: {fail_on!r} is not one of {', '.join(THRESHOLDS)}")
        self.fail_on = fail_on
        config_path = str(_setting(config, "--durable-check-config", "durable_check_config") or "") or None
        self.check_config: Config | None = load_config_or_none(config_path)
        self.packs = [str(p) for p in _setting(config, "--durable-check-pack", "durable_check_packs")]
        self.rules = [str(p) for p in config.getini("durable_check_rules")]
        self._rulesets: dict[tuple[str, ...], tuple[RuleSet, EngineOptions]] = {}
        self.rulesets(tuple(self.packs))  # a rule file that does not load stops the run here, said once
        waivers = str(_setting(config, "--durable-check-waivers", "durable_check_waivers") or "") or None
        # One baseline for the whole run: an entry accepts as many findings, across tests, as it counted.
        baseline = str(_setting(config, "--durable-check-baseline", "durable_check_baseline") or "") or None
        self.exemptions: Exemptions | None = load_exemptions(self.check_config, waivers, baseline)
        self.write_baseline = str(config.getoption("--durable-check-write-baseline") or "")
        self.convert_options = self.check_config.convert if self.check_config is not None else ConvertOptions()
        self.collector = _Collector()
        self.provider = _provider_to_watch()
        self.provider.add_span_processor(_span_processor(self.collector))
        self.results: list[tuple[str, Findings]] = []
        dump = str(_setting(config, "--durable-check-dump", "durable_check_dump") or "")
        try:
            # Written as the tests run: each test's spans one length-prefixed ExportTraceServiceRequest.
            self.dump = open(dump, "wb") if dump else None  # noqa: SIM115 (closed at the session's end)
        except OSError as exc:
            raise pytest.UsageError(f"durable_check_dump: cannot write {dump}: {exc.strerror or exc}") from None

    def rulesets(self, packs: tuple[str, ...]) -> tuple[RuleSet, EngineOptions]:
        from processor.cmd_replay import replay_rules

        if packs not in self._rulesets:
            self._rulesets[packs] = replay_rules(self.check_config, rules=self.rules, packs=list(packs))
        return self._rulesets[packs]

    def settings(self, item: pytest.Item) -> tuple[tuple[str, ...], str]:
        packs, fail_on = tuple(self.packs), self.fail_on
        marker = item.get_closest_marker("durable_check")
        if marker is not None:
            if marker.args:
                raise pytest.UsageError(f"{item.nodeid}: durable_check takes keywords: packs=..., fail_on=...")
            unknown = set(marker.kwargs) - {"packs", "fail_on"}
            if unknown:
                raise pytest.UsageError(f"{item.nodeid}: durable_check: unknown keyword(s) {sorted(unknown)}")
            if "packs" in marker.kwargs:
                chosen = marker.kwargs["packs"]
                packs = (chosen,) if isinstance(chosen, str) else tuple(chosen)
            if "fail_on" in marker.kwargs:
                fail_on = str(marker.kwargs["fail_on"])
                if fail_on not in THRESHOLDS:
                    raise pytest.UsageError(f"{item.nodeid}: durable_check fail_on={fail_on!r}: one of "
                                            f"{', '.join(THRESHOLDS)}")
        return packs, fail_on

    def evaluate(self, spans: Sequence[ReadableSpan], packs: tuple[str, ...], origin: str, *,
                 write_dump: bool = False) -> list[Violation]:
        """The spans checked as replay checks a dump of them."""
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        from processor.convert import SpanConverter
        from processor.evaluate.engine import Engine
        from processor.pipeline import Pipeline

        if not spans:
            return []
        ruleset, options = self.rulesets(packs)
        pipeline = Pipeline(Engine(ruleset, options))
        pipeline.exemptions = self.exemptions
        request = encode_spans(list(spans))
        if self.dump is not None and write_dump:
            body = request.SerializeToString()
            self.dump.write(len(body).to_bytes(4, "big") + body)
            self.dump.flush()
        result = SpanConverter(self.convert_options).convert(request, origin)
        found = pipeline.process([*result.actions, *result.rejected])
        found.extend(pipeline.finish())
        return found

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        _, fail_on = self.settings(item)
        item.stash[_FINDINGS] = Findings(fail_on=fail_on)
        self.collector.start()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]
                                  ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if call.when == "call":
            self._judge(item, report)
        return report

    def _judge(self, item: pytest.Item, report: pytest.TestReport) -> None:
        findings = item.stash.get(_FINDINGS, None)
        if findings is None:
            return
        packs, _ = self.settings(item)
        findings.violations = self.evaluate(self.collector.stop(), packs, item.nodeid, write_dump=True)
        self.results.append((item.nodeid, findings))
        for v in findings.violations:
            name = f"durable_check.{'waived.' if v.details.get('waived') else ''}{v.rule}"
            item.user_properties.append((name, describe(v)))
            report.user_properties.append((name, describe(v)))
        failing = findings.failing
        if failing and not findings.owned and report.passed:
            report.outcome = "failed"
            lines = [f"Durable Check: {len(failing)} finding(s) at or above {findings.fail_on} in {item.nodeid}"]
            lines += [f"  {describe(v)}" for v in failing]
            report.longrepr = "\n".join(lines)

    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        self.collector.stop()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.dump is not None:
            self.dump.close()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.write_baseline:
            from processor.waivers import write_baseline

            write_baseline(self.write_baseline, [v for _, findings in self.results for v in findings.violations])

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        tr = terminalreporter
        tr.section("durable-check")
        if self.exemptions is not None:
            for waiver in self.exemptions.expired:
                tr.write_line(f"waiver at {waiver.where} for {waiver.entry.rule} expired on "
                              f"{waiver.entry.expires}: its findings are errors again")
        total = waived = failed = 0
        for nodeid, findings in self.results:
            if not findings.violations:
                continue
            failing = {id(v) for v in findings.failing} if not findings.owned else set()
            for v in findings.violations:
                total += 1
                if v.details.get("waived"):
                    waived += 1
                    mark = "waived"
                elif id(v) in failing:
                    failed += 1
                    mark = "failed"
                else:
                    mark = "warning"
                tr.write_line(f"{nodeid}: [{mark}] {describe(v)}")
        tr.write_line(f"{len(self.results)} test(s) checked: {total} finding(s), {failed} failing, "
                      f"{waived} waived")


@pytest.fixture
def durable_findings(request: pytest.FixtureRequest) -> Findings:
    """The findings of this test's spans so far, evaluated when read (``durable_findings.rules``).

    The test owns them: they do not fail it on their own. Needs ``--durable-check``.
    """
    plugin = request.config.pluginmanager.get_plugin(_PLUGIN_NAME)
    if not isinstance(plugin, DurableCheckSession):
        raise pytest.UsageError("durable_findings needs Durable Check on: pytest --durable-check "
                                "(or durable_check = true in the ini file)")
    findings = request.node.stash[_FINDINGS]
    findings.owned = True
    return _LiveFindings(plugin, request.node, findings)


class _LiveFindings(Findings):
    """Findings read while the test runs: each read checks the spans ended so far."""

    def __init__(self, plugin: DurableCheckSession, item: pytest.Item, findings: Findings) -> None:
        super().__init__(fail_on=findings.fail_on, owned=True)
        self._plugin = plugin
        self._item = item

    @property
    def active(self) -> list[Violation]:
        self._refresh()
        return super().active

    @property
    def waived(self) -> list[Violation]:
        self._refresh()
        return super().waived

    def _refresh(self) -> None:
        packs, _ = self._plugin.settings(self._item)
        self.violations = self._plugin.evaluate(self._plugin.collector.peek(), packs, self._item.nodeid)

    def __iter__(self) -> Iterator[Violation]:
        self._refresh()
        return iter(self.violations)

    def __len__(self) -> int:
        self._refresh()
        return len(self.violations)
