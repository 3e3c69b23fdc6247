"""Wheel build hook: the hot modules compiled to C extensions by mypyc.

The modules listed under ``compiled-modules`` in ``pyproject.toml`` (the engine, the span
converter, the session state, the reports: the code every record goes through) are
plain, strictly typed Python; mypyc turns each into a C extension that runs the same
code 1.35-1.83x faster on the engine's paths (docs/performance.md, "The compiled
build"). The sources stay in the wheel beside them and stay the reference: the test
suite runs on both builds.

When it compiles:
- a regular wheel (``pip install .``, ``pip wheel .``, the container): yes, when a C
  compiler and the Python headers are there; without them the wheel is pure Python and
  the build says so on stderr;
- an editable install (``pip install -e .``): never, so that an edited source is what runs;
- ``DURABLE_CHECK_COMPILE=0``: never; ``DURABLE_CHECK_COMPILE=require``: fail rather than
  fall back to pure Python.

A mypyc error (a construct it does not support) fails the build: it is a bug to fix in
the module, never a reason to ship a wheel that differs from what was asked.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

_SWITCH = "DURABLE_CHECK_COMPILE"
# auto (compile when possible), 0 (never), require (compile or fail); the usual spellings of yes and no.
_SWITCH_VALUES = frozenset({"auto", "1", "yes", "true", "on", "0", "no", "false", "off", "require"})


class CompiledModules(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        switch = os.environ.get(_SWITCH, "auto").strip().lower() or "auto"
        if switch not in _SWITCH_VALUES:
            raise RuntimeError(f"{_SWITCH}={switch!r}: expected one of {', '.join(sorted(_SWITCH_VALUES))}")
        if switch in ("0", "no", "false", "off"):
            return
        modules = list(self.config.get("compiled-modules", []))
        if not modules:
            return
        missing = _missing_toolchain()
        if missing:
            if switch == "require":
                raise RuntimeError(f"{_SWITCH}=require, but {missing}: cannot compile {len(modules)} modules")
            sys.stderr.write(f"durable-check build: {missing}; building a pure-Python wheel\n")
            return
        self._work = tempfile.TemporaryDirectory(prefix="durable-check-mypyc-")
        built = _compile(Path(self.root), modules, Path(self._work.name))
        for path, target in built:
            build_data["force_include"][str(path)] = target
        # C extensions: the wheel is for this interpreter and platform only.
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        work = getattr(self, "_work", None)
        if work is not None:
            work.cleanup()


def _missing_toolchain() -> str | None:
    compiler = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    if shutil.which(compiler.split()[0]) is None:
        return f"no C compiler ({compiler.split()[0]})"
    include = sysconfig.get_paths().get("include")
    if not include or not (Path(include) / "Python.h").is_file():
        return "no Python headers (Python.h)"
    return None


def _compile(root: Path, modules: list[str], work: Path) -> list[tuple[Path, str]]:
    """Compile ``modules`` (paths from the project root); (built file, its path in the wheel)."""
    from mypyc.build import mypycify
    from setuptools import Distribution
    from setuptools.command.build_ext import build_ext

    for module in modules:
        if not (root / module).is_file():
            raise RuntimeError(f"pyproject.toml: compiled-modules: {module} is not a file")
    out = work / "lib"
    cwd = Path.cwd()
    os.chdir(root)  # mypyc names modules by their paths from here
    try:
        extensions = mypycify(
            # Third-party packages are not installed where the wheel is built: what mypyc
            # cannot see it treats as untyped, which changes nothing in the compiled code.
            # ``--no-site-packages``: nor does it look for them in the interpreter's own
            # site-packages, which a concurrent ``pip install`` may be rewriting (a build
            # once read orjson's stubs half replaced and failed); the build is the same
            # whatever the machine has installed.
            ["--config-file=", "--ignore-missing-imports", "--follow-imports=silent", "--no-site-packages",
             *modules],
            opt_level="3",
            target_dir=str(work / "c"),
        )
        command = build_ext(Distribution({"ext_modules": extensions, "name": "durable-check-compiled"}))
        command.build_lib = str(out)
        command.build_temp = str(work / "temp")
        command.ensure_finalized()
        command.run()
    finally:
        os.chdir(cwd)
    built = [(path, path.relative_to(out).as_posix()) for path in sorted(out.rglob("*")) if path.is_file()]
    if not built:
        raise RuntimeError("mypyc built nothing")
    return built
