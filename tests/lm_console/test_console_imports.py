"""The console's start-up path imports no torch (STYLE rule 12)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import lm_console.tui.app, lm_console.cli_console, lm_console.client, lm_console.chat_repl
from lm_console.client import AsyncLLMConsoleClient
heavy = sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules)
print(','.join(heavy))
"""


def test_tui_imports_no_torch() -> None:
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"the TUI imported {result.stdout.strip()}"
