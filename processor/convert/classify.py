"""Tool name -> action kind, by the configured glob rules (first match wins)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from typing import Final

from processor.convert.options import ToolKindRule

# Tool names are few per deployment; the bound only guards against ids leaking into names.
_CACHE_LIMIT: Final = 4096


class ToolClassifier:
    """All rules compiled into one regex: each alternative is a named group, tried in order."""

    def __init__(self, rules: Sequence[ToolKindRule]) -> None:
        self._kinds = [rule.kind for rule in rules]
        alternatives = [
            f"(?P<r{index}>{fnmatch.translate(rule.pattern)})" for index, rule in enumerate(rules) if rule.pattern
        ]
        self._regex = re.compile("|".join(alternatives), re.IGNORECASE | re.DOTALL) if alternatives else None
        self._cache: dict[str, str | None] = {}

    def classify(self, tool_name: str) -> str | None:
        """The kind of the first rule whose pattern matches the whole name, or None."""
        try:
            return self._cache[tool_name]
        except KeyError:
            pass
        kind: str | None = None
        if self._regex is not None:
            match = self._regex.fullmatch(tool_name)
            if match is not None and match.lastgroup is not None:
                kind = self._kinds[int(match.lastgroup[1:])]
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[tool_name] = kind
        return kind
