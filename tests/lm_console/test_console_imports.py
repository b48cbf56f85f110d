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

# `lmc tui --url` and friends: the remote client and everything it imports while it attaches
# (the console stream's wire types, the /metrics parser, ZMQ KV events, bench and batch over HTTP).
REMOTE_CHECK = """
import sys
import lm_console.cli
from lm_console.client.remote import RemoteConsoleClient
import lm_console.client.vllm_metrics, engine.entrypoints.console_protocol, lm_console.events
import lm_console.bench.http, lm_console.bench.launcher, lm_console.batch_remote, zmq.asyncio
heavy = sorted(m for m in ('torch', 'transformers', 'triton', 'fastapi', 'uvicorn') if m in sys.modules)
print(','.join(heavy))
"""


def test_tui_imports_no_torch() -> None:
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"the TUI imported {result.stdout.strip()}"


def test_remote_console_imports_no_torch_and_no_server() -> None:
    result = subprocess.run([sys.executable, "-c", REMOTE_CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"the remote console imported {result.stdout.strip()}"
