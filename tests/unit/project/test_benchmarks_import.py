"""Every Python file under `benchmarks/` (the scripts and each `sitecustomize.py` a benchmark
puts first on `PYTHONPATH`) still fits the code it measures. Nothing else runs them: a module
moved or renamed (`pd_transfer._endpoint`, the kv/trust/common/rank wings), a helper removed
from another script or a new required argument broke them silently.

- It compiles.
- Every module it imports, at the top or inside a function, exists: a project module
  (`pd_transfer`, `pd_testbed`, `pd_operator`, `pd_contract`, `pd_devcluster`) with every
  name imported from it, another benchmark script (`from staging_gpu import Case`,
  `benchmarks.x`) with every name, else the standard library or an installed package.
- Every `module.Class.attr` chain it reads or assigns through a project import resolves.
- Each `sitecustomize.py` patches and wraps only attributes that exist: statically, each
  `(owner, "name", ...)` (`_wrap`, `setattr`, a table row) whose owner is a project module or
  class; then for real, by running its installer with its switch set in a process of its
  own (it patches classes in place), where torch and NIXL are installed (no GPU needed).
- mypy (the project's strict configuration) passes on them: call signatures too.

The static checks import a project module where they can and read its source where it needs
what is not installed here (Triton), so a torch/NIXL-only benchmark is still covered."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pd_testbed.checkout import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

BENCHMARKS = REPO_ROOT / "benchmarks"
PROJECT = ("pd_transfer", "pd_testbed", "pd_operator", "pd_contract", "pd_devcluster")
# Installed with an optional extra or on a GPU machine only: an import of one is not checked.
MAY_BE_ABSENT = frozenset({"matplotlib", "triton", "vllm"})
FILES = sorted(path for path in BENCHMARKS.rglob("*.py")
               if not {"results", "__pycache__"} & set(path.parts))
SITECUSTOMIZE = [path for path in FILES if path.name == "sitecustomize.py"]

# Each sitecustomize.py, the environment that makes it install its patches (one run each).
SWITCHES: dict[str, list[dict[str, str]]] = {
    "handoff": [{"PD_HANDOFF_TIMES": "{tmp}"}],
    "worker_calls": [{"PD_TIME_CALLS": "{tmp}/calls.txt", "PD_PROBE_LAUNCH": "1"},
                     {"PD_EVENT_TIMES": "{tmp}/events.txt"}],
}


def _ids(paths: list[Path]) -> list[str]:
    return [str(path.relative_to(BENCHMARKS)) for path in paths]


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else path.name


def _project(module: str) -> bool:
    return module.partition(".")[0] in PROJECT


# -- what a module has: imported, or read from its source -----------------------------------

@dataclass
class _Source:
    """A module or class known from its source only: the names it binds (a class or def
    node where there is one). ``package``: a project module's dotted name (its submodules
    count as attributes). ``open``: it has names this reading cannot see (a base class
    defined elsewhere): a name not found is not a fault."""

    where: str
    names: dict[str, ast.AST | None] = field(default_factory=dict)
    package: str | None = None
    open: bool = False


def _bound(body: list[ast.stmt]) -> dict[str, ast.AST | None]:
    """The names a module's or class's body binds, looking into if/try/with blocks."""
    names: dict[str, ast.AST | None] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = None
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            nested = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                nested += handler.body
            names.update(_bound(nested))
    return names


def _read(path: Path, where: str, package: str | None) -> _Source:
    return _Source(where, _bound(ast.parse(path.read_text(encoding="utf-8")).body), package)


def _source_file(module: str) -> Path | None:
    """A project module's file, found without importing it or its package."""
    root, *rest = module.split(".")
    spec = importlib.util.find_spec(root)
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations))).joinpath(*rest)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


class _Missing(Exception):
    pass


_CACHE: dict[str, ModuleType | _Source] = {}


def _module(module: str) -> ModuleType | _Source:
    """The project module, imported; read from its source when importing it needs a
    third-party package not installed here. _Missing when it does not exist."""
    if module in _CACHE:
        return _CACHE[module]
    found: ModuleType | _Source
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if _project(missing):
            if missing == module or module.startswith(missing + "."):
                raise _Missing(f"no module {module}") from exc
            raise _Missing(f"{module} imports {missing}, which does not exist") from exc
        path = _source_file(module)  # a third-party dependency missing here (Triton)
        if path is None:
            raise _Missing(f"no module {module}") from exc
        found = _read(path, module, module)
    except ImportError as exc:  # it exists, but a name it imports does not
        raise _Missing(f"{module} cannot be imported: {exc}") from exc
    _CACHE[module] = found
    return found


def _script(module: str, importer: Path) -> Path | None:
    """The benchmark script an import names: ``benchmarks.x`` from the checkout, ``x`` from
    the importer's folder (which a benchmark puts on ``sys.path``)."""
    parts = module.split(".")
    base = REPO_ROOT if parts[0] == "benchmarks" else importer.parent
    path = base.joinpath(*parts).with_suffix(".py")
    return path if path.is_file() else None


def _class(owner: _Source, node: ast.ClassDef) -> _Source:
    """A class of a module read from source: its body's names and those of its bases
    defined in the same module; open when a base is defined elsewhere."""
    names = _bound(node.body)
    is_open = False
    for base in node.bases:
        defined = owner.names.get(base.id) if isinstance(base, ast.Name) else None
        if isinstance(defined, ast.ClassDef):
            inherited = _class(owner, defined)
            names = {**inherited.names, **names}
            is_open = is_open or inherited.open
        else:
            is_open = True
    return _Source(f"{owner.where}.{node.name}", names, None, is_open)


def _attribute(owner: Any, name: str) -> Any:
    """``owner.name``: a real attribute, a submodule, or a name its source binds (None
    where nothing below it can be checked). AttributeError when it has none."""
    if isinstance(owner, _Source):
        if name in owner.names:
            node = owner.names[name]
            return _class(owner, node) if isinstance(node, ast.ClassDef) else None
        if owner.open:
            return None
        if owner.package and _source_file(f"{owner.package}.{name}") is not None:
            return _module(f"{owner.package}.{name}")
        raise AttributeError(f"{owner.where} has no attribute {name!r}")
    if hasattr(owner, name):
        return getattr(owner, name)
    if isinstance(owner, ModuleType):
        try:
            return _module(f"{owner.__name__}.{name}")
        except _Missing:
            pass
    where = owner.__name__ if isinstance(owner, (ModuleType, type)) else repr(owner)
    raise AttributeError(f"{where} has no attribute {name!r}")


def _walkable(value: Any) -> bool:
    """Whether attributes below ``value`` are checked: modules and classes."""
    return isinstance(value, (ModuleType, type)) or (
        isinstance(value, _Source) and not value.open)


# -- what a benchmark file imports and reads ------------------------------------------------

def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _imports(tree: ast.Module) -> Iterator[tuple[int, str, str | None, str]]:
    """(line, module, name or None, local name) of every absolute import, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None, alias.asname or alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.lineno, node.module, alias.name, alias.asname or alias.name


def _imported(module: str, importer: Path) -> ModuleType | _Source | None:
    """What ``import module`` gives the importer: a project module or benchmark script (to
    check), None for the standard library and installed packages (not checked)."""
    top = module.partition(".")[0]
    if _project(module):
        return _module(module)
    if (script := _script(module, importer)) is not None:
        return _CACHE.setdefault(str(script), _read(script, _shown(script), None))
    if top == "benchmarks":
        raise _Missing(f"no benchmark script {module}")
    if (top in sys.stdlib_module_names or top in MAY_BE_ABSENT
            or importlib.util.find_spec(top) is not None):
        return None
    raise _Missing(f"no module {module} (neither a benchmark script beside it nor an "
                   f"installed package)")


def _other_bindings(tree: ast.Module) -> set[str]:
    """Names bound otherwise than by an import somewhere in the file (arguments, targets,
    definitions): a chain through such a name may not be the module, so it is left out."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                               ast.ExceptHandler)) and node.name:
            names.add(node.name)
    return names


def _resolve_imports(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The project objects a file's imports bind (by local name), and what is wrong."""
    problems: list[str] = []
    bound: dict[str, Any] = {}
    for line, module, name, local in _imports(_tree(path)):
        try:
            imported = _imported(module, path)
            if imported is None:
                continue
            if name is not None:
                bound[local] = _attribute(imported, name)
            elif local != module.split(".")[0]:  # import a.b as x binds a.b
                bound[local] = imported
            elif _project(module):  # import a.b binds a
                bound[local] = _module(local)
        except (_Missing, AttributeError) as exc:
            statement = f"from {module} import {name}" if name else f"import {module}"
            problems.append(f"{_shown(path)}:{line}: {statement}: {exc}")
    return bound, problems


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` → ["a", "b", "c"]; None for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _follow(bound: dict[str, Any], parts: list[str]) -> str | None:
    """What is wrong with the chain ``parts`` (rooted at an imported object), or None."""
    value = bound[parts[0]]
    for depth, name in enumerate(parts[1:], start=1):
        if not _walkable(value):
            return None
        try:
            value = _attribute(value, name)
        except AttributeError:
            return f"{'.'.join(parts[:depth + 1])}: {'.'.join(parts[:depth])} has no {name!r}"
    return None


def _problems(path: Path) -> list[str]:
    """Imports that do not resolve; chains through imported project objects that do not
    resolve; in a sitecustomize.py also each ``(owner, "name", ...)`` (``_wrap``,
    ``setattr``, ``getattr``, a table row) whose owner is a project module or class and has
    no such attribute."""
    bound, problems = _resolve_imports(path)
    tree = _tree(path)
    usable = {name for name in bound if name not in _other_bindings(tree)}
    shown = _shown(path)
    inner: set[int] = set()  # a.b.c is checked once, not again as a.b
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            value: ast.expr = node.value
            while isinstance(value, ast.Attribute):
                inner.add(id(value))
                value = value.value
            parts = _chain(node)
            if parts and parts[0] in usable and (problem := _follow(bound, parts)):
                problems.append(f"{shown}:{node.lineno}: {problem}")
        if path.name != "sitecustomize.py" or not isinstance(node, (ast.Tuple, ast.Call)):
            continue
        items = node.elts if isinstance(node, ast.Tuple) else node.args
        if len(items) >= 2 and isinstance(items[1], ast.Constant) and isinstance(
                items[1].value, str):
            parts = _chain(items[0])
            if parts and parts[0] in usable and (
                    problem := _follow(bound, [*parts, items[1].value])):
                problems.append(f"{shown}:{node.lineno}: patches {problem}")
    return problems


# -- the tests ------------------------------------------------------------------------------

def test_the_benchmarks_are_found() -> None:
    assert len(FILES) >= 15
    assert sorted(path.parent.name for path in SITECUSTOMIZE) == sorted(SWITCHES)


@pytest.mark.parametrize("path", FILES, ids=_ids(FILES))
def test_it_compiles(path: Path) -> None:
    compile(path.read_text(encoding="utf-8"), str(path), "exec", dont_inherit=True)


@pytest.mark.parametrize("path", FILES, ids=_ids(FILES))
def test_its_imports_and_attributes_exist(path: Path) -> None:
    assert _problems(path) == []


def test_the_static_check_sees_what_a_rename_leaves_behind(tmp_path: Path) -> None:
    """The check itself: a missing module, name, attribute or patched attribute is reported,
    in a module that imports (Triton-free) or is read from its source (staging_kernel)."""
    (tmp_path / "helper_script.py").write_text("KEPT = 1\n")
    script = tmp_path / "sitecustomize.py"
    script.write_text(
        "from helper_script import KEPT, GONE\n"
        "import no_such_benchmark_script\n"
        "def _install():\n"
        "    from pd_transfer.endpoint import core as endpoint\n"
        "    from pd_transfer.kv import staging, staging_kernel\n"
        "    from pd_transfer.prefill import sender\n"
        "    from pd_transfer import _endpoint\n"
        "    from pd_transfer.kv.layout import KVLayoutGone\n"
        "    endpoint.Endpoint.stepped = None\n"
        "    staging_kernel.Launch.run\n"
        "    staging_kernel.Lunch.run\n"
        "    _wrap(sender.PrefillSender, '_gone', 'label')\n"
        "    for owner, name in ((staging.PageIds, 'select'), (staging, 'prepare_pagez')):\n"
        "        setattr(owner, name, None)\n")
    assert sorted(problem.split(": ", 1)[1] for problem in _problems(script)) == sorted([
        "from helper_script import GONE: helper_script.py has no attribute 'GONE'",
        "import no_such_benchmark_script: no module no_such_benchmark_script (neither a "
        "benchmark script beside it nor an installed package)",
        "from pd_transfer import _endpoint: pd_transfer has no attribute '_endpoint'",
        "from pd_transfer.kv.layout import KVLayoutGone: pd_transfer.kv.layout has no "
        "attribute 'KVLayoutGone'",
        "endpoint.Endpoint.stepped: endpoint.Endpoint has no 'stepped'",
        "staging_kernel.Lunch: staging_kernel has no 'Lunch'",
        "patches sender.PrefillSender._gone: sender.PrefillSender has no '_gone'",
        "patches staging.prepare_pagez: staging has no 'prepare_pagez'",
    ])


_RUN_INSTALLER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("benchmark_sitecustomize", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)  # installs: the switch is set
print("installed")
"""


@pytest.mark.skipif(importlib.util.find_spec("torch") is None
                    or importlib.util.find_spec("nixl") is None,
                    reason="the installers import torch and NIXL (the static check still ran)")
@pytest.mark.parametrize(("path", "switch"), [
    (path, switch) for path in SITECUSTOMIZE for switch in SWITCHES[path.parent.name]],
    ids=[f"{path.parent.name}-{sorted(switch)[0]}" for path in SITECUSTOMIZE
         for switch in SWITCHES[path.parent.name]])
def test_its_installer_runs_without_a_gpu(path: Path, switch: dict[str, str],
                                          tmp_path: Path) -> None:
    """Every ``getattr`` of its ``_wrap`` and every method it reads before replacing it
    resolves, tables of names included (``PREFILL_CALLS``), in a process of its own."""
    switches = {key for runs in SWITCHES.values() for run in runs for key in run}
    env = {key: value for key, value in os.environ.items() if key not in switches}
    env.update({key: value.format(tmp=tmp_path) for key, value in switch.items()})
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), str(REPO_ROOT / "devtools"), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", _RUN_INSTALLER, str(path)], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=100,
                            check=False)
    assert (result.returncode, result.stdout.strip()) == (0, "installed"), result.stderr


_ERROR = re.compile(r"^(benchmarks/\S+?):\d+: error: ", re.MULTILINE)


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")
def test_mypy_passes_on_the_benchmarks() -> None:
    """The scripts in one run (they import each other by file name: ``benchmarks`` on the
    module path), each sitecustomize.py alone (they share a module name). Only errors in
    benchmarks/ count: the product has its own mypy run."""
    scripts = [str(path.relative_to(REPO_ROOT)) for path in FILES if path.parent == BENCHMARKS]
    runs = [scripts, *[[str(path.relative_to(REPO_ROOT))] for path in SITECUSTOMIZE]]
    env = {**os.environ, "MYPYPATH": str(BENCHMARKS)}
    errors = []
    for files in runs:
        result = subprocess.run(
            [sys.executable, "-m", "mypy", "--explicit-package-bases", *files],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=280, check=False)
        errors += [line for line in result.stdout.splitlines() if _ERROR.match(line)]
        assert result.returncode in (0, 1), result.stdout + result.stderr  # 2: mypy failed
    assert errors == []
