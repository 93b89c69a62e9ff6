"""The layers of docs/ARCHITECTURE.md hold: every module under py/txmq (and
the PySpark source, py/pyspark_txmq) is parsed, its imports at module level
and inside functions alike, and the import graph must have no cycle, no
edge from a lower layer to a higher one, and no import of a txmq module
inside a function (the way a cycle is usually hidden). The checks are
shown to fail on synthetic graphs and sources."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = os.path.join(ROOT, "py")

# Lowest first. A module belongs to the layer of its longest matching
# prefix; compiled modules (txmq._name) are base.
LAYERS = [
    ("base", ("txmq.errors", "txmq.options", "txmq.message", "txmq.files", "txmq.crashpoints",
              "txmq.scheduler", "txmq.batcharrow", "txmq._")),
    ("transactions", ("txmq.transactions",)),
    ("storage", ("txmq.storage",)),
    ("dispatch", ("txmq.dispatch",)),
    ("client", ("txmq.client",)),
    ("broker", ("txmq.broker",)),
    ("requester", ("txmq.requester",)),
    ("front ends", ("txmq.kafka", "txmq.flight")),
    ("functions", ("txmq.functions",)),
    ("public", ("txmq", "txmq.readonly", "txmq.ingest", "txmq.control")),
    ("twophase", ("txmq.twophase",)),
    ("testing", ("txmq.testing",)),
    ("demo", ("txmq.demo",)),
    ("cli", ("txmq.cli",)),
    ("spark", ("pyspark_txmq",)),
]

# Finer rules inside the order: what a layer may take from one below it.
# Storage takes only the ids and records of transactions.
ONLY = {("storage", "transactions"): ("txmq.transactions.records",)}

OURS = ("txmq", "pyspark_txmq")


def layer_of(module: str, layers=LAYERS) -> tuple[int, str]:
    best = None
    for rank, (name, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + ".") or (prefix.endswith("_") and
                                                                       module.startswith(prefix)):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), rank, name)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to tests/project/test_layers.py and docs/ARCHITECTURE.md")
    return best[1], best[2]


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, PY)[:-3].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel)


def sources() -> dict[str, str]:
    """Module name -> source of every module under py/txmq and py/pyspark_txmq."""
    out = {}
    for top in OURS:
        for d, _, files in os.walk(os.path.join(PY, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    with open(path, encoding="utf-8") as fh:
                        out[_module_name(path)] = fh.read()
    return out


def imports(module: str, source: str, is_package: bool, known: set) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function?, line) for each of our modules
    that ``source`` imports. ``from pkg import name`` names module
    ``pkg.name`` when that is a module, else ``pkg``."""
    out = []

    def ours(name: str) -> bool:
        return name.split(".")[0] in OURS

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if ours(alias.name):
                        out.append((alias.name, in_function, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = module.split(".")
                    keep = len(parts) - child.level + (1 if is_package else 0)
                    base = ".".join(parts[:keep] + ([base] if base else []))
                if ours(base):
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        target = sub if (sub in known or alias.name.startswith("_") and base == "txmq") else base
                        out.append((target, in_function, child.lineno))
            visit(child, inside)

    visit(ast.parse(source), False)
    return out


def graph_of(srcs: dict[str, str]) -> tuple[dict[str, set], list[str]]:
    """The import graph (module -> modules it imports) and every import of
    one of our modules made inside a function."""
    known = set(srcs)
    graph: dict[str, set] = {m: set() for m in srcs}
    in_functions = []
    for module, source in srcs.items():
        is_package = any(k.startswith(module + ".") for k in known)
        for target, in_function, line in imports(module, source, is_package, known):
            if target.split(".")[0] == "txmq" and in_function:
                in_functions.append(f"{module}:{line} imports {target} inside a function")
            if target != module:
                graph[module].add(target)
    return graph, in_functions


def find_cycle(graph: dict[str, set]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def upward_edges(graph: dict[str, set], layers=LAYERS, only=ONLY) -> list[str]:
    """Every edge from a layer to a higher one, and every edge a finer rule
    (``only``) forbids."""
    bad = []
    for src, targets in sorted(graph.items()):
        src_rank, src_layer = layer_of(src, layers)
        for dst in sorted(targets):
            dst_rank, dst_layer = layer_of(dst, layers)
            if dst_rank > src_rank:
                bad.append(f"{src} ({src_layer}) imports {dst} ({dst_layer}), a higher layer")
            allowed = only.get((src_layer, dst_layer))
            if allowed is not None and dst not in allowed:
                bad.append(f"{src} ({src_layer}) imports {dst}: from {dst_layer} it may import only {allowed}")
    return bad


def check(graph: dict[str, set], in_functions: list[str], layers=LAYERS, only=ONLY) -> None:
    """Raise AssertionError naming what breaks the layering."""
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    bad = upward_edges(graph, layers, only)
    assert not bad, "upward imports:\n" + "\n".join(bad)
    assert not in_functions, "function-level imports of txmq modules:\n" + "\n".join(in_functions)


# -- the code as it is -------------------------------------------------------------------

def test_every_module_is_in_a_layer_and_the_layers_hold():
    srcs = sources()
    assert "txmq.broker.broker" in srcs and "txmq.storage.partition" in srcs    # (the walk found the tree)
    graph, in_functions = graph_of(srcs)
    for module in graph:
        layer_of(module)
    check(graph, in_functions)


def test_storage_never_imports_dispatch_client_broker_or_requester():
    graph, _ = graph_of(sources())
    for module, targets in graph.items():
        if layer_of(module)[1] == "storage":
            assert not [t for t in targets if layer_of(t)[1] in ("dispatch", "client", "broker", "requester")], module


def test_the_public_modules_are_thin():
    """txmq.readonly, txmq.ingest and txmq.control only name what the
    folders hold: imports, ``__all__`` and a docstring."""
    srcs = sources()
    for name in ("txmq.readonly", "txmq.ingest", "txmq.control"):
        body = ast.parse(srcs[name]).body
        for node in body:
            assert isinstance(node, (ast.ImportFrom, ast.Import, ast.Expr, ast.Assign)), (name, ast.dump(node)[:80])
            if isinstance(node, ast.Assign):
                assert [t.id for t in node.targets] == ["__all__"], name


def test_the_old_broker_ingest_control_cycle_is_gone():
    graph, _ = graph_of(sources())
    assert "txmq.broker.broker" in graph["txmq.requester.control_client"]     # the requester opens a Broker ...
    assert not [t for m, ts in graph.items() if m.startswith("txmq.broker") for t in ts
                if t.startswith(("txmq.requester", "txmq.ingest", "txmq.control"))]   # ... never the reverse


# -- the checks can fail -----------------------------------------------------------------

def test_a_cycle_is_found():
    graph = {"txmq.storage.a": {"txmq.storage.b"}, "txmq.storage.b": {"txmq.storage.c"},
             "txmq.storage.c": {"txmq.storage.a"}}
    assert find_cycle(graph) == ["txmq.storage.a", "txmq.storage.b", "txmq.storage.c", "txmq.storage.a"]
    with pytest.raises(AssertionError, match="import cycle: txmq.storage.a -> txmq.storage.b"):
        check(graph, [])


def test_an_upward_edge_is_found():
    graph = {"txmq.storage.log": {"txmq.broker.broker", "txmq.errors"}, "txmq.broker.broker": set(),
             "txmq.errors": set()}
    assert find_cycle(graph) is None
    with pytest.raises(AssertionError, match=r"txmq.storage.log \(storage\) imports txmq.broker.broker "
                                             r"\(broker\), a higher layer"):
        check(graph, [])


def test_storage_taking_more_than_the_records_of_transactions_is_found():
    graph = {"txmq.storage.log": {"txmq.transactions.coordinator"}, "txmq.transactions.coordinator": set()}
    with pytest.raises(AssertionError, match="it may import only"):
        check(graph, [])
    check({"txmq.storage.log": {"txmq.transactions.records"}, "txmq.transactions.records": set()}, [])


def test_the_hidden_cycle_of_a_function_level_import_is_found():
    """The shape this layering removed: broker -> ingest -> control, and
    control importing the broker inside a function."""
    srcs = {
        "txmq.broker": "from txmq.ingest import Ingester\n",
        "txmq.ingest": "from txmq import control\nclass Ingester: pass\n",
        "txmq.control": "import os\n\ndef request():\n    from txmq.broker import Broker\n    return Broker\n",
    }
    graph, in_functions = graph_of(srcs)
    assert in_functions == ["txmq.control:4 imports txmq.broker inside a function"]
    assert find_cycle(graph) == ["txmq.broker", "txmq.ingest", "txmq.control", "txmq.broker"]
    with pytest.raises(AssertionError, match="import cycle"):
        check(graph, in_functions, layers=[("all", ("txmq",))])
    with pytest.raises(AssertionError, match="function-level imports"):
        check({m: set() for m in srcs}, in_functions, layers=[("all", ("txmq",))])


def test_a_module_in_no_layer_is_refused():
    with pytest.raises(AssertionError, match="is in no layer"):
        layer_of("elsewhere.thing")
