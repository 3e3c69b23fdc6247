"""``--quick``: the subset of the suite worth running on every save while developing.

It leaves out what starts real peers or runs for long: the modules below (each with what makes
it slow), any test that uses a fixture starting a server or a browser, and any test marked
``slow`` or ``servers``. Those still run in the full suite, which ``scripts/test`` and CI run;
``--quick`` only deselects (a deselected test is not a skip).
"""

from __future__ import annotations

import pytest

# Modules whose every test starts a real peer or runs for long: kept in one place so the
# quick subset stays quick as the suite grows.
SLOW_MODULES: dict[str, str] = {
    "test_bench_smoke.py": "runs the benchmarks end to end",
    "test_collector.py": "a real OpenTelemetry Collector",
    "test_crash_recovery.py": "serve processes killed mid-stream",
    "test_evaluator_wedge.py": "serve processes held until their watchdog fires",
    "test_exporter_alertmanager.py": "a real Alertmanager",
    "test_exporter_prometheus.py": "a real Prometheus",
    "test_grafana_dashboard.py": "a real Prometheus",
    "test_helm_chart.py": "the Helm engine and Kubernetes schemas",
    "test_jsonl_rotation_holds.py": "serve processes through file rotations",
    "test_loglane.py": "random logs, many of them",
    "test_operate_view.py": "Chromium",
    "test_prometheus_rules.py": "promtool and a real Prometheus",
    "test_soak.py": "soaks",
    "test_typed_lines.py": "random logs, many of them",
    "test_wait_resolution_alert.py": "a real Prometheus and Alertmanager",
}
# Fixtures that start a real server or browser.
SLOW_FIXTURES = frozenset({"pg_server", "browser"})
SLOW_MARKERS = ("slow", "servers")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick", action="store_true", default=False,
        help="run the quick subset: leave out real servers, browsers, the Collector, soaks and long random runs",
    )


def is_slow(item: pytest.Item) -> bool:
    if item.path.name in SLOW_MODULES:
        return True
    if any(item.get_closest_marker(name) is not None for name in SLOW_MARKERS):
        return True
    return bool(SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--quick"):
        return
    kept = [item for item in items if not is_slow(item)]
    left_out = [item for item in items if is_slow(item)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
