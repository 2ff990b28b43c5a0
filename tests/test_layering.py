"""The layering, held by the imports: prereg/ and oracles/ import neither the engine nor torch; nothing in the
generic engine imports a workload (engine/molmo2/ is reached only through the workload contract, by the name its
entry point gives); cli.py never imports torch. Every import of every module counts, the lazy ones inside
functions included: they are read from the source (AST), not from what an import happens to load.
tests/test_no_torch.py checks the CLI's process as well."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("prereg", "oracles", "engine")


def sources() -> dict[str, str]:
    """Repository-relative path -> source, for cli.py and every module of the three packages."""
    paths = [ROOT / "cli.py"] + [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    return {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8") for path in paths}


def module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Cached on (path, source): a planted copy parses only the file it changed, not every module of the tree again.
@functools.cache
def imported(path: str, source: str) -> tuple[tuple[int, str], ...]:
    """(line, module) for every import statement anywhere in the module; relative imports resolved."""
    package = module_name(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join([*base, node.module] if node.module else base)
            # `from engine import molmo2` imports engine.molmo2: name each imported name under its module too.
            found += [(node.lineno, stem)] + [(node.lineno, f"{stem}.{alias.name}") for alias in node.names]
    return tuple(found)


def within(module: str, root: str) -> bool:
    return module == root or module.startswith(root + ".")


def forbidden(path: str) -> list[str]:
    """The module roots this file may not import."""
    if path == "cli.py":
        return ["torch"]
    if path.startswith(("prereg/", "oracles/")):
        return ["engine", "torch"]
    if path.startswith("engine/") and not path.startswith("engine/molmo2/"):
        return ["engine.molmo2"]
    return []


def violations(modules: dict[str, str]) -> list[str]:
    found = []
    for path, source in modules.items():
        for line, module in imported(path, source):
            for root in forbidden(path):
                if within(module, root):
                    found.append(f"{path}:{line} imports {module}")
    return sorted(set(found))


def test_no_import_runs_up_a_floor() -> None:
    modules = sources()
    assert "prereg/verdict.py" in modules and "engine/report/report.py" in modules and "cli.py" in modules
    assert violations(modules) == []


# Planted in a copy of the sources: each must be caught, so the checker cannot pass by reading nothing.
PLANTED = [
    ("prereg/verdict.py", "def later():\n    import torch\n", "prereg/verdict.py:2 imports torch"),
    ("oracles/judge.py", "from engine.ladder import Ladder\n", "oracles/judge.py:1 imports engine.ladder"),
    ("prereg/state.py", "def later():\n    from engine import gate\n", "prereg/state.py:2 imports engine"),
    ("engine/report/report.py", "from .. import molmo2\n", "engine/report/report.py:1 imports engine.molmo2"),
    (
        "engine/memory/forensics.py",
        "def later():\n    from engine.molmo2.model.ar import ar_forward\n",
        "engine/memory/forensics.py:2 imports engine.molmo2.model.ar",
    ),
    ("cli.py", "def later():\n    import torch.distributed\n", "cli.py:2 imports torch.distributed"),
]


def test_a_planted_import_is_caught() -> None:
    modules = sources()
    for path, planted, expected in PLANTED:
        assert expected in violations({**modules, path: planted + modules[path]}), planted


def test_the_workload_itself_may_import_the_engine_and_torch() -> None:
    source = "import torch\nfrom engine.molmo2.model.ar import ar_forward\nfrom engine.memory.meter import GIB\n"
    assert violations({"engine/molmo2/planted_here.py": source}) == []


# The memory meter measures the memory fields a workload reports (and declares); every other generic module shows
# and judges a workload's metrics only through its declaration.
MEASURES_WORKLOAD_FIELDS = {"engine/memory/meter.py"}


def workload_metric_names() -> set[str]:
    from conftest import every_workload_declaration

    from prereg.workload import ENGINE_METRICS, WINDOW_FIELDS

    names = {name for workload in every_workload_declaration().values() for name in workload.metrics}
    return names - set(ENGINE_METRICS) - set(WINDOW_FIELDS)


def naming_a_workload_metric(modules: dict[str, str], names: set[str]) -> list[str]:
    pattern = re.compile(r"\b(" + "|".join(sorted(names)) + r")\b")
    return sorted(
        f"{path}: {match}"
        for path, source in modules.items()
        if not path.startswith("engine/molmo2/") and path not in MEASURES_WORKLOAD_FIELDS
        for match in set(pattern.findall(source))
    )


def test_the_generic_code_names_no_workloads_metric() -> None:
    names = workload_metric_names()
    assert {"vram_peak_gib", "probe_chunk_mae"} <= names
    modules = sources()
    assert naming_a_workload_metric(modules, names) == []
    planted = {**modules, "cli.py": modules["cli.py"] + '\nPEAK = "vram_peak_gib"\n'}
    assert naming_a_workload_metric(planted, names) == ["cli.py: vram_peak_gib"]
