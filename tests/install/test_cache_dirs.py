"""Every file lm-console keeps between runs goes under one root that the cache settings name."""

from __future__ import annotations

from pathlib import Path

import pytest

from lm_console.engine.cache_dirs import cache_root, log_dir
from lm_console.engine.models import embedded
from lm_console.kernels import cpu_build
from lm_console.tui.stderr_capture import default_log_path


@pytest.fixture
def no_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("LMC_CACHE_DIR", "XDG_CACHE_HOME", "LMC_LOG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def roots() -> dict[str, Path]:
    return {"models": embedded.cache_dir(), "kernels": cpu_build.cache_dir().parent,
            "logs": default_log_path().parent.parent, "log_dir": log_dir().parent}


def test_default_root_is_under_home(no_settings: Path) -> None:
    expected = no_settings / "home" / ".cache" / "lm-console"
    assert cache_root() == expected
    assert set(roots().values()) == {expected}


def test_xdg_cache_home_moves_models_kernels_and_logs(no_settings: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(no_settings / "xdg"))
    assert set(roots().values()) == {no_settings / "xdg" / "lm-console"}
    assert default_log_path().parent == no_settings / "xdg" / "lm-console" / "logs"


def test_lmc_cache_dir_moves_everything(no_settings: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(no_settings / "xdg"))
    monkeypatch.setenv("LMC_CACHE_DIR", str(no_settings / "lmc"))
    assert set(roots().values()) == {no_settings / "lmc"}
    assert default_log_path().parent == no_settings / "lmc" / "logs"
    assert not (no_settings / "home" / ".cache").exists()


def test_lmc_log_dir_overrides_the_log_directory_alone(no_settings: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMC_CACHE_DIR", str(no_settings / "lmc"))
    monkeypatch.setenv("LMC_LOG_DIR", str(no_settings / "logs"))
    assert default_log_path().parent == no_settings / "logs"
    assert embedded.cache_dir() == no_settings / "lmc"
