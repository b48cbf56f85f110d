"""tools/mutation_filter.py: which mutant positions `make mutation` leaves out as annotation mutants
(positions as cosmic-ray stores them: rows from 1, columns from 0 in characters)."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from script_helpers import load_script

ROOT = Path(__file__).resolve().parents[2]


def _filter():  # noqa: ANN202
    return load_script(ROOT / "tools" / "mutation_filter.py")


SOURCE = '''\
from __future__ import annotations

LIMIT: int | None = 1
Pair = tuple[int, int]


def f(a: int | None, /, b: list[int] = [2], *args: str | bytes, c: Literal[False] = False,
      **kwargs: dict[str, int] | None) -> tuple[int, "é"] | None:
    x: int | None = 3 | 4
    return a or x


class C:
    size: Literal[True] = True

    async def g(self, y: float | int = 5) -> bool | None:
        return y > 0
'''


def _pos(needle: str, line: int, nth: int = 0) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (start, end) of the nth `needle` on row `line`, as cosmic-ray stores a mutated token."""
    text = SOURCE.splitlines()[line - 1]
    col = -1
    for _ in range(nth + 1):
        col = text.index(needle, col + 1)
    return (line, col), (line, col + len(needle))


def _in_annotation(needle: str, line: int, nth: int = 0) -> bool:
    mf = _filter()
    start, end = _pos(needle, line, nth)
    return mf.inside(start, end, mf.annotation_spans(SOURCE))


def test_mutants_in_every_kind_of_annotation_are_left_out() -> None:
    assert _in_annotation("|", 3)                          # module-level AnnAssign
    assert _in_annotation("|", 7)                          # positional-only argument
    assert _in_annotation("int", 7, 1)                     # plain argument b: list[int]
    assert _in_annotation("|", 7, 1)                       # *args
    assert _in_annotation("False", 7)                      # keyword-only: Literal[False]
    assert _in_annotation("|", 8)                          # **kwargs
    assert _in_annotation("|", 8, 1)                       # return annotation, after a non-ASCII string
    assert _in_annotation("|", 9)                          # AnnAssign in a body
    assert _in_annotation("True", 14)                      # class-level AnnAssign
    assert _in_annotation("|", 16) and _in_annotation("|", 16, 1)  # a method's argument and return


def test_defaults_values_and_bodies_are_kept() -> None:
    assert not _in_annotation("1", 3)                      # the value of `LIMIT: int | None = 1`
    assert not _in_annotation("int", 4)                    # a type alias is evaluated
    assert not _in_annotation("2", 7)                      # a default value
    assert not _in_annotation("False", 7, 1)               # keyword-only default, beside Literal[False]
    assert not _in_annotation("|", 9, 1)                   # `3 | 4`, the annotated assignment's value
    assert not _in_annotation("or", 10)                    # a body
    assert not _in_annotation("True", 14, 1)
    assert not _in_annotation("5", 16)
    assert not _in_annotation(">", 17)


def test_a_module_without_the_future_import_is_left_alone() -> None:
    mf = _filter()
    assert mf.annotation_spans("def f(a: int | None) -> int | None:\n    return a\n") == []
    assert mf.annotation_spans(SOURCE.replace("from __future__ import annotations", "import os")) == []


def test_the_session_loses_exactly_its_annotation_mutants(tmp_path: Path) -> None:
    """On a session table shaped like cosmic-ray 8.7's: mutation_specs and work_items both."""
    (tmp_path / "m.py").write_text(SOURCE, encoding="utf-8")
    db = sqlite3.connect(tmp_path / "s.sqlite")
    db.execute("CREATE TABLE work_items (job_id VARCHAR NOT NULL PRIMARY KEY)")
    db.execute("CREATE TABLE mutation_specs (module_path VARCHAR, start_pos_row INTEGER, start_pos_col INTEGER,"
               " end_pos_row INTEGER, end_pos_col INTEGER, job_id VARCHAR NOT NULL PRIMARY KEY)")
    mutants = {"ann-1": _pos("|", 3), "ann-2": _pos("|", 8, 1), "ann-3": _pos("True", 14),
               "keep-1": _pos("1", 3), "keep-2": _pos("|", 9, 1), "keep-3": _pos("5", 16),
               "keep-4": (_pos("Literal", 14)[0], (14, 30))}  # a node that starts in an annotation and ends past it
    for job, ((row, col), (end_row, end_col)) in mutants.items():
        db.execute("INSERT INTO work_items VALUES (?)", (job,))
        db.execute("INSERT INTO mutation_specs VALUES (?, ?, ?, ?, ?, ?)", ("m.py", row, col, end_row, end_col, job))
    db.commit()
    assert _filter().filter_session(tmp_path / "s.sqlite", tmp_path) == {"m.py": 3}
    for table in ("mutation_specs", "work_items"):
        assert {j for (j,) in db.execute(f"SELECT job_id FROM {table}")} == {"keep-1", "keep-2", "keep-3", "keep-4"}
