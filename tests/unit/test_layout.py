"""The layout shows the design: the packages of ``seamline`` import each other without a cycle
(functions' own imports included), only the entry points import the server, ``parallel``
holds collectives only, a node and the coordinator share only ``mesh.protocol``, the
planner is arithmetic (no torch, no model), only the runtime drives the scheduler, and the
coordinator's state changes only through its events; no test imports another test file."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import seamline

ROOT = Path(seamline.__file__).parent
ENTRY_POINTS = {"cli"}  # what a user runs; it may import anything


def _package(module: str) -> str:
    """``seamline.mesh.node.process`` -> ``mesh.node``; ``seamline.runtime.engine`` -> ``runtime``;
    ``seamline.text`` -> ``text``. The mesh's subpackages count apart: each has its own job."""
    parts = module.split(".")[1:]
    return (
        f"mesh.{parts[1]}"
        if parts[0] == "mesh" and len(parts) > 1 and parts[1] != "__init__"
        else parts[0]
    )


def _imports() -> dict[str, set[str]]:
    """Package -> the other packages its modules import."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        module = ".".join(("seamline", *path.relative_to(ROOT).with_suffix("").parts))
        if path.name == "__init__.py":
            module += ".__init__"
        source = _package(module)
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for target in {_package(name) for name in names if name.startswith("seamline.")} - {
                source
            }:
                graph[source].add(target)
    return graph


def test_packages_import_each_other_without_a_cycle() -> None:
    graph = _imports()
    assert "runtime" in graph["mesh.node"] and "net" in graph["runtime"]  # the walk sees imports
    for start in list(graph):
        reached, frontier = set(), [start]
        while frontier:
            for nxt in graph[frontier.pop()]:
                if nxt not in reached:
                    reached.add(nxt)
                    frontier.append(nxt)
        assert start not in reached, f"{start} imports itself through {sorted(reached)}"


def test_the_package_never_imports_the_benchmarks() -> None:
    """The benchmarks are a package of their own (bench/), reached through an entry point."""
    assert not (ROOT / "bench").exists()
    importers = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            importers += [
                f"{path.relative_to(ROOT)}: {n}"
                for n in names
                if n.split(".")[0] == "seamline_bench"
            ]
    assert not importers


def test_only_entry_points_import_the_server_and_parallel_holds_collectives() -> None:
    graph = _imports()
    assert sorted(p for p, deps in graph.items() if "server" in deps) == sorted(ENTRY_POINTS)
    assert graph["parallel"] <= {"errors", "net"}
    assert graph["net"] <= {"errors", "params"}  # the wire knows no runtime


def test_node_and_coordinator_share_only_the_protocol_package() -> None:
    graph = _imports()
    assert (
        "mesh.protocol" in graph["mesh.node"] and "mesh.protocol" in graph["mesh.control"]
    )  # the walk sees them
    assert "mesh.control" not in graph["mesh.node"]
    assert not graph["mesh.protocol"] & {"mesh.control", "mesh.node"}


@pytest.mark.parametrize("package", ["mesh.plan", "sim"])
def test_the_planner_and_simulator_are_arithmetic_without_torch_or_the_model(package: str) -> None:
    graph = _imports()
    assert (
        "mesh.plan" in graph["sim"] and "ownership" in graph["mesh.plan"]
    )  # the walk sees their imports
    assert "model" not in graph[package]
    code = (
        f"import importlib, pkgutil, sys, seamline.{package} as p\n"
        f"for m in pkgutil.iter_modules(p.__path__): importlib.import_module('seamline.{package}.' + m.name)\n"
        "print(sorted(k for k in sys.modules if k in ('torch', 'transformers') or k.startswith('seamline.model')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", f"importing seamline.{package} loads {out.stdout.strip()}"


def test_only_the_runtime_drives_the_scheduler() -> None:
    """One loop: a scheduler is driven by the runtime's engine core only (the one-process loop,
    ``Engine``, stage 0 of a pipeline); nothing else in seamline imports it."""
    importers = []
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).parts[0] == "runtime":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module == "seamline.runtime":
                names += [f"seamline.runtime.{alias.name}" for alias in node.names]
            importers += [
                f"{path.relative_to(ROOT)} imports {n}"
                for n in names
                if n == "seamline.runtime.scheduler"
            ]
    assert not importers, importers


MESH_STATE = {
    "nodes",
    "plan",
    "plan_id",
    "state",
    "ready",
    "closing",
}  # the coordinator's, in ``MeshState``
COORDINATOR_PARTS = {"Coordinator", "Joining", "Planning", "StartUp"}


def test_the_coordinator_state_changes_only_through_its_events() -> None:
    """Nothing in the mesh's control assigns the coordinator's state (``coordinator.plan = ...``,
    ``self.nodes[x] = ...`` in the coordinator or its parts), nor sets or clears its readiness,
    outside ``mesh_state.apply`` and the keeper that applies it."""
    writes = []
    for path in (ROOT / "mesh" / "control").glob("*.py"):
        if path.name in ("mesh_state.py", "state_keeper.py"):
            continue
        tree = ast.parse(path.read_text())
        others = {
            id(n)
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef) and c.name not in COORDINATOR_PARTS
            for n in ast.walk(c)
        }  # their ``self`` is not the coordinator
        for node in ast.walk(tree):
            writes += [
                f"{path.name}:{node.lineno}"
                for t in _written(node)
                if isinstance(t, ast.Attribute)
                and t.attr in MESH_STATE
                and isinstance(t.value, ast.Name)
                and t.value.id
                in ("c", "coordinator", *(("self",) if id(node) not in others else ()))
            ]
    assert not writes, writes


def _written(node: ast.AST) -> list[ast.expr]:
    """What ``node`` assigns (a subscript's container included), or sets or clears."""
    targets = list(node.targets) if isinstance(node, ast.Assign) else []
    targets += [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
    targets = [
        t
        for target in targets
        for t in (target.elts if isinstance(target, ast.Tuple) else [target])
    ]
    targets = [t.value if isinstance(t, ast.Subscript) else t for t in targets]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("set", "clear")
    ):
        targets.append(node.func.value)
    return targets


def test_no_test_imports_another_test_file() -> None:
    """What tests share lives in tests/support (or a harness module), never in a test file."""
    tests = Path(__file__).parents[1]
    reaching = []
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            reaching += [
                f"{path.name} imports {n}" for n in names if n.split(".")[-1].startswith("test_")
            ]
    assert (tests / "support").is_dir() and not reaching, reaching


TIERS = ("unit", "model", "api", "mesh")  # the README says what each holds and how to run one


def test_every_test_lives_in_a_tier_and_shared_code_in_support() -> None:
    tests = Path(__file__).parents[1]
    loose = sorted(
        p.name for p in tests.glob("*.py") if p.name not in ("__init__.py", "conftest.py")
    )
    tiers = {p.parent.name for p in tests.rglob("test_*.py")}
    assert not loose, f"{loose} belong in a tier or in tests/support"
    assert tiers == set(TIERS), tiers
    assert not [p for p in (tests / "support").glob("test_*.py")]


def _readme_table() -> dict[str, set[str] | None]:
    """The README's "may import" table: package -> what it may import (None: anything)."""
    readme = (ROOT.parent / "README.md").read_text()
    table: dict[str, set[str] | None] = {}
    for line in readme.split("| package | may import |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        allowed = cells[1].split("(")[0].strip()
        for package in (p.strip().strip("`") for p in cells[0].split(",")):
            table[package] = (
                None
                if allowed == "anything"
                else (
                    set()
                    if allowed == "nothing of seamline"
                    else {a.strip() for a in allowed.split(",")}
                )
            )
    return table


def test_the_readme_says_what_each_package_may_import() -> None:
    graph, table = _imports(), _readme_table()
    packages = {
        _package(".".join(("seamline", *p.relative_to(ROOT).with_suffix("").parts)))
        for p in ROOT.rglob("*.py")
        if p.name != "__init__.py"
    }
    assert packages == set(table), (
        f"the README's table lacks {packages - set(table)}, has gone {set(table) - packages}"
    )
    for package, allowed in table.items():
        if allowed is not None:
            assert graph[package] <= allowed, (
                f"{package} imports {sorted(graph[package] - allowed)} beyond the README"
            )


TREE = ROOT.parent
SIZE_LIMITS = {"file_lines": 600, "function_lines": 80}  # the house rule's aim: about 500 and 60


def _sources() -> list[Path]:
    return [p for top in ("seamline", "bench", "tests") for p in (TREE / top).rglob("*.py")]


def test_one_meaning_per_name_no_module_file_or_class_twice_in_the_package() -> None:
    names = [p.name for p in ROOT.rglob("*.py") if p.name != "__init__.py"]
    assert not {n for n in names if names.count(n) > 1}
    classes = [
        node.name
        for path in ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    ]
    assert not {c for c in classes if classes.count(c) > 1}


def test_no_file_or_function_past_the_size_limits() -> None:
    long_files, long_functions = [], []
    for path in _sources():
        text = path.read_text()
        if text.count("\n") > SIZE_LIMITS["file_lines"]:
            long_files.append(str(path.relative_to(TREE)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > SIZE_LIMITS["function_lines"]:
                    long_functions.append(f"{path.relative_to(TREE)}:{node.lineno} {node.name}")
    assert not long_files and not long_functions


def test_the_formatter_decides_the_layout_with_few_exceptions() -> None:
    """``# fmt: skip`` only where an aligned table reads better: at most 20 in the package."""
    skips = sum(p.read_text().count("# fmt: skip") for p in ROOT.rglob("*.py"))
    assert skips <= 20
