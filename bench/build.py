"""Which build of durable-check the measured processes run: the checkout's sources or its compiled wheel.

``pip install .`` compiles the hot modules to C (hatch_build.py); an editable install,
which is what a checkout's benchmark imports, runs them as Python. ``--build compiled``
(``python -m bench``, ``python -m bench.soak_sessions``) builds the checkout's wheel once
per state of its sources, unpacks it under ``bench/out/`` and puts it first on the
measured processes' ``PYTHONPATH``; the benchmark's own modules still come from the
checkout. The choice travels to sub-processes in ``BENCH_DURABLE_CHECK_PATH``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
_OUT: Final = ROOT / "bench" / "out"
_ENV: Final = "BENCH_DURABLE_CHECK_PATH"
BUILDS: Final = ("source", "compiled")
# What the wheel is made of: a change to any of these is another build.
_INPUTS: Final = ("processor", "exporters", "durable_check", "rules", "pyproject.toml", "hatch_build.py")


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a measured process: the chosen build first on its path, then the checkout.

    ``PYTHONSAFEPATH``: ``python -m`` would otherwise put the working directory (the checkout,
    whose ``processor`` is the sources) before ``PYTHONPATH``.
    """
    chosen = os.environ.get(_ENV)
    path = f"{chosen}{os.pathsep}{ROOT}" if chosen else str(ROOT)
    return {**os.environ, "PYTHONPATH": path, "PYTHONSAFEPATH": "1", **extra}


def _to_stderr(message: str) -> None:
    sys.stderr.write(message + "\n")


def select(build: str, log: Callable[[str], None] = _to_stderr) -> None:
    """Make ``build`` the one measured processes import (and their own sub-processes); ``log``
    hears what it does (a wheel built, the build chosen), on stderr unless told otherwise."""
    if build == "source":
        os.environ.pop(_ENV, None)
        return
    if build != "compiled":
        raise ValueError(f"unknown build {build!r}; one of {', '.join(BUILDS)}")
    os.environ[_ENV] = str(_compiled(log))
    # What a measured process imports, asked of one: a build that is not the one chosen is no measurement.
    probe = subprocess.run(
        [sys.executable, "-c", "from processor._build import build_kind; print(build_kind())"],
        capture_output=True, text=True, check=False, cwd=ROOT, env=child_env(),
    )
    if probe.stdout.strip() != "compiled":
        raise RuntimeError(f"measured processes would not run the compiled build: {probe.stdout}{probe.stderr}")
    log(f"measuring the compiled build ({os.environ[_ENV]})")


def _compiled(log: Callable[[str], None]) -> Path:
    target = _OUT / f"compiled-{_sources_digest()}"
    if (target / "processor" / "__init__.py").is_file():
        return target
    log(f"building the compiled wheel of this checkout into {target.relative_to(ROOT)} (minutes, once) ...")
    with tempfile.TemporaryDirectory(prefix="bench-wheel-") as tmp:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", tmp, str(ROOT)],
            capture_output=True, text=True, check=False,
            env={**os.environ, "DURABLE_CHECK_COMPILE": "require", "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        )
        if result.returncode != 0:
            raise RuntimeError(f"building the compiled wheel failed:\n{result.stdout}{result.stderr}")
        (wheel,) = Path(tmp).glob("durable_check-*.whl")
        partial = target.with_name(f"{target.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(partial)
        for so in partial.rglob("*.so"):
            so.chmod(0o755)
        partial.replace(target)
    return target


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for name in _INPUTS:
        path = ROOT / name
        files = sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts) \
            if path.is_dir() else [path]
        for file in files:
            if file.suffix in (".pyc", ".so"):
                continue
            digest.update(file.relative_to(ROOT).as_posix().encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]
