"""tfpar's layers, lowest first; a module imports only from its own layer or lower ones,
and no modules import each other in a circle.

    0 tfpar.errors, tfpar.version            what every layer shares
    1 tfpar.plan, tfpar.partition            pure decisions (no TensorFlow)
    2 tfpar.graph                            reads a TensorFlow graph, needs no job
    3 tfpar.transform                        rewrites a graph for a plan
    4 tfpar.runtime                          needs a running job
    5 tfpar.testing                          tools for tests and benchmarks
    6 tfpar (the public API), tfpar.cli, tfpar.supervisor (`tfpar run`)

Every import counts, inside functions too (a deferred import is still a dependency).
"""
import ast
import os

TFPAR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tfpar")
LAYERS = [("tfpar.errors", "tfpar.version"), ("tfpar.plan", "tfpar.partition"),
          ("tfpar.graph",), ("tfpar.transform",), ("tfpar.runtime",), ("tfpar.testing",),
          ("tfpar.cli", "tfpar.supervisor", "tfpar")]


def layer(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "tfpar"):
            return i
    assert module == "tfpar", f"{module} is in no layer: add it to LAYERS"
    return len(LAYERS) - 1


def modules():
    """{dotted name: path} of every module of the package."""
    out = {}
    for root, _, files in os.walk(TFPAR):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), os.path.dirname(TFPAR))
                name = rel[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = \
                    os.path.join(root, f)
    return out


def imports(path: str, top_level_only: bool = False):
    """The tfpar modules a file imports (from-imports of a name resolved to the module
    when it is one)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    known = modules()
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "tfpar"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tfpar":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
    return found


def test_imports_only_go_down():
    upward = []
    for name, path in modules().items():
        for target in imports(path):
            if layer(target) > layer(name):
                upward.append(f"{name} (layer {layer(name)}) imports {target} "
                              f"(layer {layer(target)})")
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    """Module-level imports, each also running the packages that hold its target."""
    known = modules()
    edges = {}
    for name, path in known.items():
        targets = set()
        for t in imports(path, top_level_only=True):
            parts = t.split(".")
            targets |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        edges[name] = {t for t in targets if t in known and t != name
                       and not name.startswith(t + ".")}  # its own packages ran first
    seen, stack, circles = {}, [], []

    def visit(m):
        seen[m] = "open"
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if seen.get(t) == "open":
                circles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in seen:
                visit(t)
        stack.pop()
        seen[m] = "done"
    for m in sorted(known):
        if m not in seen:
            visit(m)
    assert not circles, "\n".join(circles)


def test_the_check_sees_an_upward_import(tmp_path):
    """The layer rule is not vacuous: a plan module importing the runtime is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from tfpar.runtime import job\n")
    assert imports(str(bad)) == {"tfpar.runtime.job"}
    assert layer("tfpar.runtime.job") > layer("tfpar.plan.planner")
