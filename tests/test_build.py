"""The two builds: the hot modules compiled by mypyc (a regular wheel) or pure Python.

CI runs the whole suite on each (``scripts/test`` places the compiled wheel's extensions beside
their sources and sets ``DURABLE_CHECK_EXPECT_BUILD``); these tests check that the build
under test is the one asked for, whole, and that the wheel build hook (hatch_build.py)
decides as documented.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from processor._build import build_kind, is_source_module
from processor.cli import build_parser

REPO = Path(__file__).resolve().parents[1]


def _compiled_modules() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    paths = config["tool"]["hatch"]["build"]["targets"]["wheel"]["hooks"]["custom"]["compiled-modules"]
    return [path.removesuffix(".py").replace("/", ".") for path in paths]


def test_the_compiled_modules_are_compiled_together_or_not_at_all() -> None:
    modules = _compiled_modules()
    assert "processor.evaluate.engine" in modules
    from_source = {name: is_source_module(name) for name in modules}
    assert len(set(from_source.values())) == 1, f"a partly compiled build: {from_source}"
    expected = os.environ.get("DURABLE_CHECK_EXPECT_BUILD")
    if expected is not None:
        assert build_kind() == expected


def test_version_names_the_build(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--version"])
    assert capsys.readouterr().out.strip().endswith(f"({build_kind()})")


def _wheel(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # -v: pip shows the build backend's output (the hook's message) only when verbose.
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "--wheel-dir", str(tmp_path),
         str(REPO)],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **env},
    )


def _tag(tmp_path: Path) -> str:
    (wheel,) = tmp_path.glob("durable_check-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (name,) = (n for n in archive.namelist() if n.endswith(".dist-info/WHEEL"))
        text = archive.read(name).decode()
        assert not [n for n in archive.namelist() if n.endswith(".so")]
    return next(line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("Tag: "))


def test_a_wheel_asked_not_to_compile_is_pure_python(tmp_path: Path) -> None:
    result = _wheel(tmp_path, DURABLE_CHECK_COMPILE="0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert _tag(tmp_path) == "py3-none-any"
    # The pytest plugin ships in the wheel, registered the standard way (off until asked).
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (entry_points,) = (n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt"))
        assert "durable_check/pytest_plugin.py" in archive.namelist()
        assert "[pytest11]\ndurable_check = durable_check.pytest_plugin" in archive.read(entry_points).decode()


def test_without_a_c_compiler_the_wheel_is_pure_python_and_says_so(tmp_path: Path) -> None:
    result = _wheel(tmp_path, CC="/nonexistent/cc")
    assert result.returncode == 0, result.stdout + result.stderr
    assert _tag(tmp_path) == "py3-none-any"
    assert "no C compiler (/nonexistent/cc); building a pure-Python wheel" in result.stdout + result.stderr


def test_a_required_compile_without_a_compiler_fails_naming_why(tmp_path: Path) -> None:
    result = _wheel(tmp_path, CC="/nonexistent/cc", DURABLE_CHECK_COMPILE="require")
    assert result.returncode != 0
    assert "DURABLE_CHECK_COMPILE=require, but no C compiler (/nonexistent/cc)" in result.stdout + result.stderr
    assert not list(tmp_path.glob("*.whl"))


def test_an_unknown_compile_switch_is_refused_naming_it(tmp_path: Path) -> None:
    result = _wheel(tmp_path, DURABLE_CHECK_COMPILE="sometimes")
    assert result.returncode != 0
    assert "DURABLE_CHECK_COMPILE='sometimes': expected one of" in result.stdout + result.stderr


# Calls that read a whole iterable argument at once: a generator expression passed straight to
# one of them is a list in the compiled build too, with no cost the source does not have.
_EAGER_CONSUMERS = frozenset({
    "any", "all", "sum", "tuple", "list", "set", "frozenset", "dict", "sorted", "min", "max",
    "join", "extend", "update", "array",
})  # fmt: skip


def test_compiled_modules_use_generator_expressions_only_where_they_are_read_at_once() -> None:
    """mypyc compiles a generator expression to a list: lazily read (a loop over it, a name
    bound to it, ``next``, an iterator handed on), it would hold all its items at once. Such
    code is a generator function or a loop in the compiled modules."""
    found = []
    for module in _compiled_modules():
        path = REPO / (module.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.GeneratorExp):
                continue
            parent = parents[node]
            if isinstance(parent, ast.Starred):
                continue  # a call's unpacked arguments are read at once by Python itself
            if isinstance(parent, ast.Call) and node in parent.args:
                func = parent.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if name in _EAGER_CONSUMERS:
                    continue
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not found, "generator expressions read lazily in compiled modules:\n" + "\n".join(found)
