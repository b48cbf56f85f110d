"""Benchmark figures: rendered from the JSON files under docs/benchmarks/data/, never typed twice.

Each file records one benchmark run as it was reported: `title`, `date`, `recorded` (where the
figure was first written down), `machine`, `command`, `script`, `figures` (what, value, unit),
optionally `headline` (the README's one-line summary) and `notes` (Markdown). The docs' benchmark
page and README.md's headline table are both made from them: the page by the MkDocs hook
(docs/hooks/reference.py), the README's table by `python docs/hooks/benchmarks.py --readme`,
which `make docs` checks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "benchmarks" / "data"
REQUIRED = ("id", "title", "date", "recorded", "machine", "command", "script", "figures")
START, END = "<!-- headline-figures:start -->", "<!-- headline-figures:end -->"


def runs() -> list[dict[str, Any]]:
    """Every benchmark record, in the order of its `order` field."""
    records = []
    for path in sorted(DATA.glob("*.json")):
        record = json.loads(path.read_text())
        missing = [k for k in REQUIRED if k not in record]
        if missing:
            raise ValueError(f"{path.relative_to(ROOT)} lacks {', '.join(missing)}")
        record["source"] = path.name
        records.append(record)
    return sorted(records, key=lambda r: (r.get("order", 100), r["id"]))


def cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def section(record: dict[str, Any]) -> str:
    meta = ["| | |", "|---|---|",
            f"| date | {cell(record['date'])} (recorded: {cell(record['recorded'])}) |",
            f"| machine | {cell(record['machine'])} |",
            f"| command | `{cell(record['command'])}` |",
            f"| script | `{cell(record['script'])}` |",
            f"| source | [`data/{record['source']}`](data/{record['source']}) |"]
    figures = ["| figure | value |", "|---|---|"]
    for f in record["figures"]:
        unit = f" {f['unit']}" if f.get("unit") else ""
        figures.append(f"| {cell(f['what'])} | {cell(f['value'])}{cell(unit)} |")
    parts = [f"## {record['title']} {{#{record['id']}}}", "\n".join(meta), "\n".join(figures)]
    if record.get("notes"):
        parts.append(record["notes"].strip())
    return "\n\n".join(parts)


def page_markdown() -> str:
    return "\n\n".join(section(r) for r in runs())


def headline_rows(link_prefix: str, source_prefix: str) -> str:
    rows = ["| figure | value | measured on |", "|---|---|---|"]
    for r in runs():
        h = r.get("headline")
        if h:
            rows.append(f"| [{cell(h['what'])}]({link_prefix}#{r['id']}) | {cell(h['value'])} | "
                        f"{cell(h['machine'])}, {cell(r['date'])} ([JSON]({source_prefix}{r['source']})) |")
    return "\n".join(rows)


def headline_markdown() -> str:
    """The headline table on the docs' home and benchmark pages."""
    return headline_rows("benchmarks/index.md", "benchmarks/data/")


def readme_with_headline(readme: str) -> str:
    """README.md with its headline table regenerated between the markers."""
    if START not in readme or END not in readme:
        raise ValueError(f"README.md lacks the {START} ... {END} markers")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    table = headline_rows("docs/benchmarks/index.md", "docs/benchmarks/data/")
    return f"{head}{START}\n{table}\n{END}{tail}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--readme"]:
        path = ROOT / "README.md"
        path.write_text(readme_with_headline(path.read_text()))
    else:
        print(page_markdown())
