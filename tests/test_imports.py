"""The package's import graph has no cycles (issue 15): loading sits above checkpoint, hf and
quantize, and nothing below imports anything above, not even inside a function.

The graph is read from the source with `ast`, so imports inside functions count as much as the
ones at the top of a file. Two back edges are allowed, each as a function-level edge only:
- `GPT.from_pretrained`/`save_pretrained` import `gptlab.hf` inside the method (nanoGPT's
  pattern): `gptlab.model -> gptlab.hf`;
- `python -m gptlab.kernels` (kernels.main, the report of what runs on this CPU) names the GEMM
  choices too: `gptlab.kernels -> gptlab.gemm`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ALLOWED_FUNCTION_EDGES = {("gptlab.model", "gptlab.hf"), ("gptlab.kernels", "gptlab.gemm")}


def module_names(src: Path) -> dict[str, Path]:
    """Every module of the gptlab package under `src`: dotted name -> file."""
    names = {}
    for path in sorted((src / "gptlab").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def lazy_exports(init: Path) -> dict[str, str]:
    """gptlab/__init__.py's `_EXPORTS` table (name -> module), which it imports on first use."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules, exports) -> set[str]:
    """The gptlab modules an import statement runs."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    base = node.module or ""
    if node.level:  # relative: from the importer's package, one level up per extra dot
        package = importer.split(".")[: len(importer.split(".")) - (0 if is_package else 1)]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([node.module] if node.module else []))
    if base not in modules:
        return set()
    targets = set()
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:  # from gptlab import kernels
            targets.add(f"{base}.{alias.name}")
        elif base == "gptlab" and alias.name in exports:  # from gptlab import GPT (lazy)
            targets.add(exports[alias.name])
        elif base != "gptlab":  # the root __init__ imports nothing itself
            targets.add(base)
    return targets


def _parents(module: str, modules) -> set[str]:
    """Subpackages whose __init__ runs before `module` (the root's imports nothing, so it is left out)."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts))} & set(modules)


def import_graph(src: Path = SRC) -> dict[tuple[str, str], str]:
    """Edges (importer, imported) -> "module" when any such import runs at import time, else "function"."""
    modules = module_names(src)
    exports = lazy_exports(modules["gptlab"])
    edges: dict[tuple[str, str], str] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        module_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            kind = "module" if id(node) in module_level else "function"
            for target in _targets(node, name, path.name == "__init__.py", modules, exports):
                for imported in {target} | _parents(target, modules):
                    if imported != name and not name.startswith(imported + "."):
                        if edges.get((name, imported)) != "module":
                            edges[(name, imported)] = kind
    return edges


def cycles(edges) -> list[list[str]]:
    """The graph's strongly connected components with more than one module, each sorted."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def checked_edges(edges) -> dict[tuple[str, str], str]:
    """The graph without the allowed function-level back edges."""
    return {e: kind for e, kind in edges.items() if not (kind == "function" and e in ALLOWED_FUNCTION_EDGES)}


def test_no_import_cycles():
    edges = import_graph()
    assert len(edges) > 50  # the reader found the package's imports (about 150 today)
    assert cycles(checked_edges(edges)) == []


def test_the_model_imports_hf_only_inside_functions():
    edges = import_graph()
    assert edges.get(("gptlab.model", "gptlab.hf")) in (None, "function")


@pytest.mark.parametrize("module", ["gptlab.checkpoint", "gptlab.hf", "gptlab.quantize", "gptlab.formats.nanogpt"])
def test_loading_sits_above_the_formats(module):
    edges = import_graph()
    assert (module, "gptlab.loading") not in edges
    assert ("gptlab.loading", "gptlab.checkpoint") in edges


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "gptlab" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_function_level_cycle_is_found(tmp_path):
    src = _package(
        tmp_path,
        {
            "__init__.py": '_EXPORTS = {"load_model": "gptlab.loading"}\n',
            "checkpoint.py": "def load():\n    from gptlab.loading import load_model\n",
            "loading.py": "from gptlab import checkpoint\n",
            "fmt/__init__.py": "",
            "fmt/x.py": "from .. import loading\n",
            "user.py": "from gptlab import load_model\nfrom gptlab.fmt.x import y\n",
        },
    )
    edges = import_graph(src)
    assert edges[("gptlab.checkpoint", "gptlab.loading")] == "function"
    assert edges[("gptlab.user", "gptlab.loading")] == "module"  # through the lazy export table
    assert {("gptlab.fmt.x", "gptlab.loading"), ("gptlab.user", "gptlab.fmt")} <= set(edges)  # relative, parents
    assert cycles(checked_edges(edges)) == [["gptlab.checkpoint", "gptlab.loading"]]


def test_only_the_allowed_edge_is_forgiven(tmp_path):
    in_function = {"model.py": "def f():\n    from gptlab.hf import load\n", "hf.py": "from gptlab.model import GPT\n"}
    assert cycles(checked_edges(import_graph(_package(tmp_path / "a", {"__init__.py": "", **in_function})))) == []
    at_top = {"model.py": "from gptlab.hf import load\n", "hf.py": "from gptlab.model import GPT\n"}
    assert cycles(checked_edges(import_graph(_package(tmp_path / "b", {"__init__.py": "", **at_top})))) == [
        ["gptlab.hf", "gptlab.model"]
    ]
