"""lm_console/engine/startup_trace.py: silent by default; with LMC_STARTUP_TRACE, one parsable line per phase."""

from __future__ import annotations

import pytest

from lm_console.engine import startup_trace


def test_marks_are_silent_unless_asked(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(startup_trace.ENV_VAR, raising=False)
    monkeypatch.setattr(startup_trace, "_seen", set())
    startup_trace.mark("a")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(startup_trace.ENV_VAR, "0")
    startup_trace.mark("a")
    assert capsys.readouterr().err == ""


def test_each_phase_prints_once_and_parses(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(startup_trace.ENV_VAR, "1")
    monkeypatch.setattr(startup_trace, "_seen", set())
    startup_trace.mark("a")
    startup_trace.mark("b")
    startup_trace.mark("a")  # a second engine in the process: not a cold start's phase
    err = capsys.readouterr().err
    marks = startup_trace.parse_marks("other output\n" + err + "{broken\n")
    assert [phase for phase, *_ in marks] == ["a", "b"]
    assert marks[0][1] <= marks[1][1] and marks[0][2] <= marks[1][2]
