"""Which build is running: the hot modules compiled to C by mypyc, or pure Python.

A regular wheel compiles the modules ``pyproject.toml`` lists (hatch_build.py); an
editable install and a machine without a C compiler run them as Python. Both give the
same verdicts (the test suite runs on both); the compiled one is faster.
"""

from __future__ import annotations

from importlib.util import find_spec

# One of the compiled modules: they are compiled together or not at all.
_PROBE = "processor.evaluate.engine"


def build_kind() -> str:
    """``compiled`` or ``pure Python``."""
    return "pure Python" if is_source_module(_PROBE) else "compiled"


def is_source_module(name: str) -> bool:
    """Whether the module ``name`` would be loaded from its Python source (not a C extension)."""
    spec = find_spec(name)
    origin = spec.origin if spec is not None else None
    return origin is not None and origin.endswith(".py")
