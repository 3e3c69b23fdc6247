"""`durable-check convert`: records out in the skill's format, and output mistakes as clear errors."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from processor import cli

FIXTURES = Path(__file__).parent / "testdata" / "skill-fixtures"


def test_convert_writes_records_the_action_log_reader_reads_back(tmp_path: Path) -> None:
    out = tmp_path / "records.jsonl"
    assert cli.main(["convert", str(FIXTURES / "actions.good.jsonl"), "-o", str(out)]) == 0
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["action_id"] for r in records] == [f"a{i:02d}" for i in range(1, 11)]
    # A null result stays recorded: the key is kept.
    assert "result" in records[7] and records[7]["result"] is None
    assert cli.main(["replay", str(out)]) == 0


def test_convert_refuses_to_overwrite_its_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log.jsonl"
    log.write_bytes((FIXTURES / "actions.good.jsonl").read_bytes())
    before = log.read_bytes()
    assert cli.main(["convert", str(log), "-o", str(log)]) == 2
    assert log.read_bytes() == before
    assert "is also an input" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["a-directory", "missing-dir/out.jsonl"])
def test_convert_names_an_output_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    (tmp_path / "a-directory").mkdir()
    code = cli.main(["convert", str(FIXTURES / "actions.good.jsonl"), "-o", str(tmp_path / target)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / target}" in err
    assert "Traceback" not in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a device every write to fails")
@pytest.mark.parametrize(
    "argv",
    [["convert", str(FIXTURES / "actions.good.jsonl"), "-o", "/dev/full"], ["rules", "list"]],
    ids=["convert-output", "rules-list-stdout"],
)
def test_output_that_cannot_be_written_is_one_line_and_exit_2(argv: list[str]) -> None:
    """Any command whose output hits a full disk (here /dev/full) says so once, exit 2, no traceback."""
    import subprocess
    import sys

    with open("/dev/full", "wb") as full:
        done = subprocess.run([sys.executable, "-m", "processor.cli", *argv], stdout=full, stderr=subprocess.PIPE,
                              check=False, timeout=120)
    assert done.returncode == 2
    assert done.stderr.decode().splitlines()[-1] == "durable-check: No space left on device"
    assert b"Traceback" not in done.stderr and b"Exception ignored" not in done.stderr
