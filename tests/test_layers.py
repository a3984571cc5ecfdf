"""The package's layer table (docs/ARCHITECTURE.md) holds: imports point down it, never in a circle.

Every import counts, at module level or inside a function, since a lazy import is a dependency
all the same; an import under ``if TYPE_CHECKING:`` counts for direction (a type from above is a
dependency on above) but not for circles, as it never runs. The few imports allowed to point up
are listed in the document's second table, each with its reason, and there may be at most three.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pagedllm"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
MAX_UPWARD = 3


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    type_only: bool


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    base = ROOT / name.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def package_imports() -> list[Import]:
    imports: list[Import] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        type_only = _type_checking_lines(tree)
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # `from pagedllm.x import y` depends on y itself when y is a module.
                submodules = [f"{module}.{a.name}" for a in node.names if _is_module(f"{module}.{a.name}")]
                targets = submodules if submodules and len(submodules) == len(node.names) else [module, *submodules]
            for target in targets:
                if target == "pagedllm" or target.startswith("pagedllm."):
                    imports.append(Import(source, target, node.lineno, node.lineno in type_only))
    return imports


def _table_after(heading: str) -> list[list[str]]:
    text = ARCHITECTURE.read_text()
    assert heading in text, f"docs/ARCHITECTURE.md has no {heading!r} section"
    rows = []
    for line in text.split(heading, 1)[1].splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows[1:]  # the header row


def layer_table() -> list[tuple[str, list[str]]]:
    """(layer, the modules and folders it holds as dotted prefixes), top to bottom."""
    layers = []
    for row in _table_after("## Layers"):
        names = re.findall(r"`([^`]+)`", row[1])
        prefixes = ["pagedllm" if n == "pagedllm" else "pagedllm." + n.rstrip("/").removesuffix(".py").replace("/", ".")
                    for n in names]
        layers.append((row[0], prefixes))
    assert layers, "the layer table is empty"
    return layers


def allowed_upward() -> set[tuple[str, str]]:
    rows = _table_after("## Imports that point up")
    return {(re.sub(r"[`]", "", r[0]), re.sub(r"[`]", "", r[1])) for r in rows}


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int:
    best, index = -1, -1
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            exact = prefix == "pagedllm"
            if (module == prefix or (not exact and module.startswith(prefix + "."))) and len(prefix) > best:
                best, index = len(prefix), i
    return index


def test_every_module_has_a_layer() -> None:
    layers = layer_table()
    unplaced = [module_name(p) for p in PACKAGE.rglob("*.py") if layer_of(module_name(p), layers) < 0]
    assert not unplaced, f"modules in no row of docs/ARCHITECTURE.md's layer table: {unplaced}"


def test_imports_point_down_the_layer_table() -> None:
    layers = layer_table()
    allowed = allowed_upward()
    assert len(allowed) <= MAX_UPWARD, f"{len(allowed)} upward imports allowed; at most {MAX_UPWARD}"
    upward, used = [], set()
    for imp in package_imports():
        src, dst = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if dst < src:
            pair = (imp.source, imp.target)
            if pair in allowed:
                used.add(pair)
                continue
            upward.append(f"{imp.source}:{imp.line} ({layers[src][0]}) imports {imp.target} ({layers[dst][0]})")
    assert not upward, "imports that point up the layer table:\n" + "\n".join(upward)
    assert used == allowed, f"allowed upward imports that no longer exist (drop them from the table): {allowed - used}"


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle() -> None:
    edges: dict[str, set[str]] = {}
    for imp in package_imports():
        if not imp.type_only and imp.source != imp.target:
            edges.setdefault(imp.source, set()).add(imp.target)
    circles = _circles(edges)
    assert not circles, f"modules that import each other, directly or round a circle: {circles}"


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_core_layer_never_imports_torch() -> None:
    layers = layer_table()
    core = next(i for i, (name, _) in enumerate(layers) if name == "core")
    modules = sorted(module_name(p) for p in PACKAGE.rglob("*.py") if layer_of(module_name(p), layers) == core)
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "assert 'torch' not in sys.modules\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"importing the core layer ({modules}) imported torch: {result.stderr[-2000:]}"
