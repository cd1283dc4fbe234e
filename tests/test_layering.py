"""The package's floors (docs/architecture.md): no import runs up a floor, no import circle.

Every import counts, at module level, inside functions (lazy) and under TYPE_CHECKING: a
lazy import is still a dependency, and a circle of them is still a tangle to read.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "roundpipe"

# Bottom to top; a module may import its own floor and the floors below.  The longest prefix wins.
FLOORS = {
    "roundpipe.core": 0, "roundpipe.trace": 0, "roundpipe.testing": 0, "roundpipe._version": 0,
    "roundpipe._native": 1, "roundpipe.hostops": 1, "roundpipe.offload": 1, "roundpipe.optim": 1,
    "roundpipe.quant": 1, "roundpipe.kernels": 1, "roundpipe.models": 1, "roundpipe.shapes": 1,
    "roundpipe.workers": 2, "roundpipe.planner": 2, "roundpipe.sim": 2,
    "roundpipe.engine": 3,
    "roundpipe.hf": 4, "roundpipe.diffusers": 4, "roundpipe.commands": 4, "roundpipe.bench": 4, "roundpipe": 4,
}
FLOOR_NAMES = ["primitives", "native, offload, optim, quant", "workers, planner, sim", "engine",
               "hf, diffusers, commands, bench"]


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    for path in sorted((ROOT / "kernels").glob("*.py")):   # installed as roundpipe.kernels
        out["roundpipe.kernels" + ("" if path.stem == "__init__" else "." + path.stem)] = path
    return out


def imported(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """The roundpipe modules `name` imports (a `from pkg import mod` names the submodule)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("roundpipe"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("roundpipe"):
                continue
            subs = {f"{source}.{a.name}" for a in node.names} & known.keys()
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(source)
    return {m for m in out if m in known and m != name}


def floor(name: str) -> int:
    best = max((p for p in FLOORS if name == p or name.startswith(p + ".")), key=len)
    return FLOORS[best]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def test_every_module_has_a_floor():
    """A new top-level module or package is placed on a floor on purpose."""
    for name in modules():
        assert any(name == p or name.startswith(p + ".") for p in FLOORS if p != "roundpipe") \
            or name == "roundpipe" or name.count(".") == 1 and name in ("roundpipe.__main__",), name


def test_no_import_runs_up_a_floor():
    """Each import goes to the same floor or lower."""
    upward = [f"{a} (floor {floor(a)}: {FLOOR_NAMES[floor(a)]}) imports {b} (floor {floor(b)})"
              for a, deps in graph().items() for b in sorted(deps) if floor(b) > floor(a)
              and not (b == "roundpipe" and a.startswith("roundpipe."))]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    """No module reaches itself through imports (Tarjan's strongly connected components)."""
    g = graph()
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w == "roundpipe":   # the lazy public namespace: importing a package runs it first
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("name", ["roundpipe.core.tree", "roundpipe.planner.plan"])
def test_the_checker_sees_imports(name):
    """The graph is not empty: known edges show (a checker that sees nothing passes everything)."""
    g = graph()
    assert any(name in deps for deps in g.values()), name


# Underscore names that belong to other libraries, read where their public API has no equivalent:
# nn.Module's parameter/buffer tables (rebinding a replica's weights without a copy), a tensor's
# version counter (torch's in-place check), a named tuple's _replace.
FOREIGN_PRIVATE = {"_parameters", "_buffers", "_version", "_replace", "_fields", "_asdict"}


def private_names(tree: ast.AST) -> set[str]:
    """The underscore names a module defines: functions, classes, module globals, attributes it assigns."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def reach_ins(trees: dict[str, ast.AST], known) -> list[str]:
    """`from m import _x` and `obj._x` where `_x` is defined by another roundpipe module only."""
    defined = {name: private_names(tree) for name, tree in trees.items()}
    owners: dict[str, set[str]] = {}
    for name, names in defined.items():
        for n in names:
            owners.setdefault(n, set()).add(name)
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("roundpipe"):
                for a in node.names:
                    if not a.name.startswith("_") or a.name.startswith("__") or a.name == "_C":
                        continue
                    private_module = f"{node.module}.{a.name}" in known
                    # a package's private module is its own: only modules inside that package import it
                    if not private_module or not (name == node.module or name.startswith(node.module + ".")):
                        found.append(f"{name}:{node.lineno} from {node.module} import {a.name}")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if node.attr in defined[name] or node.attr in FOREIGN_PRIVATE or node.attr not in owners:
                    continue
                found.append(f"{name}:{node.lineno} {ast.unparse(node)} (defined in {', '.join(sorted(owners[node.attr]))})")
    return found


def test_no_module_reads_another_modules_private_name():
    """No reach-ins: a name another module needs is public there (or has a public seam)."""
    known = modules()
    found = reach_ins({name: ast.parse(path.read_text(), str(path)) for name, path in known.items()}, known)
    assert not found, "\n".join(found)


def test_the_private_name_check_sees_a_reach_in():
    """The scanner flags both kinds of reach-in in made-up modules, and a module's own private names not."""
    trees = {"roundpipe.a": ast.parse("_table = {}\nclass M:\n    def __init__(self):\n        self._count = 0\n"),
             "roundpipe.b": ast.parse("from roundpipe.a import _table\ndef f(m):\n    return m._count\n"),
             "roundpipe.c": ast.parse("class N:\n    def g(self, other):\n        self._count = other._count\n"),
             "roundpipe.k._impl": ast.parse("x = 1\n"), "roundpipe.k.ops": ast.parse("from roundpipe.k import _impl\n"),
             "roundpipe.h.use": ast.parse("from roundpipe.k import _impl\n")}
    found = reach_ins(trees, set(trees))
    assert found == ["roundpipe.b:1 from roundpipe.a import _table", "roundpipe.b:3 m._count (defined in roundpipe.a, roundpipe.c)",
                     "roundpipe.h.use:1 from roundpipe.k import _impl"]
