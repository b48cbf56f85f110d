"""The console's start-up path imports no torch, so `pip install lm-console`
(no [engine] extra) runs it; a command that needs the engine says which extra to install."""

from __future__ import annotations

import pytest
import json
import subprocess
import sys

from lm_console.engine.version import __version__

pytestmark = pytest.mark.slow

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
import lm_console.client.vllm_metrics, lm_console.engine.entrypoints.console_protocol, lm_console.events
import lm_console.bench.http, lm_console.bench.launcher, lm_console.batch_remote, zmq.asyncio
heavy = sorted(m for m in ('torch', 'transformers', 'triton', 'fastapi', 'uvicorn') if m in sys.modules)
print(','.join(heavy))
"""

# `lmc --version`, `lmc tui --help` and the remote console (`--url`, where this build has it).
CLI_CHECK = """
import importlib.util, json, sys
from typer.testing import CliRunner
from lm_console.cli import app
runner = CliRunner()
version = runner.invoke(app, ['--version'])
tui_help = runner.invoke(app, ['tui', '--help'])
import lm_console.client.remote
remote = True
heavy = sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules)
print(json.dumps([version.exit_code, version.output, tui_help.exit_code, '--fake' in tui_help.output, remote, heavy]))
"""

# As in a console-only install: the engine's and the server's modules cannot be imported.
BLOCK_EXTRAS = """
import sys
for name in ('torch', 'transformers', 'tokenizers', 'safetensors', 'gguf', 'triton', 'accelerate', 'blake3',
             'fastapi', 'uvicorn', 'prometheus_client'):
    sys.modules[name] = None  # `import torch` raises ModuleNotFoundError; find_spec says None
"""

REFUSALS = BLOCK_EXTRAS + """
import json
from typer.testing import CliRunner
from lm_console.cli import app
results = {}
for args in (['generate', 'hi'], ['tui'], ['chat'], ['chat', '--plain'], ['events', '--count', '1'],
             ['batch', '-i', 'in.jsonl', '-o', 'out.jsonl'], ['serve']):
    result = CliRunner().invoke(app, args)
    results[' '.join(args)] = [result.exit_code, result.output]
print(json.dumps(results))
"""


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_tui_imports_no_torch() -> None:
    result = run_python(CHECK)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"the TUI imported {result.stdout.strip()}"


def test_remote_console_imports_no_torch_and_no_server() -> None:
    result = subprocess.run([sys.executable, "-c", REMOTE_CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"the remote console imported {result.stdout.strip()}"
def test_version_help_and_remote_console_import_no_torch() -> None:
    result = run_python(CLI_CHECK)
    assert result.returncode == 0, result.stderr
    version_code, version_out, help_code, help_has_fake, _remote, heavy = json.loads(result.stdout)
    assert version_code == 0 and version_out.strip() == f"lm-console {__version__}"
    assert help_code == 0 and help_has_fake
    assert heavy == [], f"`lmc --version` / `lmc tui --help` imported {heavy}"


def test_engine_commands_without_the_engine_exit_2_naming_the_extra() -> None:
    result = run_python(REFUSALS)
    assert result.returncode == 0, result.stderr
    for command, (code, output) in json.loads(result.stdout).items():
        name = "lmc " + command.split()[0]
        assert code == 2, f"lmc {command}: exit {code}: {output}"
        assert f"error: {name} needs the engine (torch," in output, output
        assert "pip install 'lm-console[engine]'" in output and "Traceback" not in output


def test_the_fake_console_runs_without_the_engine() -> None:
    """`lmc tui --fake` (engine core over the FakeExecutor) and `lmc events --fake` need no torch."""
    code = BLOCK_EXTRAS + """
from typer.testing import CliRunner
from lm_console.cli import app
result = CliRunner().invoke(app, ['events', '--fake', '--count', '3'])
assert result.exit_code == 0, result.output
print(len(result.output.strip().splitlines()))
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3"


def test_the_entry_point_turns_an_engine_import_error_into_exit_2() -> None:
    """A command without an up-front check (here `lmc bench throughput`) still gets the hint from main()."""
    code = BLOCK_EXTRAS + """
sys.argv = ['lmc', 'bench', 'throughput', '--num-prompts', '1', '--no-progress']
from lm_console.cli import main
main()
"""
    result = run_python(code)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "needs the engine" in result.stderr and "pip install 'lm-console[engine]'" in result.stderr
    assert "Traceback" not in result.stderr
