"""MkDocs hook: the reference pages' tables, generated from the code at every build.

A page holds a marker line and the hook puts the generated Markdown in its place:

- `<!-- gen:engine-args -->`: every field of EngineArgs, from the knobs' declarations on the config
  classes (lm_console/engine/config/fields.py; imported: the config modules are torch-free): what
  it accepts (choices or type and bounds), default, `lmc` flag, the class it is declared on, help;
- `<!-- gen:config-classes -->`: the fields of the config dataclasses the engine resolves them into
  (a knob's declaration, or for a resolved fact the comment beside or above it, read with
  `ast`/`tokenize`);
- `<!-- gen:env-vars -->`: every environment variable the package reads: those declared in
  lm_console/engine/envs.py (name, default, meaning, and where `envs.NAME` is read), then any
  other read (`os.environ.get`, `os.getenv`, `os.environ[...]`, a Typer option's `envvar=`);
- `<!-- gen:cli -->`: the `lmc` reference, rendered by Typer's own doc generator from the app in
  lm_console/cli.py;
- `<!-- gen:benchmarks -->` and `<!-- gen:headline -->`: the benchmark pages, from the JSON files
  under docs/benchmarks/data/ (docs/hooks/benchmarks.py).

It also adds the console screenshots (screenshots/*.png) to the site, so that pages show the
same files the README does, and fails the build when README.md's headline table is not the one
the benchmark files give (`python docs/hooks/benchmarks.py --readme` rewrites it).
"""

from __future__ import annotations

import ast
import dataclasses
import html
import importlib
import inspect
import io
import os
import re
import sys
import tokenize
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmarks  # noqa: E402  (docs/hooks/benchmarks.py, beside this file)

from lm_console.engine.config.fields import UNSET, declarations  # noqa: E402  (torch-free)
from lm_console.engine.config.knobs import engine_arg_declarations  # noqa: E402

PACKAGE = ROOT / "lm_console"
CONFIG_FILES = [
    "lm_console/engine/config/model.py", "lm_console/engine/config/cache.py",
    "lm_console/engine/config/scheduler.py", "lm_console/engine/config/parallel.py",
    "lm_console/engine/config/device.py", "lm_console/engine/config/frontend.py",
    "lm_console/engine/config/engine_config.py",
    "lm_console/engine/config/structured_outputs.py", "lm_console/engine/config/multimodal.py",
    "lm_console/engine/config/kv_transfer.py", "lm_console/engine/config/ec_transfer.py",
    "lm_console/engine/config/observability.py",
    "lm_console/engine/config/speculative.py", "lm_console/engine/config/lora.py",
]


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ").strip()


def code(text: str) -> str:
    """Inline code safe inside a Markdown table cell (a `|` in backticks would still split the row)."""
    return "<code>" + html.escape(text.replace("\n", " ").strip()).replace("|", "&#124;") + "</code>"


def comments_by_line(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def comment_for(lines: list[str], comments: dict[int, str], lineno: int) -> str:
    """The comment on a statement's line, else the block of comment-only lines right above it."""
    if lineno in comments and not lines[lineno - 1].lstrip().startswith("#"):
        return comments[lineno]
    above: list[str] = []
    n = lineno - 1
    while n >= 1 and lines[n - 1].lstrip().startswith("#"):
        above.insert(0, comments.get(n, ""))
        n -= 1
    return " ".join(above)


def dataclass_fields(path: Path, class_name: str | None = None) -> list[tuple[str, list[dict[str, str]], str]]:
    """(class name, fields, class docstring) of each dataclass in a file (or the one named)."""
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    comments = comments_by_line(source)
    result = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or (class_name and node.name != class_name):
            continue
        decorators = [ast.unparse(d) for d in node.decorator_list]
        if not any("dataclass" in d for d in decorators) and class_name is None:
            continue
        fields = []
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if stmt.target.id.startswith("_") or "ClassVar" in ast.unparse(stmt.annotation):
                    continue
                default = ast.unparse(stmt.value) if stmt.value is not None else "(required)"
                fields.append({"name": stmt.target.id, "type": ast.unparse(stmt.annotation),
                               "default": default, "doc": comment_for(lines, comments, stmt.lineno)})
        result.append((node.name, fields, ast.get_docstring(node) or ""))
    return result


def fields_table(fields: list[dict[str, str]]) -> str:
    rows = ["| name | type | default | what it does |", "|---|---|---|---|"]
    for f in fields:
        rows.append(f"| `{f['name']}` | {code(f['type'])} | {code(f['default'])} | {cell(f['doc'])} |")
    return "\n".join(rows)


def _knob_type(decl: Any) -> str:
    """A knob's accepted values in words: its choices, or its type and bounds."""
    return decl.describe()


def _default_text(decl: Any) -> str:
    if decl.default_factory is not dataclasses.MISSING and decl.spec.arg_default is UNSET:
        return f"{decl.default_value()!r} (computed)"
    return repr(decl.default_value())


def engine_args_markdown() -> str:
    """EngineArgs from the knobs' declarations (imported: the config modules are torch-free)."""
    rows = ["| name | accepts | default | `lmc` flag | declared on | what it does |", "|---|---|---|---|---|---|"]
    decls = engine_arg_declarations()
    for name, decl in decls.items():
        flag = f"`{decl.flag.split()[0]}`" if decl.flag else ""
        rows.append(f"| `{name}` | {cell(_knob_type(decl))} | {code(_default_text(decl))} | {flag} | "
                    f"`{decl.owner.__name__}.{decl.field}` | {cell(decl.spec.help)} |")
    return (f"Generated from the knobs declared on the config classes ({len(decls)} fields; "
            "`lm_console/engine/config/knobs.py` lists the classes). The same names are the keyword arguments "
            "of `LLM(...)` and `AsyncLLM(...)`; those with a flag are `lmc` options of every command that "
            "starts an engine (see the [CLI reference](cli.md)).\n\n" + "\n".join(rows))


def config_classes_markdown() -> str:
    """Each config class's fields: a knob's declaration, or the comment beside a resolved fact."""
    parts = []
    for rel in CONFIG_FILES:
        module_name = rel.removesuffix(".py").replace("/", ".")
        module = importlib.import_module(module_name)
        comments = {name: {f["name"]: f for f in fields} for name, fields, _ in dataclass_fields(ROOT / rel)}
        for class_name, by_name in comments.items():
            cls = getattr(module, class_name)
            if not dataclasses.is_dataclass(cls) or not by_name:
                continue
            knobs = {d.field: d for d in declarations(cls)}
            rows = ["| name | type | default | what it does |", "|---|---|---|---|"]
            for field in dataclasses.fields(cls):
                if field.name.startswith("_"):
                    continue
                decl = knobs.get(field.name)
                if decl is not None:
                    default = ("(resolved)" if field.default is dataclasses.MISSING
                               and field.default_factory is dataclasses.MISSING else _default_text(decl))
                    what = decl.spec.help + ("" if decl.spec.user else " (set by the engine)")
                    arg = f" (`{decl.arg}`)" if decl.arg != decl.field and decl.spec.user else ""
                    rows.append(f"| `{field.name}`{arg} | {cell(decl.describe(by_arg=False))} | {code(default)} | "
                                f"{cell(what)} |")
                else:
                    info = by_name.get(field.name, {"type": str(field.type), "default": "", "doc": ""})
                    rows.append(f"| `{field.name}` | {code(info['type'])} | {code(info['default'])} | "
                                f"{cell(info['doc'])} |")
            doc = inspect.getdoc(cls) or ""
            parts.append(f"### {class_name}\n\n{doc}\n\nIn `{rel}`.\n\n" + "\n".join(rows))
    return "\n\n".join(parts)


def _env_name(node: ast.AST, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _is_environ(node: ast.AST) -> bool:
    return ast.unparse(node) in ("os.environ", "environ")


def env_reads() -> list[dict[str, Any]]:
    """Every environment variable read under lm_console/: name, file:line, default, description."""
    return [read for path in sorted(PACKAGE.rglob("*.py")) for read in _env_reads_in(path)]


def _env_reads_in(path: Path) -> list[dict[str, Any]]:
    """The environment reads of one file."""
    reads = []
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    comments = comments_by_line(source)
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    # the innermost function around each line, for its docstring
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    # module-level `NAME = ...os.environ.get(...)...`: the line's constant names what it sets
    targets = {line: t.id for n in tree.body if isinstance(n, ast.Assign)
               for t in n.targets if isinstance(t, ast.Name)
               for line in range(n.lineno, (n.end_lineno or n.lineno) + 1)}

    def describe(lineno: int, help_text: str = "") -> tuple[int, str]:
        """(rank, text): 0 an option's help or a comment, 1 a module constant, 2 a docstring."""
        if help_text:
            return 0, help_text
        text = comment_for(lines, comments, lineno)
        if text:
            return 0, text
        if lineno in targets:
            return 1, f"sets `{targets[lineno]}` in `{path.relative_to(ROOT)}`"
        around = [f for f in functions if f.lineno <= lineno <= (f.end_lineno or f.lineno)]
        if around:
            function = min(around, key=lambda f: (f.end_lineno or 0) - f.lineno)
            doc = (ast.get_docstring(function) or "").split("\n\n")[0]
            return 2, f"read by `{function.name}()`" + (f": {doc}" if doc else "")
        return 3, ""

    for node in ast.walk(tree):
        name = default = None
        help_text = ""
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value)) or \
                    ast.unparse(func) in ("os.getenv", "getenv"):
                if node.args:
                    name = _env_name(node.args[0], constants)
                    default = ast.unparse(node.args[1]) if len(node.args) > 1 else "unset"
            for kw in node.keywords:
                if kw.arg == "envvar":
                    name = _env_name(kw.value, constants)
                    default = "unset"
                    help_text = next((k.value.value for k in node.keywords if k.arg == "help"
                                      and isinstance(k.value, ast.Constant)), "")
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            name = _env_name(node.slice, constants)
            default = "required"
        if name:
            rank, doc = describe(node.lineno, help_text)
            reads.append({"name": name, "where": f"{path.relative_to(ROOT)}:{node.lineno}",
                          "default": default or "unset", "doc": doc, "rank": rank - 10 * (name in doc)})
    return reads


def declared_env_vars() -> list[dict[str, Any]]:
    """The variables lm_console/engine/envs.py declares (`_declare(name, default, help)`), each with
    the places that read it (`envs.NAME` anywhere in the package)."""
    envs_path = PACKAGE / "engine" / "envs.py"
    declared = []
    for node in ast.walk(ast.parse(envs_path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "_declare":
            name, default, help_text = (ast.literal_eval(arg) for arg in node.args[:3])
            declared.append({"name": name, "default": repr(default) if default else "unset", "doc": help_text,
                             "where": []})
    by_name = {d["name"]: d for d in declared}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == envs_path:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "envs"
                    and node.attr in by_name):
                by_name[node.attr]["where"].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return declared


def env_vars_markdown() -> str:
    declared = declared_env_vars()
    known = {d["name"] for d in declared}
    reads = [{**d, "where": w, "rank": 0} for d in declared for w in (d["where"] or ["lm_console/engine/envs.py"])]
    reads += [r for r in env_reads() if r["name"] not in known and not r["where"].startswith("lm_console/engine/envs.py")]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in reads:
        by_name.setdefault(r["name"], []).append(r)

    def table(names: list[str]) -> str:
        rows = ["| variable | default | read in | what it does |", "|---|---|---|---|"]
        for name in names:
            rs = by_name[name]
            values = {r["default"] for r in rs} - {"required"} or {"required"}
            defaults = ", ".join(sorted(code(v) for v in values))
            where = "<br>".join(f"`{r['where']}`" for r in rs)
            doc = min(rs, key=lambda r: r["rank"])["doc"]
            rows.append(f"| `{name}` | {defaults} | {where} | {cell(doc)} |")
        return "\n".join(rows)

    ours = sorted(n for n in by_name if n.startswith("LMC_"))
    others = sorted(n for n in by_name if not n.startswith("LMC_"))
    return (f"#### lm-console's own variables ({len(ours)})\n\n{table(ours)}\n\n"
            f"#### Other variables the package reads ({len(others)})\n\n{table(others)}")


def cli_markdown() -> str:
    import click
    import typer.cli
    from typer.main import get_command

    from lm_console.cli import app

    command = get_command(app)
    docs = typer.cli.get_docs_for_click(obj=command, ctx=click.Context(command, info_name="lmc"), name="lmc",
                                        title="lmc")
    # One level below the page title: "# lmc" -> "## lmc", "## `lmc x`" -> "### `lmc x`".
    return re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", docs, flags=re.MULTILINE)


GENERATORS = {
    "engine-args": engine_args_markdown,
    "config-classes": config_classes_markdown,
    "env-vars": env_vars_markdown,
    "cli": cli_markdown,
    "benchmarks": benchmarks.page_markdown,
    "headline": benchmarks.headline_markdown,
}
MARKER = re.compile(r"^<!-- gen:([a-z-]+) -->$", re.MULTILINE)


def on_config(config: Any) -> Any:
    # Material draws Mermaid diagrams in the browser with mermaid.js from unpkg.com. For a site read
    # offline, point DOCS_MERMAID_JS at a local mermaid.min.js (e.g. from `npm pack mermaid@11`): it
    # is copied into the site and loaded first, and Material then uses it.
    if os.environ.get("DOCS_MERMAID_JS"):
        config["extra_javascript"].append("javascripts/mermaid.min.js")
    readme = (ROOT / "README.md").read_text()
    if benchmarks.readme_with_headline(readme) != readme:
        raise PluginError("README.md's headline figures differ from docs/benchmarks/data/*.json: "
                          "run `python docs/hooks/benchmarks.py --readme`")
    return config


def on_files(files: Any, config: Any) -> Any:
    for png in sorted((ROOT / "screenshots").glob("*.png")):
        files.append(File(f"screenshots/{png.name}", src_dir=str(ROOT), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    if os.environ.get("DOCS_MERMAID_JS"):
        files.append(File.generated(config, "javascripts/mermaid.min.js", abs_src_path=os.environ["DOCS_MERMAID_JS"]))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def render(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise PluginError(f"{page.file.src_path}: unknown generator marker {name!r}")
        return GENERATORS[name]()

    return MARKER.sub(render, markdown)
