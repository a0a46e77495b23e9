"""No package of the project has an import cycle between its modules.

The layers contracts order each package's top-level modules and each wing, but a cycle
inside one package stays legal to them: `decode/` had one (its allocations and arrivals
imported the receiver they were composed by, under TYPE_CHECKING, and reached into its
private members) until its collaborators got a context of their own. The graph is
import-linter's (grimp), TYPE_CHECKING imports included; a cycle is a strongly connected
component of more than one module. Needs neither NIXL nor a GPU.
"""

from __future__ import annotations

import grimp
import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGES = ("pd_contract", "pd_devcluster", "pd_operator", "pd_testbed", "pd_transfer")


def _cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """Every strongly connected component of more than one module of `package` in `graph`
    (Tarjan's, iterative)."""
    modules = sorted(m for m in graph.modules if m.split(".")[0] == package)
    edges = {m: sorted(i for i in graph.find_modules_directly_imported_by(m)
                       if i.split(".")[0] == package) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, next_edge = work.pop()
            if next_edge == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            for position in range(next_edge, len(edges[node])):
                target = edges[node][position]
                if target not in index:
                    work += [(node, position + 1), (target, 0)]
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return found


def test_a_cycle_of_three_modules_is_found() -> None:
    """The search itself, on the tree's own smallest known shape: a cycle through three
    modules (as decode's was) and a module beside it that only imports into the cycle."""
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c", "p.d"):
        graph.add_module(module)
    for importer, imported in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.d", "p.a")):
        graph.add_import(importer=importer, imported=imported)
    assert _cycles(graph, "p") == [["p.a", "p.b", "p.c"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_has_an_import_cycle(package: str) -> None:
    assert _cycles(grimp.build_graph(package, cache_dir=None), package) == []
