"""`convert` and `replay` agree record for record on the span dumps the suite keeps.

The framework runs (tests/test_frameworks_openai.py, tests/test_framework_*.py) check the same
on the dumps they make with the real libraries, through ``serve_and_replay`` and ``replay_report``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.convert_parity import assert_convert_agrees_with_replay, converted_records

TESTDATA = Path(__file__).parent / "testdata"
DUMPS = sorted([*TESTDATA.glob("convert/*.otlp.json"),
                *(path for path in TESTDATA.glob("readers/spans.*") if ".golden." not in path.name)])


@pytest.mark.parametrize("dump", DUMPS, ids=lambda path: path.name)
def test_convert_writes_the_records_replay_evaluates(dump: Path, tmp_path: Path) -> None:
    copy = tmp_path / dump.name
    shutil.copy(dump, copy)
    assert assert_convert_agrees_with_replay(copy) > 0


def test_convert_joins_a_session_named_on_one_span_only_as_replay_does(tmp_path: Path) -> None:
    # OpenLLMetry names the conversation on its workflow span only: the other spans of the trace
    # belong to it (before the identity stage ran in convert, they were sessions of their own).
    copy = tmp_path / "openllmetry.otlp.json"
    shutil.copy(TESTDATA / "convert" / "openllmetry.otlp.json", copy)
    sessions = {record["session_id"] for record in converted_records(copy)}
    assert len(sessions) == 1, sessions
