"""The package rules of docs/ARCHITECTURE.md, checked on the source tree with `ast` (nothing is imported).

- "Import rules": which top-level gpuagent package may import which, and no import cycle between them.
- "Packages": the table names exactly the packages in the tree, each with its folder.
- The agent's stages ("Import rules", the agent floor table): inside gpuagent.agent, imports run downward only.
- The collector's modules: no import cycle between any two modules of gpuagent.collector.
- Module size: no module over 600 lines in agent/, collector/, probes/ and common/ (generated protobuf exempt).

The checker reads every import statement, including those inside functions, relative imports and
``importlib.import_module("gpuagent...")`` with a literal name, so a lazy import cannot hide an edge.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"

ROOT_PKG = "gpuagent"
COMMON, AGENT, PROBES, JOBS, PROTO, COLLECTOR, SIM = (
    f"gpuagent.{n}" for n in ("common", "agent", "probes", "jobs", "proto", "collector", "sim"))
TOP_PACKAGES = (ROOT_PKG, COMMON, AGENT, PROBES, JOBS, PROTO, COLLECTOR, SIM)

# importer -> top-level packages it must never import (docs/ARCHITECTURE.md, "Import rules").
FORBIDDEN: dict[str, frozenset[str]] = {
    COMMON: frozenset(TOP_PACKAGES) - {COMMON},
    AGENT: frozenset({COLLECTOR, SIM}),
    PROBES: frozenset({AGENT, COLLECTOR, SIM}),
    JOBS: frozenset({AGENT, COLLECTOR, SIM}),
    COLLECTOR: frozenset({AGENT, SIM}),
    SIM: frozenset(TOP_PACKAGES) - {SIM, COMMON, PROTO},    # it drives a collector over gRPC, not through imports
}


def package_dirs() -> dict[str, str]:
    """Folder -> import package, from pyproject's package-dir (the one place that maps them)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = cfg["tool"]["setuptools"]["package-dir"]
    return {folder: pkg for pkg, folder in mapping.items()}


def top_package(dotted: str) -> str | None:
    """The top-level gpuagent package a dotted name belongs to; None outside gpuagent."""
    parts = dotted.split(".")
    if parts[0] != ROOT_PKG:
        return None
    if len(parts) > 1 and f"{ROOT_PKG}.{parts[1]}" in TOP_PACKAGES:
        return f"{ROOT_PKG}.{parts[1]}"
    return ROOT_PKG  # the namespace root itself or a module in gpuagent/ (local_run, __version__)


@dataclass(frozen=True)
class Edge:
    where: str          # path:line of the import
    module: str         # the importing module
    imported: str       # the dotted name it imports
    src: str            # top-level package of the importer
    dst: str            # top-level package of the imported name

    def __str__(self) -> str:
        return f"{self.where}: {self.module} -> {self.dst} (imports {self.imported})"


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(base) - 1:
        raise ValueError(f"relative import beyond the top of {module}")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _literal_import_module(node: ast.Call) -> str | None:
    """The module name of importlib.import_module("...") / f"gpuagent.x.{...}" when it starts literally."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = str(arg.values[0].value).rstrip(".")
        return prefix or None
    return None


def imported_names(source: str, module: str, is_package: bool, filename: str = "<string>") -> list[tuple[int, str]]:
    """(line, dotted name) for every import in ``source``, relative ones resolved against ``module``."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(module, is_package, node.level, node.module) if node.level
                    else node.module or "")
            for alias in node.names:
                # "from gpuagent import agent" imports a package; "from x import name" at least imports x.
                out.append((node.lineno, base if alias.name == "*" else f"{base}.{alias.name}"))
        elif isinstance(node, ast.Call):
            name = _literal_import_module(node)
            if name:
                out.append((node.lineno, name))
    return out


def module_edges(source: str, relpath: str, dirs: dict[str, str]) -> list[Edge]:
    """Edges between top-level packages made by the module at ``relpath`` (e.g. "agent/x.py")."""
    parts = Path(relpath).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    module = ".".join([dirs[parts[0]], *parts[1:-1], *([] if is_package else [parts[-1]])])
    src = top_package(module)
    edges = []
    for line, name in imported_names(source, module, is_package, relpath):
        dst = top_package(name)
        if dst is not None and dst != src:
            edges.append(Edge(f"{relpath}:{line}", module, name, src, dst))
    return edges


def violations(edges: list[Edge]) -> list[str]:
    return [str(e) for e in edges if e.dst in FORBIDDEN.get(e.src, ())]


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected groups of more than one top-level package (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def tree_sources() -> list[tuple[str, str]]:
    """(relative path, source) of every .py module in the package folders."""
    out = []
    for folder in sorted(package_dirs()):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                out.append((path.relative_to(ROOT).as_posix(), path.read_text()))
    return out


def tree_edges() -> list[Edge]:
    dirs = package_dirs()
    return [e for rel, src in tree_sources() for e in module_edges(src, rel, dirs)]


# ------------------------------------------------------------------------------------------------ the tree

def test_package_dirs_cover_every_top_level_package():
    assert sorted(package_dirs().values()) == sorted(TOP_PACKAGES)
    for folder in package_dirs():
        assert (ROOT / folder / "__init__.py").is_file(), f"{folder}/ has no __init__.py"


def test_import_rules_hold():
    bad = violations(tree_edges())
    assert not bad, "imports that break docs/ARCHITECTURE.md's import rules:\n" + "\n".join(bad)


def test_no_import_cycle_between_top_level_packages():
    edges = tree_edges()
    found = cycles(edges)
    detail = []
    for group in found:
        detail.append(" <-> ".join(group))
        detail.extend(f"    {e}" for e in edges if e.src in group and e.dst in group)
    assert not found, "import cycles between top-level packages:\n" + "\n".join(detail)


# ------------------------------------------------------------------------------------------ the agent's stages

# The agent's floors (docs/ARCHITECTURE.md, "Import rules"): every module of gpuagent.agent is on one, and
# imports only from its own floor and those listed for it.
AGENT_FLOOR, AGENT_TOP = "floor", "top"
AGENT_ROOT_MODULES = {"config": AGENT_FLOOR, "config_values": AGENT_FLOOR, "config_sections": AGENT_FLOOR,
                      "config_tables": AGENT_FLOOR, "snapshot": AGENT_FLOOR,
                      "daemon": AGENT_TOP, "daemon_components": AGENT_TOP, "daemon_state_dir": AGENT_TOP,
                      "daemon_status": AGENT_TOP, "cli": AGENT_TOP}
AGENT_STAGE_PACKAGES = ("schedulers", "samplers", "pipeline", "probing", "surface")
AGENT_MAY_IMPORT: dict[str, frozenset[str]] = {
    AGENT_FLOOR: frozenset({AGENT_FLOOR}),
    "schedulers": frozenset({AGENT_FLOOR, "schedulers"}),
    "samplers": frozenset({AGENT_FLOOR, "schedulers", "samplers"}),
    "pipeline": frozenset({AGENT_FLOOR, "samplers", "pipeline"}),
    "probing": frozenset({AGENT_FLOOR, "samplers", "probing"}),
    "surface": frozenset({AGENT_FLOOR, "schedulers", "samplers", "probing", "surface"}),
    AGENT_TOP: frozenset({AGENT_FLOOR, *AGENT_STAGE_PACKAGES, AGENT_TOP}),
}


def agent_stage(dotted: str) -> str | None:
    """The agent floor a dotted name is on; None outside gpuagent.agent, "?" for a module on no floor."""
    parts = dotted.split(".")
    if parts[:2] != [ROOT_PKG, "agent"]:
        return None
    if len(parts) == 2:
        return AGENT_FLOOR          # the package itself (its __init__ imports nothing)
    if parts[2] in AGENT_STAGE_PACKAGES:
        return parts[2]
    return AGENT_ROOT_MODULES.get(parts[2], "?")


def agent_stage_violations(source: str, relpath: str, dirs: dict[str, str]) -> list[str]:
    """Imports inside gpuagent.agent that run up a floor, or modules that are on no floor."""
    parts = Path(relpath).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    module = ".".join([dirs[parts[0]], *parts[1:-1], *([] if is_package else [parts[-1]])])
    src = agent_stage(module)
    if src is None:
        return []
    if src == "?":
        return [f"{relpath}: {module} is on no agent floor (add it to a stage folder or AGENT_ROOT_MODULES)"]
    out = []
    for line, name in imported_names(source, module, is_package, relpath):
        dst = agent_stage(name)
        if dst is not None and dst not in AGENT_MAY_IMPORT[src]:
            out.append(f"{relpath}:{line}: agent.{src} -> agent.{dst} (imports {name})")
    return out


def test_agent_stages_import_downward_only():
    dirs = package_dirs()
    bad = [v for rel, src in tree_sources() for v in agent_stage_violations(src, rel, dirs)]
    assert not bad, "agent imports that break docs/ARCHITECTURE.md's agent floors:\n" + "\n".join(bad)


def test_agent_floor_table_matches_the_rules():
    """The floor table in docs/ARCHITECTURE.md lists the same "may import" sets this file enforces."""
    text = ARCHITECTURE.read_text()
    m = re.search(r"^\s*\| agent floor \|.*?\n((?:\s*\|.*\n)+)", text, re.M)
    assert m, "docs/ARCHITECTURE.md has no agent floor table"
    names = {"the floor": AGENT_FLOOR, "everything in the agent": "*"}
    documented: dict[str, frozenset[str]] = {}
    for line in m.group(1).splitlines()[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        floors = re.findall(r"`agent\.(\w+)`", cells[0])
        allowed = {names.get(a, a) for a in (re.sub(r"\(.*?\)", "", a).strip() for a in cells[1].split(","))} - {"common", "proto", "probes"}
        allowed = (set(AGENT_MAY_IMPORT[AGENT_TOP]) if "*" in allowed else allowed) | {
            AGENT_FLOOR if floors[0] in ("config", "snapshot") else AGENT_TOP if floors[0] in ("daemon", "cli")
            else floors[0]}
        for f in floors:
            key = AGENT_ROOT_MODULES.get(f, f)
            documented[key] = frozenset(allowed)
    assert documented == AGENT_MAY_IMPORT


@pytest.mark.parametrize("relpath, source", [
    ("agent/samplers/x.py", "from gpuagent.agent.pipeline.spool import Spool\n"),
    ("agent/samplers/x.py", "def f():\n    from gpuagent.agent.surface import status\n"),
    ("agent/pipeline/x.py", "from gpuagent.agent.surface.exporter import Exporter\n"),
    ("agent/surface/x.py", "from gpuagent.agent import daemon\n"),
    ("agent/surface/x.py", "from ..pipeline import sender\n"),
    ("agent/snapshot.py", "from gpuagent.agent.samplers.gpu import GpuSampler\n"),
    ("agent/schedulers/x.py", "import gpuagent.agent.samplers.host\n"),
    ("agent/stray.py", "import os\n"),
])
def test_agent_stage_checker_catches_an_upward_import(relpath, source):
    bad = agent_stage_violations(source, relpath, DIRS)
    assert len(bad) == 1, bad
    assert bad[0].startswith(f"{relpath}:")


@pytest.mark.parametrize("relpath, source", [
    ("agent/samplers/x.py", "from gpuagent.agent.config import JobRules\nfrom gpuagent.agent.schedulers import slurm\n"),
    ("agent/pipeline/x.py", "from gpuagent.agent.samplers.sampling import now_ns\nfrom . import spool\n"),
    ("agent/surface/x.py", "from gpuagent.agent.snapshot import StatusSnapshot\nfrom gpuagent.agent.samplers import gpu\n"),
    ("agent/daemon.py", "from gpuagent.agent.surface import exporter\nfrom gpuagent.agent.pipeline import sender\n"),
])
def test_agent_stage_checker_lets_downward_imports_pass(relpath, source):
    assert agent_stage_violations(source, relpath, DIRS) == []


# ------------------------------------------------------------------------------------- the collector's modules

def module_name(relpath: str, dirs: dict[str, str]) -> tuple[str, bool]:
    """(dotted module name, is it a package's __init__) of the module at ``relpath``."""
    parts = Path(relpath).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join([dirs[parts[0]], *parts[1:-1], *([] if is_package else [parts[-1]])]), is_package


def collector_module_edges(sources: list[tuple[str, str]], dirs: dict[str, str]) -> list[Edge]:
    """Edges between modules of gpuagent.collector among ``sources`` ((relative path, source) pairs).

    An imported name is charged to the longest known module it starts with, so ``from ..store.db import
    open_database`` is an edge to gpuagent.collector.store.db. Every import counts, lazy or TYPE_CHECKING."""
    named = [(rel, src, *module_name(rel, dirs)) for rel, src in sources]
    modules = {m for _, _, m, _ in named if m == COLLECTOR or m.startswith(COLLECTOR + ".")}
    edges = []
    for rel, src, module, is_package in named:
        if module not in modules:
            continue
        for line, name in imported_names(src, module, is_package, rel):
            parts = name.split(".")
            target = next((".".join(parts[:n]) for n in range(len(parts), 0, -1)
                           if ".".join(parts[:n]) in modules), None)
            if target is not None and target != module:
                edges.append(Edge(f"{rel}:{line}", module, name, module, target))
    return edges


def test_no_import_cycle_between_modules_of_the_collector():
    edges = collector_module_edges(tree_sources(), package_dirs())
    found = cycles(edges)
    detail = []
    for group in found:
        detail.append(" <-> ".join(group))
        detail.extend(f"    {e.where}: {e.module} -> {e.dst} (imports {e.imported})"
                      for e in edges if e.src in group and e.dst in group)
    assert not found, "import cycles between modules of the collector:\n" + "\n".join(detail)


def test_collector_cycle_finder_catches_a_looped_pair():
    """Two modules that import each other, one of them lazily inside a function, are one cycle; a third
    module that only imports one of them is not in it."""
    sources = [
        ("collector/ingest/x.py", "from gpuagent.collector.views.y import render\n"),
        ("collector/views/y.py", "def render():\n    from ..ingest.x import Thing\n"),
        ("collector/service.py", "from gpuagent.collector.ingest import x\nfrom gpuagent.collector.views import y\n"),
    ]
    found = cycles(collector_module_edges(sources, DIRS))
    assert found == [[f"{COLLECTOR}.ingest.x", f"{COLLECTOR}.views.y"]]
    assert cycles(collector_module_edges(sources[1:], DIRS)) == []


# ------------------------------------------------------------------------------------------ the checker

DIRS = {"agent": AGENT, "probes": PROBES, "collector": COLLECTOR, "common": COMMON, "gpuagent": ROOT_PKG,
        "sim": SIM}


@pytest.mark.parametrize("relpath, source, dst", [
    ("agent/x.py", "from gpuagent.collector.store import writer\n", COLLECTOR),
    ("agent/x.py", "def f():\n    import gpuagent.sim.run\n", SIM),
    ("agent/x.py", "from .. import collector\n", COLLECTOR),
    ("probes/sub/__init__.py", "from ...agent import config\n", AGENT),
    ("probes/x.py", "import importlib\nimportlib.import_module('gpuagent.agent.daemon')\n", AGENT),
    ("collector/views/x.py", "from gpuagent import agent\n", AGENT),
    ("common/x.py", "from gpuagent import __version__\n", ROOT_PKG),
    ("common/x.py", "from gpuagent.proto import pb\n", PROTO),
    ("sim/x.py", "from gpuagent.collector.fabric import planner\n", COLLECTOR),
    ("sim/x.py", "def f():\n    from gpuagent.agent.pipeline import sender\n", AGENT),
    ("sim/x.py", "from gpuagent import __version__\n", ROOT_PKG),
])
def test_checker_catches_a_forbidden_edge(relpath, source, dst):
    bad = violations(module_edges(source, relpath, DIRS))
    assert len(bad) == 1, bad
    assert bad[0].startswith(f"{relpath}:") and f"-> {dst} (imports" in bad[0]


@pytest.mark.parametrize("relpath, source", [
    ("agent/x.py", "from gpuagent.common import nvml\nfrom gpuagent.probes import registry\n"),
    ("collector/ingest/x.py", "from gpuagent.proto import pb\nfrom ..store import writer\nfrom . import auth\n"),
    ("gpuagent/x.py", "import gpuagent.agent.cli\nimport gpuagent.collector.cli\n"),
    ("agent/x.py", "import os\nfrom gpuagent import __version__\n"),
    ("sim/x.py", "from gpuagent.common import pair_planner\nfrom gpuagent.proto.wire import bearer_metadata\n"),
])
def test_checker_lets_allowed_edges_pass(relpath, source):
    assert violations(module_edges(source, relpath, DIRS)) == []


def test_checker_resolves_relative_imports_inside_a_package():
    edges = module_edges("from ..store import writer\nfrom ...agent import config\n", "collector/ingest/x.py", DIRS)
    assert [(e.imported, e.dst) for e in edges] == [("gpuagent.agent.config", AGENT)]


def test_cycle_finder_reports_a_cycle_and_only_that():
    def e(a: str, b: str) -> Edge:
        return Edge("x.py:1", a, b, a, b)

    assert cycles([e(AGENT, COMMON), e(COLLECTOR, PROTO), e(AGENT, PROTO)]) == []
    assert cycles([e(AGENT, PROBES), e(PROBES, COMMON), e(COMMON, AGENT), e(COLLECTOR, PROTO)]) == [
        sorted([AGENT, PROBES, COMMON])]


# --------------------------------------------------------------------------------- docs "Packages" table

def documented_packages() -> dict[str, str]:
    """Package -> folder from the table in docs/ARCHITECTURE.md's "## Packages" section."""
    text = ARCHITECTURE.read_text()
    m = re.search(r"^## Packages\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, "docs/ARCHITECTURE.md has no '## Packages' section"
    rows: dict[str, str] = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if len(cells) < 2:
            continue
        pkg = re.fullmatch(r"`(gpuagent(?:\.\w+)*)`", cells[0])
        folder = re.fullmatch(r"`([\w./]+?)/?`", cells[1])
        if pkg and folder:
            assert pkg.group(1) not in rows, f"{pkg.group(1)} is listed twice"
            rows[pkg.group(1)] = folder.group(1)
    return rows


def tree_packages() -> dict[str, str]:
    """Every gpuagent package in the tree: package-dir entries and their subfolders with an __init__.py."""
    out: dict[str, str] = {}

    def walk(folder: Path, pkg: str) -> None:
        out[pkg] = folder.relative_to(ROOT).as_posix()
        for sub in sorted(p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file()):
            walk(sub, f"{pkg}.{sub.name}")

    for folder, pkg in package_dirs().items():
        walk(ROOT / folder, pkg)
    return out


def test_packages_table_names_exactly_the_packages_in_the_tree():
    documented, tree = documented_packages(), tree_packages()
    assert {f"{COLLECTOR}.{s}" for s in ("ingest", "store", "analysis", "views")} <= set(tree)
    missing = sorted(set(tree) - set(documented))
    stale = sorted(set(documented) - set(tree))
    assert not missing and not stale, (
        f"docs/ARCHITECTURE.md 'Packages' table: not listed {missing}; listed but not in the tree {stale}")
    wrong = {p: (documented[p], tree[p]) for p in tree if documented[p] != tree[p]}
    assert not wrong, f"documented folder differs from the tree (documented, actual): {wrong}"


# --------------------------------------------------------------------------------- module size

MAX_MODULE_LINES = 600
SIZE_RULED_FOLDERS = ("agent", "collector", "probes", "common")


def long_modules(root: Path, limit: int = MAX_MODULE_LINES) -> dict[str, int]:
    """Python modules under the ruled folders with more than ``limit`` lines; generated protobuf modules
    (``*_pb2*.py``) are exempt, and SQL lives in .sql files, which this does not count."""
    out: dict[str, int] = {}
    for folder in SIZE_RULED_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            n = len(path.read_text().splitlines())
            if n > limit:
                out[path.relative_to(root).as_posix()] = n
    return out


def test_no_module_over_600_lines():
    too_long = long_modules(ROOT)
    assert not too_long, (f"split these by job (docs/ARCHITECTURE.md, one job per module): {too_long}")


def test_module_size_check_catches_a_long_module(tmp_path):
    (tmp_path / "collector" / "views").mkdir(parents=True)
    (tmp_path / "collector" / "views" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "collector" / "views" / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "big_pb2.py").write_text("x = 1\n" * 2000)
    assert long_modules(tmp_path) == {"collector/views/long.py": MAX_MODULE_LINES + 1}
