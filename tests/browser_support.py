"""Debian's Chromium driven by Playwright (never Playwright's own browser download), and screenshot artifacts."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

ARTIFACTS = Path(__file__).parent / "artifacts"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = shutil.which("chromium")
    assert executable, "Debian's chromium is needed (scripts/test installs it)"
    with sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        try:
            yield launched
        finally:
            launched.close()


def screenshot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def unlabelled_controls(page: Page) -> list[dict[str, Any]]:
    """Interactive nodes of Chromium's accessibility tree that have no accessible name."""
    cdp = page.context.new_cdp_session(page)
    try:
        tree = cdp.send("Accessibility.getFullAXTree")
    finally:
        cdp.detach()
    interactive = {"link", "button", "combobox", "textbox", "checkbox", "radio", "listbox", "searchbox"}
    out = []
    for node in tree["nodes"]:
        role = (node.get("role") or {}).get("value")
        if node.get("ignored") or role not in interactive:
            continue
        name = ((node.get("name") or {}).get("value") or "").strip()
        if not name:
            out.append({"role": role, "node": node.get("backendDOMNodeId")})
    return out


def interactive_roles(page: Page) -> list[tuple[str, str]]:
    cdp = page.context.new_cdp_session(page)
    try:
        tree = cdp.send("Accessibility.getFullAXTree")
    finally:
        cdp.detach()
    found = []
    for node in tree["nodes"]:
        role = (node.get("role") or {}).get("value")
        if not node.get("ignored") and role in {"link", "button", "combobox", "textbox"}:
            found.append((role, ((node.get("name") or {}).get("value") or "")))
    return found
