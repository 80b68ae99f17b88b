"""The import graph stays layered (docs/architecture.md): a module imports only from its
own package or from a lower layer, and no two modules import each other, directly or
around a circle. Imports inside functions and under TYPE_CHECKING count too, and so does
`importlib.import_module("looprl....")` with a literal name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "looprl"

# bottom to top; packages on one rank do not import each other
LAYERS: list[tuple[str, ...]] = [
    ("errors", "types", "seeds", "children"),
    ("config", "algo", "chat"),
    ("envs",),
    ("model",),
    ("forward",),
    ("engine",),
    ("report", "openai"),
    ("agents",),
    ("loop",),
    ("apps", "plan", "tinker"),
    ("cli",),
    ("__main__",),
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every looprl module `path` imports (`from looprl.x import y` counts y when y is a
    module of its own; `importlib.import_module("looprl.x")` with a literal name counts)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("looprl"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("looprl"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if module_path(sub) is not None else target)
        elif (literal := import_module_literal(node)) and literal.startswith("looprl"):
            found.add(literal)
    found.discard(name)
    return found


def import_module_literal(node: ast.AST) -> str | None:
    """The name in `importlib.import_module("...")` (or a bare `import_module("...")`) when
    it is a literal string: an import the statements above do not show."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    arg = node.args[0]
    if called == "import_module" and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def module_path(name: str) -> Path | None:
    rel = Path(*name.split(".")[1:])
    for candidate in (ROOT / rel.with_suffix(".py"), ROOT / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "looprl"


GRAPH = {module_name(p): imported_modules(p) for p in sorted(ROOT.rglob("*.py"))}


def test_every_package_has_a_layer():
    unknown = {layer_of(m) for m in GRAPH} - set(RANK) - {"looprl"}
    assert not unknown, f"give these a layer in tests/test_layers.py and docs: {unknown}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a module to a package on its own rank or a higher one."""
    return sorted(
        f"{module} -> {dep}"
        for module, deps in graph.items()
        if module != "looprl"
        for dep in deps
        if layer_of(module) != layer_of(dep) and RANK[layer_of(dep)] >= RANK[layer_of(module)]
    )


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep, [*path, dep])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [module])):
            return cycle
    return None


def test_imports_go_down_the_layers():
    upward = upward_imports(GRAPH)
    assert not upward, "imports that go up or sideways:\n" + "\n".join(upward)


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def reaches(graph: dict[str, set[str]], start: str, target: str) -> bool:
    """Whether `start` imports `target`, directly or through other looprl modules."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        for name in graph.get(module, set()) - seen:
            if name == target:
                return True
            seen.add(name)
            todo.append(name)
    return False


# the training step's rooms: the held-out eval imports them, never the reverse
STEP_ROOMS = ("step", "groups", "overlap", "update", "replay", "sources", "levers", "batches")


def test_the_step_does_not_import_the_eval():
    reached = [m for m in STEP_ROOMS if reaches(GRAPH, f"looprl.loop.{m}", "looprl.loop.evaluate")]
    assert not reached, f"loop/evaluate.py imported from the step's rooms: {reached}"


def test_the_checks_catch_what_they_guard():
    """An upward import (even a lazy one inside a function, or one through
    `importlib.import_module` with a literal name) and a circle are reported."""
    planted = dict(GRAPH, **{"looprl.loop.levers": {"looprl.loop.evaluate"}})
    assert reaches(planted, "looprl.loop.step", "looprl.loop.evaluate")
    source = "def late():\n    from looprl.loop import train\n"
    assert "looprl.loop.train" in imported_modules_of(source, "looprl.chat.render")
    source = "import importlib\n\ndef late():\n    importlib.import_module('looprl.loop.train')\n"
    assert "looprl.loop.train" in imported_modules_of(source, "looprl.chat.render")
    graph = dict(GRAPH, **{"looprl.chat.render": {"looprl.loop.train"}})
    assert upward_imports(graph) == ["looprl.chat.render -> looprl.loop.train"]
    circle = {
        "looprl.apps.play": {"looprl.apps.play_web"},
        "looprl.apps.play_web": {"looprl.apps.play"},
    }
    assert find_cycle(circle) == ["looprl.apps.play", "looprl.apps.play_web", "looprl.apps.play"]


def imported_modules_of(source: str, name: str) -> set[str]:
    path = ROOT.joinpath(*name.split(".")[1:]).with_suffix(".py")
    probe = path.with_name(f"_layers_probe_{path.name}")
    probe.write_text(source)
    try:
        return imported_modules(probe)
    finally:
        probe.unlink()


def package_arrows(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import."""
    arrows: dict[str, set[str]] = {}
    for module, deps in graph.items():
        for dep in deps:
            if layer_of(module) not in (layer_of(dep), "looprl"):
                arrows.setdefault(layer_of(module), set()).add(layer_of(dep))
    return arrows


if __name__ == "__main__":  # `python tests/test_layers.py` prints the graph of docs/architecture.md
    arrows = package_arrows(GRAPH)
    for rank in range(len(LAYERS) - 1, -1, -1):
        for package in LAYERS[rank]:
            targets = sorted(arrows.get(package, ()), key=lambda t: (-RANK[t], t))
            print(f"{rank:>2}  {package:<9} ─► {', '.join(targets) or '(nothing)'}")
