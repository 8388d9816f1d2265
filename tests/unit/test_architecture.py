"""The shape of the code, held as tests: no import circles, imports only down the layers, nothing
imports a command or a benchmark, no lab code in the library, imports at the top of modules (the
few lazy ones with a reason), small files and functions, and manifest rows read as
`ManifestRecord` attributes."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

from pipeline.kv.methods import REGISTRY
from tests.support.paths import REPO

PACKAGES = ("kernels", "pipeline", "lab", "jobs", "tests")

# The layers, lowest first: a module imports only from its own layer's package and from lower
# ones. Packages of one rank do not import each other.
LAYERS = [
    ("kernels", 0), ("pipeline.config", 0),
    ("pipeline.ray_runtime", 0), ("pipeline.telemetry", 0), ("pipeline.allocator", 0),
    ("pipeline.corpus", 1), ("pipeline.routers", 1),
    ("pipeline.kv", 2), ("pipeline.episodes", 2),
    # the store's parts: where objects live, what one holds, what the store holds
    ("pipeline.store", 3), ("pipeline.store.backends", 3),
    ("pipeline.store.objects", 4),
    ("pipeline.store.catalogue", 5),
    ("pipeline.builder", 6),
    ("pipeline.answer", 7),
    ("pipeline.eval", 8), ("pipeline.serve", 8),
    ("pipeline.cli", 9),
    ("lab", 10),
    ("jobs", 11), ("jobs.bench", 11),
    ("tests", 12),
]

# Imports inside functions, each with its reason. Anything else goes at the top of its module.
LAZY = {
    # Triton is imported on first use on CUDA: a CPU process never loads it (a kernel test holds
    # the dispatch to that).
    ("kernels.quant", "kernels.quant_triton"), ("kernels.score", "kernels.score_triton"),
    ("jobs.bench.kernels_speed", "kernels.quant_triton"),
    ("jobs.bench.kernels_speed", "kernels.score_triton"),
    # Start-up time: `jobs.serve --help` and an argument error answer before Ray Serve, torch
    # and the models load.
    ("jobs.serve", "pipeline.serve.app"), ("jobs.serve", "pipeline.ray_runtime"),
    ("jobs.serve", "pipeline.store.backends.base"), ("jobs.serve", "pipeline.store.backends.uri"),
    # Fast failure: the other commands check their arguments and their corpus (or the build its
    # first object) before Ray, torch and the models load; then their heavy part imports them.
    ("jobs.build", "pipeline.builder.driver"), ("jobs.demo", "pipeline.builder.driver"),
    ("jobs.demo", "lab.compare"),
    ("pipeline.cli.evaluation", "pipeline.eval.runner"),
    ("pipeline.cli.evaluation", "pipeline.eval.scorecard"),
    ("pipeline.cli.evaluation", "pipeline.eval.summary"),
    ("pipeline.cli.evaluation", "pipeline.ray_runtime"),
    ("jobs.screen", "pipeline.builder.profile"), ("jobs.screen", "lab.screen"),
    ("jobs.screen", "pipeline.kv.models"),
    # Start-up time: `jobs.bench.fleet --help` and a bad value answer before torch loads.
    ("jobs.bench.fleet", "pipeline.builder.driver"), ("jobs.bench.fleet", "pipeline.serve.app"),
    # A type only (TYPE_CHECKING): the LRU that keeps the router's manifests (pipeline.answer.plan)
    # loads without torch; torch itself is imported where a cache is sized.
    ("pipeline.answer.lru", "pipeline.kv.cache"),
    # Only `jobs.manifests --check-models` reads model files; listing a store needs no torch.
    ("jobs.manifests", "pipeline.kv.models"),
    # Start-up time: `jobs.answer` refuses a bad argument (a question over the limits included)
    # before torch, transformers and pyarrow load.
    ("jobs.answer", "pipeline.answer.answerer"), ("jobs.answer", "pipeline.answer.lookup"),
    ("jobs.answer", "pipeline.kv.models"), ("jobs.answer", "pipeline.store.objects.cache_format"),
}

MAX_FILE_LINES = 500  # in pipeline/, lab/ and jobs/
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for top in PACKAGES:
        for path in sorted((REPO / top).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The project module an imported name lives in (a module, or a name in one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports() -> list[tuple[str, str, bool]]:
    """(importer, imported project module, inside a function) for every import statement."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                owner = _owner(target) if target.split(".")[0] in PACKAGES else None
                if owner and owner != name:
                    found.append((name, owner, node.col_offset > 0))
    return found


IMPORTS = _imports()


def _rank(module: str) -> tuple[str, int]:
    prefix, rank = max(((p, r) for p, r in LAYERS if module == p or module.startswith(p + ".")),
                       key=lambda pr: len(pr[0]))
    return prefix, rank


def test_no_import_circles():
    graph = defaultdict(set)
    for a, b, _ in IMPORTS:
        graph[a].add(b)
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert circles == []


def test_imports_go_down_the_layers_only():
    wrong = []
    for a, b, _ in IMPORTS:
        (pa, ra), (pb, rb) = _rank(a), _rank(b)
        if rb > ra or (rb == ra and pa != pb):
            wrong.append(f"{a} -> {b}")
    assert wrong == []


def test_nothing_imports_a_command_or_a_benchmark():
    """Commands and benchmarks are entry points: the library and the other commands never import
    them; the tests run a command's `main` (that is how a command is tested), never import a
    benchmark (a benchmark's tests run it as a command)."""
    wrong = [f"{a} -> {b}" for a, b, _ in IMPORTS if b.startswith("jobs.")
             and (not a.startswith("tests.") or b.startswith("jobs.bench."))]
    assert wrong == []


def test_the_library_holds_no_lab_code():
    """Each module under `pipeline/` is used by the product (the library or a command other than
    a benchmark): what only the benchmarks, the screen, the demo's comparison or the tests use
    lives in `lab/` or `tests/support/`. A compression method counts as used by its registry."""
    users = defaultdict(set)
    for a, b, _ in IMPORTS:
        users[b].add(a)
    for entry in REGISTRY.values():
        users[f"pipeline.kv.methods.{entry.where.split(':')[0]}"].add("pipeline.kv.methods")
    lab_only = [m for m, path in MODULES.items()
                if m.startswith("pipeline.") and path.name != "__init__.py"
                and not any(u.startswith(("pipeline.", "jobs.")) and not u.startswith("jobs.bench.")
                            for u in users[m])]
    assert lab_only == []


def test_imports_sit_at_the_top_unless_a_reason_is_given():
    lazy = {(a, b) for a, b, inside in IMPORTS if inside and not a.startswith("tests")}
    assert lazy - LAZY == set()


@pytest.mark.parametrize("top", ["pipeline", "lab", "jobs"])
def test_files_and_functions_are_small(top):
    long_files, long_functions = [], []
    for path in sorted((REPO / top).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(str(path.relative_to(REPO)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(REPO)}:{node.name}")
    assert (long_files, long_functions) == ([], [])


def test_manifest_rows_are_read_as_records():
    """Outside the record type, nothing in the library indexes a row by a string key."""
    found = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "pipeline").rglob("*.py"))
             if p.name != "manifest.py"
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r'\brow\["', line)]
    assert found == []


def test_every_package_index_names_its_modules():
    """A package's docstring is its index: each module and sub-package beside it is listed, so
    a reader finds a module from the tree (`pipeline/__init__.py` down)."""
    unlisted = []
    for init in sorted([*(REPO / "pipeline").rglob("__init__.py"), REPO / "lab" / "__init__.py"]):
        index = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        for entry in sorted(init.parent.iterdir()):
            name = entry.name if entry.suffix == ".py" else f"{entry.name}/"
            listed = entry.suffix == ".py" or (entry / "__init__.py").exists()
            if listed and entry.name != "__init__.py" and name not in index:
                unlisted.append(f"{init.parent.relative_to(REPO)}: {name}")
    assert unlisted == []
