"""The repository stands alone: no tracked file points at documents it does not contain.

The code once cited an outside specification by line numbers and section signs, and sent readers
to `../shared/`, which exists in no clone, sdist or wheel. Concepts that follow vLLM say so in
our own words (naming vLLM's public file where useful). This test fails on any tracked text file
that points at `../shared`, at the outside design notes, at the specification's file name, or
cites "seed" by line numbers or sections. The word "seed" as an RNG seed is fine.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

FORBIDDEN: list[tuple[str, re.Pattern[str]]] = [
    ("the sibling shared/ folder", re.compile(r"\.\./shared\b")),
    ("an outside design note", re.compile(r"\bshared/(?:DESIGN|STYLE|CONSOLE|MACHINE|INDEX)\.md|\bshared/seed\b")),
    ("the specification's file name", re.compile(r"000_097d1cbd935fcfe7")),
    ("a citation by line numbers", re.compile(r"\bseed\b[^\n]{0,20}\blines? \d", re.IGNORECASE)),
    ("a citation by section", re.compile(r"\bseed\b[^\n]{0,40}§", re.IGNORECASE)),
    ("a parenthesized citation", re.compile(r"\(seed:? (?!(?:int|str)\b|[&|^+*-])", re.IGNORECASE)),
    ("a reference to the specification", re.compile(r"\bseed's\b|\bthe seed \(", re.IGNORECASE)),
]


def tracked_text_files() -> list[str]:
    """Every file git tracks, except this test, that decodes as UTF-8 text."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an sdist): nothing to scan")
    return [p for p in out.decode().split("\0") if p and p != THIS]


def find_references(paths: list[str]) -> list[str]:
    """`path:line: what` for each forbidden reference in the given files."""
    found = []
    for rel in paths:
        path = ROOT / rel
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary (PNG, safetensors): nothing a reader follows
        for what, pattern in FORBIDDEN:
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{rel}:{line}: {what}: {match.group(0)!r}")
    return found


def test_patterns_catch_citations_and_spare_rng_seeds() -> None:
    caught = ["(seed: lines 10-20)", "seed lines 2244-2632", "seed §3.2", "seed: Gemma3 vision §1",
              "the seed's batch queue", "see ../shared/DESIGN.md", "shared/CONSOLE.md", "shared/seed/"]
    spared = ["seed: int = 0", "def f(seed: int | None)", "(seed & MASK)", "SamplingParams(seed=1)",
              "PYTHONHASHSEED", "NONE_HASH seed", "seeded",
              "the request's seed, or its prompt", "--seed 1", "pulls weeds before they seed, and keeps"]
    for text in caught:
        assert any(p.search(text) for _, p in FORBIDDEN), text
    for text in spared:
        assert not any(p.search(text) for _, p in FORBIDDEN), text


def test_no_tracked_file_points_outside_the_repository() -> None:
    found = find_references(tracked_text_files())
    assert not found, "references to documents outside the repository:\n" + "\n".join(found)
