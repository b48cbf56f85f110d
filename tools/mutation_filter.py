"""Leave the annotation mutants out of a cosmic-ray session (tools/mutation.sh runs it after
`cosmic-ray init`, before the sampling).

In a module with `from __future__ import annotations` no annotation is ever evaluated: Python keeps
each one as a string that nothing here reads back (no `get_type_hints`, pydantic or msgspec in the
mutated modules), so a mutant inside one (`X | None` turned into `X - None`, `Literal[False]` into
`Literal[True]`) is equivalent by construction and no test can kill it. This drops from the session
(mutation_specs and work_items, as the sampling does) every mutant that lies inside the annotation
of a function argument (positional-only, plain, *args, keyword-only, **kwargs), a return
annotation or the annotation of an annotated assignment; default values and bodies stay. Modules
without the future import are left alone.

Positions: cosmic-ray (parso) stores a mutant's start and end as (row, column), rows from 1 and
columns from 0 in characters; `ast` counts columns in UTF-8 bytes, converted here.

    python tools/mutation_filter.py SESSION.sqlite   # run where the session's module paths resolve
prints "N annotation mutants left out: ..." per module and writes the total to stdout's last line.
"""
from __future__ import annotations

import ast
import sqlite3
import sys
from collections import Counter
from pathlib import Path

Pos = tuple[int, int]  # (row from 1, column from 0 in characters), as cosmic-ray stores it
Span = tuple[Pos, Pos]  # [start, end)

NOTE = "annotation mutants left out: equivalent, annotations are never evaluated"


def has_future_annotations(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.ImportFrom) and node.module == "__future__"
               and any(alias.name == "annotations" for alias in node.names)
               for node in tree.body)


def _annotations(tree: ast.AST) -> list[ast.expr]:
    found: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None and arg.annotation is not None:
                    found.append(arg.annotation)
            if node.returns is not None:
                found.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
    return found


def annotation_spans(source: str) -> list[Span]:
    """The spans of the annotations that are never evaluated: none where the module lacks
    `from __future__ import annotations`."""
    tree = ast.parse(source)
    if not has_future_annotations(tree):
        return []
    lines = source.splitlines(keepends=True)

    def char_col(row: int, byte_col: int) -> int:
        return len(lines[row - 1].encode("utf-8")[:byte_col].decode("utf-8"))

    spans = []
    for ann in _annotations(tree):
        assert ann.end_lineno is not None and ann.end_col_offset is not None
        spans.append(((ann.lineno, char_col(ann.lineno, ann.col_offset)),
                      (ann.end_lineno, char_col(ann.end_lineno, ann.end_col_offset))))
    return sorted(spans)


def inside(start: Pos, end: Pos, spans: list[Span]) -> bool:
    """Whether the mutated node [start, end) lies within one of the spans."""
    return any(s <= start and end <= e for s, e in spans)


def filter_session(db_path: str | Path, root: str | Path = ".") -> Counter[str]:
    """Delete the annotation mutants from the session; returns how many, per module path."""
    db = sqlite3.connect(str(db_path))
    rows = db.execute("SELECT job_id, module_path, start_pos_row, start_pos_col, end_pos_row, end_pos_col"
                      " FROM mutation_specs").fetchall()
    spans: dict[str, list[Span]] = {}
    drop: list[tuple[str]] = []
    dropped: Counter[str] = Counter()
    for job_id, module, row, col, end_row, end_col in rows:
        if module not in spans:
            spans[module] = annotation_spans((Path(root) / module).read_text(encoding="utf-8"))
        if inside((row, col), (end_row, end_col), spans[module]):
            drop.append((job_id,))
            dropped[module] += 1
    db.executemany("DELETE FROM mutation_specs WHERE job_id = ?", drop)
    db.executemany("DELETE FROM work_items WHERE job_id = ?", drop)
    db.commit()
    db.close()
    return dropped


def main(argv: list[str]) -> int:
    dropped = filter_session(argv[1])
    for module, n in sorted(dropped.items()):
        print(f"{module}: {n} {NOTE}")
    print(f"{sum(dropped.values())} {NOTE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
