"""Imports run one way, and no module imports itself back (issue 12).

Every import under lm_console/ (the engine in lm_console/engine, the kernels in
lm_console/kernels) is parsed (ast), function-level lazy
imports included: a lazy import is still a dependency, it only runs later. Imports under
`if TYPE_CHECKING:` are left out: they never run, so they load nothing and cannot form a cycle
(mypy checks them). Each module maps to a layer by the longest matching prefix in LAYERS; an
import may go to its own layer or any layer below, never up. Independently of the layers, the
module graph must have no cycle.

The bottom layer, `shared`, holds the types and helpers every process and layer uses. It is
torch-free: importing all of it (and engine.core.engine_core, whose executor is imported lazily)
loads no torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lm_console",)

# Top to bottom. An import may point to its own layer or any layer after it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("console", ("lm_console",)),
    # The public API: lm_console/engine/__init__.py re-exports LLM and AsyncLLM (lazily).
    ("frontend", ("lm_console.engine", "lm_console.engine.frontend", "lm_console.engine.entrypoints")),
    # The structured-output manager runs in the engine core (its scheduler consults it).
    ("core", ("lm_console.engine.core", "lm_console.engine.structured_output")),
    ("executor", ("lm_console.engine.executor",)),
    # The sampler runs inside the worker's step (vLLM: v1/sample beside v1/worker).
    ("worker", ("lm_console.engine.worker", "lm_console.engine.sample")),
    # KV and encoder-cache connectors: the core creates their scheduler role, the worker their
    # worker role, so they sit below both and see the core only through the shared types. (A
    # tensor-parallel group module that the models use belongs lower: map it there.)
    ("connectors", ("lm_console.engine.distributed",)),
    ("models", ("lm_console.engine.models",)),
    # The tensor-parallel group: the models' parallel layers call its collectives.
    ("attention", ("lm_console.engine.attention", "lm_console.engine.forward_context",
                   "lm_console.engine.distributed.parallel_state")),
    ("kernels", ("lm_console.kernels",)),
    # Torch-free types and helpers shared by every layer and process.
    ("shared", (
        "lm_console.engine.config", "lm_console.engine.errors", "lm_console.engine.protocol",
        "lm_console.engine.admission", "lm_console.engine.request", "lm_console.engine.sampling_params",
        "lm_console.engine.outputs", "lm_console.engine.ipc", "lm_console.engine.platform",
        "lm_console.engine.kv_cache_interface", "lm_console.engine.kv_cache_hashing",
        "lm_console.engine.scheduler_output", "lm_console.engine.model_runner_output",
        "lm_console.engine.startup_trace", "lm_console.engine.malloc_tuning", "lm_console.engine.cache_dirs",
        "lm_console.engine.envs",
        "lm_console._lazy",
        "lm_console.engine.process_flags",
        "lm_console.engine.metrics", "lm_console.engine.multimodal",
        # The LoRA request type and the torch-free checks of an adapter's files.
        "lm_console.engine.lora",
        # The bounded safetensors header read that adapters and connectors' stored files share.
        "lm_console.engine.safetensors_header",
        # Type-safe admission: the frontend checks a request with the core's own decoder.
        "lm_console.engine.admission",
        # Connector configs are parsed by EngineArgs in the frontend, before any process starts.
        "lm_console.engine.config.kv_transfer", "lm_console.engine.config.ec_transfer",
        # What the worker-side connector reports back inside ModelRunnerOutput.
        "lm_console.engine.distributed.kv_transfer.output",
    )),
]

# Deliberate imports against the order: (importer, imported) -> why. Keep this short.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("lm_console.engine.config.engine_args", "lm_console.engine.models.embedded"): (
        "EngineArgs.create_engine_config resolves a model name to its directory, converting the "
        "embedded GGUF or building demo-vlm on first use; it runs in the engine core's process "
        "(the frontend builds its config from the ready handshake instead)"),
    ("lm_console.engine.config.engine_args", "lm_console.engine.models.gguf_check"): (
        "EngineArgs validation reads a .gguf's layout (its metadata only) to refuse a KV connector on a "
        "hybrid model before any process starts"),
    ("lm_console.engine.config.cache", "lm_console.kernels.cpu_attention"): (
        "resolve_kv_cache_dtype asks the attention kernels whether they take the model's shape on this "
        "machine (auto picks the int8 KV cache only then); it runs in the engine core's process, which "
        "loads those kernels anyway"),
}

# Modules that are allowed in `shared` although they import torch lazily inside a function.
SHARED_LAZY_TORCH: dict[str, str] = {
    "lm_console.engine.ipc": "a tensor in a multimodal message is sent as a raw frame; torch loads only then",
    "lm_console.engine.platform": ("configs name devices and dtypes; torch loads when the engine core asks for a "
                                   "GPU (detect_device) or the worker for a torch dtype or device"),
}


@dataclass(frozen=True)
class Edge:
    """`importer` imports `imported` at `line` (lazy: inside a function)."""

    importer: str
    imported: str
    line: int
    lazy: bool


def _module_files() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def _resolve(name: str) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, in_function: bool = False,
             type_checking: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under node, with whether it sits in a function (an import under
    `if TYPE_CHECKING:` counts as lazy: it loads nothing at run time, but it is a dependency all
    the same, and mypy follows it)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for inner in child.body:
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    yield inner, True
            for orelse in child.orelse:
                yield from _imports(orelse, in_function)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        yield from _imports(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str | None]:
    """Our modules an import statement in `module` names."""
    if isinstance(node, ast.Import):
        return [_resolve(alias.name) for alias in node.names]
    if node.level:  # relative: from the package of this module, level - 1 up
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    targets = []
    for alias in node.names:
        target = _resolve(f"{source}.{alias.name}")  # a submodule, or a name in source
        if target is None or target == module or target != f"{source}.{alias.name}":
            target = _resolve(source)
        targets.append(target)
    return targets


def _eager_imports(package: str) -> set[str]:
    """Our modules a package's __init__ imports at import time (module level, outside TYPE_CHECKING)."""
    path = MODULES.get(package)
    if path is None:
        return set()
    return {target for node, lazy in _imports(ast.parse(path.read_text())) if not lazy
            for target in _targets(package, path, node) if target is not None and target != package}


def _edges_of(module: str, path: Path) -> Iterator[Edge]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node, lazy in _imports(tree):
        targets = _targets(module, path, node)
        for target in targets:
            if target is None or target == module:
                continue
            yield Edge(module, target, node.lineno, lazy)
            # Importing a.b.c runs a/__init__ and a/b/__init__ first: the importer depends on what
            # those packages load at import time too (its own packages excepted: they are loaded
            # before it, whoever imports it).
            parts = target.split(".")
            for depth in range(1, len(parts)):
                package = ".".join(parts[:depth])
                if package == module or module.startswith(package + "."):
                    continue
                for loaded in _eager_imports(package):
                    if loaded != module:
                        yield Edge(module, loaded, node.lineno, lazy)


EDGES: list[Edge] = sorted({edge for module, path in MODULES.items() for edge in _edges_of(module, path)},
                           key=lambda edge: (edge.importer, edge.line, edge.imported))


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest prefix that names the module (or a package above it)."""
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best >= 0, f"{module} is in no layer: add it to LAYERS"
    return best


def _find_cycles(edges: list[Edge]) -> list[list[str]]:
    """One concrete cycle per strongly connected component of the module graph (Tarjan)."""
    graph: dict[str, list[str]] = {module: [] for module in MODULES}
    for edge in edges:
        if edge.imported not in graph[edge.importer]:
            graph[edge.importer].append(edge.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for module in graph:
        if module not in index:
            visit(module)
    cycles = []
    for component in components:  # a shortest way back from the first module to itself
        members = set(component)
        start = min(component)
        parents: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            next_frontier = []
            for v in frontier:
                for w in graph[v]:
                    if w == start:
                        found = v
                        break
                    if w in members and w not in parents:
                        parents[w] = v
                        next_frontier.append(w)
                if found is not None:
                    break
            frontier = next_frontier
        path = [found]
        while path[-1] != start:
            path.append(parents[path[-1]])
        cycles.append([*reversed(path), start])
    return cycles


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_imports_follow_the_layer_order() -> None:
    upward = []
    for edge in EDGES:
        if layer_of(edge.imported) >= layer_of(edge.importer):
            continue
        if (edge.importer, edge.imported) in EXCEPTIONS:
            continue
        upward.append(f"{edge.importer}:{edge.line} ({LAYERS[layer_of(edge.importer)][0]}) imports "
                      f"{edge.imported} ({LAYERS[layer_of(edge.imported)][0]}){' lazily' if edge.lazy else ''}")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_exceptions_are_still_needed() -> None:
    """An exception whose import is gone must leave the list (it keeps the list honest)."""
    present = {(edge.importer, edge.imported) for edge in EDGES}
    stale = [pair for pair in EXCEPTIONS if pair not in present]
    assert not stale, f"exceptions no longer needed: {stale}"
    lazy_torch = {module for module, path in MODULES.items()
                  for node, lazy in _imports(ast.parse(path.read_text()))
                  if lazy and isinstance(node, ast.Import) and any(alias.name == "torch" for alias in node.names)}
    stale_torch = sorted(set(SHARED_LAZY_TORCH) - lazy_torch)
    assert not stale_torch, f"SHARED_LAZY_TORCH entries no longer needed: {stale_torch}"


def test_no_import_cycles() -> None:
    cycles = _find_cycles(EDGES)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_shared_layer_imports_no_torch_at_module_level() -> None:
    shared = LAYERS.index(next(layer for layer in LAYERS if layer[0] == "shared"))
    offenders = []
    for module, path in MODULES.items():
        if layer_of(module) != shared:
            continue
        for node, lazy in _imports(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""])
            if any(name == "torch" or name.startswith("torch.") for name in names):
                if lazy and module in SHARED_LAZY_TORCH:
                    continue
                offenders.append(f"{module}:{node.lineno}{' (lazy)' if lazy else ''}")
    assert not offenders, "torch imported in the shared layer:\n" + "\n".join(offenders)


_LOADS_NO_TORCH = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
heavy = sorted(m for m in ("torch", "triton") if m in sys.modules)
print(",".join(heavy))
"""


def _loaded_heavy_modules(*names: str) -> str:
    result = subprocess.run([sys.executable, "-c", _LOADS_NO_TORCH, *names], capture_output=True,
                            text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_shared_layer_loads_no_torch() -> None:
    """The frontend and the console import all of these without paying for torch."""
    shared = LAYERS.index(next(layer for layer in LAYERS if layer[0] == "shared"))
    names = sorted(module for module in MODULES if layer_of(module) == shared)
    loaded = _loaded_heavy_modules(*names)
    assert loaded == "", f"importing the shared layer loaded {loaded}"


def test_engine_core_loads_no_torch() -> None:
    """EngineCore imports its executor lazily (Executor.get_class), so a FakeExecutor core is torch-free."""
    loaded = _loaded_heavy_modules("lm_console.engine.core.engine_core", "lm_console.engine.core.engine_core_proc",
                                   "lm_console.engine.executor.abstract")
    assert loaded == "", f"importing the engine core loaded {loaded}"


def test_protocol_does_not_load_the_kv_cache() -> None:
    check = ("import sys, lm_console.engine.protocol; "
             "print(sorted(m for m in sys.modules if m.startswith('lm_console.engine.core')))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"import lm_console.engine.protocol loaded {result.stdout.strip()}"


_BOUNDARY_LOADS = """
import importlib, sys
name = sys.argv[1]
importlib.import_module(name)
heavy = ("torch", "transformers", "xgrammar")
subsystems = ("lm_console.engine.distributed.kv_transfer.base", "lm_console.engine.distributed.kv_transfer.factory",
              "lm_console.engine.distributed.ec_transfer.base", "lm_console.engine.distributed.ec_transfer.factory",
              "lm_console.engine.multimodal.processing", "lm_console.engine.structured_output",
              "lm_console.engine.core")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy
                or (m.startswith(subsystems) and not name.startswith(m)))
print(",".join(loaded))
"""

# Boundary modules that stand for one of those subsystems themselves (their own loads are theirs).
_BOUNDARY_OWNERS = ("lm_console.engine.multimodal",)


def test_each_boundary_module_loads_no_connector_processor_or_torch() -> None:
    """A boundary type is cheap: importing it alone (its packages' __init__ included) loads no KV
    or encoder connector, no multimodal processor, no structured-output backend, nothing of the
    engine core and no torch. Package __init__s re-export lazily (lm_console/_lazy.py) for this."""
    shared = LAYERS.index(next(layer for layer in LAYERS if layer[0] == "shared"))
    offenders = {}
    for name in sorted(module for module in MODULES if layer_of(module) == shared):
        if name.startswith(_BOUNDARY_OWNERS):
            continue
        result = subprocess.run([sys.executable, "-c", _BOUNDARY_LOADS, name], capture_output=True, text=True,
                                timeout=120, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        if result.stdout.strip():
            offenders[name] = result.stdout.strip()
    assert not offenders, f"boundary modules that load a subsystem: {offenders}"
