#!/usr/bin/env python3
"""Render the durable-check chart with each ci/ values file into examples/.

    python deploy/helm/render-examples.py           # rewrite examples/
    python deploy/helm/render-examples.py --check   # exit 1 and list what differs

It first refreshes the chart's copies of the alert rules (files/prometheus-alerts.yaml,
from config/prometheus-alerts.yaml) and of the Grafana dashboard
(files/grafana-dashboard.json, from deploy/grafana/): Helm reads files inside the chart only.

For every ``ci/<name>.yaml`` the manifests go to ``examples/<name>/rendered/<template>``,
one file per template, as ``helm template example <chart> -n default -f ci/<name>.yaml``
prints them. A reviewer sees in the diff what a change of the chart does to real
manifests; tests/test_helm_chart.py fails when examples/ is out of date.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import helm_python as helm
import yaml

CHART_DIR = Path(__file__).resolve().parent / "durable-check"
ALERT_RULES = CHART_DIR.parent.parent.parent / "config" / "prometheus-alerts.yaml"
ALERT_RULES_COPY = Path("files") / "prometheus-alerts.yaml"
DASHBOARD = CHART_DIR.parent.parent / "grafana" / "durable-check.json"
DASHBOARD_COPY = Path("files") / "grafana-dashboard.json"
RELEASE_NAME = "example"
NAMESPACE = "default"


def ci_values_files(chart_dir: Path = CHART_DIR) -> list[Path]:
    return sorted((chart_dir / "ci").glob("*.yaml"))


def render(chart_dir: Path, values: dict[str, object]) -> dict[str, str]:
    """Rendered manifests by template path, without NOTES.txt and templates that render to nothing."""
    with helm.Chart.load(str(chart_dir)) as chart:
        rendered = chart.render(values, name=RELEASE_NAME, namespace=NAMESPACE)
    return {
        path: text
        for path, text in sorted(rendered.items())
        if not path.endswith("NOTES.txt") and text.strip()
    }


def render_examples(chart_dir: Path = CHART_DIR) -> dict[Path, str]:
    """Every example file (relative to the chart directory) and its content."""
    files: dict[Path, str] = {}
    for values_file in ci_values_files(chart_dir):
        values = yaml.safe_load(values_file.read_text(encoding="utf-8")) or {}
        for template_path, text in render(chart_dir, values).items():
            target = Path("examples") / values_file.stem / "rendered" / Path(template_path).name
            files[target] = f"---\n# Source: {template_path}\n{text.strip()}\n"
    return files


def differences(chart_dir: Path = CHART_DIR) -> list[str]:
    """What differs between examples/ on disk and a fresh rendering; empty when up to date."""
    problems = []
    if (chart_dir / ALERT_RULES_COPY).read_bytes() != ALERT_RULES.read_bytes():
        problems.append(f"{ALERT_RULES_COPY}: differs from {ALERT_RULES.name} in config/")
    if (chart_dir / DASHBOARD_COPY).read_bytes() != DASHBOARD.read_bytes():
        problems.append(f"{DASHBOARD_COPY}: differs from deploy/grafana/{DASHBOARD.name}")
    expected = render_examples(chart_dir)
    for path, text in expected.items():
        on_disk = chart_dir / path
        if not on_disk.is_file():
            problems.append(f"{path}: missing")
        elif on_disk.read_text(encoding="utf-8") != text:
            problems.append(f"{path}: differs from the rendered chart")
    for on_disk in sorted((chart_dir / "examples").rglob("*.yaml")):
        relative = on_disk.relative_to(chart_dir)
        if relative not in expected:
            problems.append(f"{relative}: no ci/ values file renders it any more")
    return problems


def write_examples(chart_dir: Path = CHART_DIR) -> list[Path]:
    """Refresh the alert rules copy, rewrite examples/ from scratch; returns the files written."""
    (chart_dir / ALERT_RULES_COPY).write_bytes(ALERT_RULES.read_bytes())
    (chart_dir / DASHBOARD_COPY).write_bytes(DASHBOARD.read_bytes())
    expected = render_examples(chart_dir)
    for stale in sorted((chart_dir / "examples").rglob("*.yaml")):
        if stale.relative_to(chart_dir) not in expected:
            stale.unlink()
    for path, text in expected.items():
        target = chart_dir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    for directory in sorted((chart_dir / "examples").rglob("*"), reverse=True):
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
    return [ALERT_RULES_COPY, DASHBOARD_COPY, *sorted(expected)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when examples/ is out of date")
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = differences()
            for problem in problems:
                print(problem, file=sys.stderr)
            if problems:
                print("the chart's generated files are out of date: run deploy/helm/render-examples.py",
                      file=sys.stderr)
                return 1
            return 0
        for path in write_examples():
            print(path)
    except helm.HelmError as exc:
        print(f"render-examples: the chart does not render: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
