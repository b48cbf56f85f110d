"""Keep the engine's stderr off the screen while the TUI runs.

Textual draws on stderr (fd 2), and the engine core (a child process) and C extensions write
their logs to fd 2 as well. While the app runs, Textual gets a duplicate of the terminal and
fd 2 goes to a log file, which the engine-dead panel quotes.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from lm_console.engine.cache_dirs import log_dir


def default_log_path() -> Path:
    """console-<pid>.log in the log directory under lm-console's cache root (created here)."""
    directory = log_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"console-{os.getpid()}.log"


@contextlib.contextmanager
def stderr_to_log(path: Path) -> Iterator[Path]:
    """Point fd 2 at `path` and sys.__stderr__ (Textual's output) at the terminal, then restore."""
    stream = sys.__stderr__
    if stream is None or not stream.isatty():
        yield path
        return
    stream.flush()
    terminal_fd = os.dup(2)
    terminal = os.fdopen(terminal_fd, "w", buffering=1, encoding=stream.encoding or "utf-8", closefd=False)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.__stderr__ = terminal
    try:
        yield path
    finally:
        terminal.flush()
        os.dup2(terminal_fd, 2)
        os.close(terminal_fd)
        sys.__stderr__ = stream


def log_tail(path: Path | None, num_lines: int = 6) -> str:
    """The last lines of the log, or '' when there is none."""
    if path is None or not path.exists():
        return ""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(line for line in lines[-num_lines:] if line.strip())
