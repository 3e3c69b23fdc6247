"""``durable-check replay`` end to end: exit codes, the verdict line, what the text report prints."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from processor import cli

REPO = Path(__file__).resolve().parent.parent

FIXTURES = Path(__file__).parent / "testdata" / "skill-fixtures"
SPANS_JSONL = Path(__file__).parent / "testdata" / "readers" / "spans.otlp.jsonl"

EXPECTED_BAD = [
    (4, "DS001"), (5, "DS001"), (6, "DS002"), (7, "DS003"), (8, "DS004"),
    (9, "DS005"), (10, "DS006"), (10, "DS007"), (12, "DS009"), (13, "DS000"),
]  # fmt: skip


def _replay(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["replay", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _record(action_id: str, **fields: Any) -> bytes:
    base = {"session_id": "s", "action_id": action_id, "kind": "tool_call", "status": "ok", "result": None}
    return orjson.dumps({**base, **fields}) + b"\n"


def _verdicts(report: dict[str, Any]) -> list[tuple[int, str]]:
    return [(v["line"], v["rule"]) for v in report["violations"]]


def test_skill_fixture_verdicts_are_kept(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _replay(capsys, "--format", "json", str(FIXTURES / "actions.bad.jsonl"))
    assert code == 1 and _verdicts(orjson.loads(out)) == EXPECTED_BAD
    code, out, _ = _replay(capsys, "--format", "json", "--strict", str(FIXTURES / "actions.bad.jsonl"))
    assert code == 1 and _verdicts(orjson.loads(out)) == sorted([*EXPECTED_BAD, (11, "DS008")])
    code, out, _ = _replay(capsys, str(FIXTURES / "actions.good.jsonl"))
    assert code == 0 and out.splitlines()[-1] == "OK: 10 action(s), no violations"


def test_a_cut_gzip_log_is_unreadable_after_the_violations_before_the_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = _record("unkeyed", kind="payment") + b"".join(_record(f"a{i}", pad="x" * 300) for i in range(3000))
    packed = gzip.compress(body, compresslevel=1)
    target = tmp_path / "cut.jsonl.gz"
    target.write_bytes(packed[: len(packed) // 2])
    code, out, err = _replay(capsys, str(target))
    assert code == 2
    assert out.splitlines()[0].startswith("line 1 [unkeyed]: DS002 ")
    assert out.splitlines()[-1].startswith("ERROR: 1 input(s) could not be read (see standard error); 1 violation(s)")
    assert f"{target}: gzip stream truncated after line " in err
    code, out, _ = _replay(capsys, "--format", "json", str(target))
    report = orjson.loads(out)
    assert code == 2 and [v["rule"] for v in report["violations"]] == ["DS002"]
    assert len(report["unreadable"]) == 1 and "gzip stream truncated after line" in report["unreadable"][0]


@pytest.mark.parametrize("kind", ["missing", "directory", "binary"])
def test_an_unreadable_input_is_an_error_said_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    target = tmp_path / "input"
    if kind == "directory":
        target.mkdir()
    elif kind == "binary":
        target.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    code, out, err = _replay(capsys, str(target))
    assert code == 2
    assert out.splitlines() == [
        "sessions: 0 session(s), 0 action(s) evaluated",
        "ERROR: 1 input(s) could not be read (see standard error); 0 action(s), no violations",
    ]
    assert err.count(str(target)) == 1 and "OK" not in out


def test_malformed_lines_fail_even_without_ds000(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log.jsonl"
    log.write_bytes(_record("a1") + b"{not json\n" + _record("a2"))
    off = tmp_path / "off.yaml"
    off.write_text("version: 1\noverrides:\n  - id: DS000\n    enabled: false\n", encoding="utf-8")
    for extra in (["--no-shipped-rules"], ["--rules", str(off)]):
        code, out, _ = _replay(capsys, *extra, str(log))
        assert code == 1
        assert out.splitlines()[-1] == "FAIL: 2 action(s), no violations; 1 malformed item(s) not checked"
    code, out, _ = _replay(capsys, str(log))
    assert code == 1 and out.splitlines()[-1].startswith("FAIL: 1 violation(s) in 2 action(s) [DS000×1]")


def test_span_violations_name_session_action_trace_and_span(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _replay(capsys, str(SPANS_JSONL))
    assert code == 1
    ds001 = next(line for line in out.splitlines() if " DS001 " in line)
    assert ds001.startswith(
        "line 2: session conv-9 action span-a1b2c3d40000000f "
        "trace 0af7651916cd43dd8448eb211c80319c span a1b2c3d40000000f: DS001 unrecorded-result: "
    )


def test_control_characters_from_the_input_are_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log.jsonl"
    log.write_bytes(
        _record("\x1b]0;owned\x07", kind="payment", session_id="s\x1b[2J")
        + _record("a2", kind="odd\x9bkind", session_id="s\x1b[2J")
    )
    code, out, _ = _replay(capsys, str(log))
    assert code == 1
    assert not any(ch in out for ch in "\x1b\x07\x9b")
    assert "line 1 [\\x1b]0;owned\\x07]: DS002 unkeyed-side-effect: payment \\x1b]0;owned\\x07 succeeded" in out
    assert "session s\\x1b[2J: 2 action(s) [odd\\x9bkind×1, payment×1]" in out


def test_duplicate_deliveries_count_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = SPANS_JSONL.read_bytes().splitlines()[0]
    single = tmp_path / "once.jsonl"
    single.write_bytes(first + b"\n")
    twice = tmp_path / "twice.jsonl"
    twice.write_bytes(first + b"\n" + first + b"\n")
    _, once, _ = _replay(capsys, "--format", "json", str(single))
    code, out, _ = _replay(capsys, "--format", "json", str(twice))
    report = orjson.loads(out)
    assert code == 1 and report["duplicates"] > 0
    # The second copy adds nothing: the same actions are evaluated as from one copy.
    assert report["actions"] == orjson.loads(once)["actions"]
    assert report["actions"] == report["actions_evaluated"] == report["actions_seen"] - report["duplicates"]
    _, text, _ = _replay(capsys, str(twice))
    assert f"in {report['actions']} action(s)" in text.splitlines()[-1]
    assert f"{report['duplicates']} duplicate deliveries skipped" in text


def test_stdin_is_named_alike_in_inputs_and_violations(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    other = tmp_path / "a.jsonl"
    other.write_bytes(_record("from-file", kind="payment"))

    class _Stdin:
        buffer = io.BytesIO(_record("from-stdin", kind="payment"))

    monkeypatch.setattr("sys.stdin", _Stdin())
    code, out, _ = _replay(capsys, "--format", "json", "-", str(other))
    report = orjson.loads(out)
    assert code == 1 and report["inputs"] == ["<stdin>", str(other)]
    # Ordered by input: standard input was named first.
    assert [(v["origin"], v["action_id"]) for v in report["violations"]] == [
        ("<stdin>", "from-stdin"),
        (str(other), "from-file"),
    ]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a device every write to fails")
@pytest.mark.parametrize(
    "extra",
    [[], ["--format", "json"], ["--full-engine"], ["--format", "sarif"], ["--output", "/dev/full"]],
    ids=["lane-text", "lane-json", "engine-text", "engine-sarif", "output-option"],
)
def test_a_report_that_cannot_be_written_is_one_clear_error(tmp_path: Path, extra: list[str]) -> None:
    """A full disk (here /dev/full) is said once, naming where the report went, exit 2: no traceback,
    and nothing more when the process ends with standard output still holding what it could not write."""
    import subprocess
    import sys

    log = tmp_path / "actions.jsonl"
    log.write_bytes(b"".join(_record(f"a{n}", kind="payment") for n in range(3000)))
    with open("/dev/full", "wb") as full:
        done = subprocess.run([sys.executable, "-m", "processor.cli", "replay", *extra, str(log)], stdout=full,
                              stderr=subprocess.PIPE, check=False, timeout=120)
    where = "--output /dev/full" if "--output" in extra else "standard output"
    assert done.returncode == 2
    assert done.stderr.decode() == f"durable-check: cannot write the report to {where} (No space left on device)\n"


def test_the_command_line_process_ends_with_everything_written_and_its_exit_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m processor.cli replay`` ends its process without tearing the interpreter down:
    the report it still buffered is written out, and the exit code is the command's."""
    import subprocess
    import sys

    bad = str(FIXTURES / "actions.bad.jsonl")
    expected_code, expected, _ = _replay(capsys, bad)
    done = subprocess.run([sys.executable, "-m", "processor.cli", "replay", bad], capture_output=True, check=False,
                          timeout=120)
    assert (done.returncode, done.stdout.decode()) == (expected_code, expected) == (1, expected)
    assert b"Traceback" not in done.stderr


@pytest.mark.parametrize("output", ["pipe", "closed-pipe", "full-device"])
def test_the_quick_exit_writes_what_is_buffered_or_says_why_it_cannot(output: str) -> None:
    """What standard output and the logs still hold when a command has answered is written, and
    the exit handlers run, before the process ends; a reader that left early is no error, a
    full disk is exit 2."""
    import os
    import subprocess
    import sys

    if output == "full-device" and not Path("/dev/full").exists():
        pytest.skip("needs /dev/full, a device every write to fails")
    script = ("import atexit, logging, sys; from processor import cli; "
              "atexit.register(lambda: sys.stderr.write('exit handler ran\\n')); "
              "logging.basicConfig(); logging.getLogger('durable_check').warning('said before the end'); "
              "sys.stdout.write('x' * 1000); cli._exit_now(1)")
    command = [sys.executable, "-c", script]
    # Standard output buffered, as it is by default when it is not a terminal: the quick exit writes it.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    if output == "pipe":
        done = subprocess.run(command, capture_output=True, check=False, timeout=60, env=env)
        assert (done.returncode, done.stdout) == (1, b"x" * 1000)
        assert b"said before the end" in done.stderr and b"exit handler ran" in done.stderr
    elif output == "closed-pipe":
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()  # the reader leaves before the first byte
        stderr = process.stderr.read()
        assert process.wait(timeout=60) == 1
        assert b"Traceback" not in stderr and b"Exception ignored" not in stderr
    else:
        with open("/dev/full", "wb") as full:
            done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, check=False, timeout=60, env=env)
        assert done.returncode == 2
        assert done.stderr.decode().splitlines()[-1] == (
            "durable-check: cannot write to standard output (No space left on device)")


def test_ctrl_c_during_a_long_replay_says_so_in_one_line_and_exits_130(tmp_path: Path) -> None:
    import signal

    log = tmp_path / "long.jsonl"
    subprocess.run([sys.executable, "-m", "bench.generate", "actions", "--records", "400000", str(log)],
                   cwd=REPO, check=True, capture_output=True, timeout=120)
    # As from a terminal: a suite started in the background inherits SIGINT ignored, and Python then
    # keeps it ignored in the child (what nohup relies on), so the child gets the default back.
    replay = subprocess.Popen([sys.executable, "-m", "processor.cli", "replay", "--full-engine", str(log)],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)},
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        time.sleep(1.5)  # well inside the replay: 400,000 lines take many seconds on the full engine
        assert replay.poll() is None, "the replay ended before it could be interrupted"
        replay.send_signal(signal.SIGINT)
        _, stderr = replay.communicate(timeout=30)
    finally:
        replay.kill()
    assert replay.returncode == 130
    assert stderr.strip() == "durable-check: replay interrupted; what it wrote so far is incomplete"
