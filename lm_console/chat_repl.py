"""The line-based chat for scripts and pipes (`lmc chat --plain`): stdin lines in, replies out."""

from __future__ import annotations

import sys
from typing import TextIO

from lm_console.chat_session import ChatSession
from lm_console.client.protocol import ConsoleClient
from lm_console.client.types import EngineUnavailable


async def run_repl(client: ConsoleClient, session: ChatSession, stdin: TextIO | None = None,
                   stdout: TextIO | None = None, stderr: TextIO | None = None,
                   show_stats: bool = False, images: list[str] | None = None) -> int:
    """One user turn per input line; each reply streams to stdout and ends with a newline.

    /commands print their notice to stderr. Returns the exit code (2 if the engine was refused at
    start, e.g. an invalid model file, as every `lmc` command; 1 if it failed later).
    The streams default to sys.stdin/stdout/stderr as they are at call time (not at import:
    a test runner swaps them per invocation).
    """
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    interactive = stdin.isatty()
    try:
        await client.start()
    except EngineUnavailable as error:
        stderr.write(f"error: the engine failed to start: {error}\n{error.hint}\n")
        return 2
    for path in images or ():  # `lmc chat --image PATH`: goes with the first message
        stderr.write(session.attach_image(path) + "\n")
    # Lines are read as bytes and decoded one at a time: a binary line is an error, not the end.
    raw_stdin = getattr(stdin, "buffer", None)
    try:
        while True:
            if interactive:
                stderr.write("> ")
                stderr.flush()
            line = raw_stdin.readline() if raw_stdin is not None else stdin.readline()
            if not line:
                return 0
            if isinstance(line, bytes):
                try:
                    line = line.decode("utf-8")
                except UnicodeDecodeError:
                    stderr.write("error: that line is not UTF-8 text; it was skipped\n")
                    continue
            text = line.strip()
            if not text:
                continue
            notice = session.command(text)
            if notice is not None:
                stderr.write(notice + "\n")
                continue
            try:
                async for chunk in session.send(text):
                    stdout.write(chunk.text)
                    stdout.flush()
            except EngineUnavailable as error:
                stderr.write(f"\nerror: the engine stopped: {error}\n")
                return 1
            except ValueError as error:  # the engine (engine.errors) or the server (RemoteRequestError) refused it
                stderr.write(f"\nerror: {type(error).__name__}: {error}\n")
                continue
            stdout.write("\n")
            stdout.flush()
            if show_stats and session.last_stats is not None:
                stderr.write(f"[{session.last_stats.describe()}]\n")
    finally:
        await client.shutdown()
