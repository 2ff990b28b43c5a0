"""The workloads this installation knows: found through the entry-point group `prereg.workloads`.

A package declares a workload in its own metadata, for example in its pyproject.toml:

    [project.entry-points."prereg.workloads"]
    molmo2 = "engine.molmo2.declaration:DECLARATION"
    command = "engine.command.declaration:declare"

The entry point names either a `WorkloadDeclaration` (prereg.workload): a workload whose names are fixed by its
code; or a factory, `declare(table) -> WorkloadDeclaration`: a workload the document itself declares, in the
table named after it (`[command]` for workload = "command"), so the declaration is frozen with the document.
Loading either never imports torch. prereg itself names no workload: what is installed is what validates.
"""

from __future__ import annotations

import json
from functools import cache
from importlib.metadata import entry_points
from typing import Any, Mapping

from prereg.workload import WorkloadDeclaration

GROUP = "prereg.workloads"


class UnknownWorkload(ValueError):
    """No installed package declares a workload of this name."""


class TableError(ValueError):
    """A document's workload table is missing, misplaced or invalid; `path` is the field within the table ("" for
    the table itself), so validation can name `command.metrics` and not only the table."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


@cache
def installed_workloads() -> dict[str, str]:
    """name -> "module:attribute" of every workload an installed package declares."""
    found: dict[str, str] = {}
    for point in entry_points(group=GROUP):
        if point.name in found and found[point.name] != point.value:
            raise ValueError(
                f"workload {point.name!r} is declared twice ({found[point.name]} and {point.value}); "
                f"uninstall one of the packages that declare it"
            )
        found[point.name] = point.value
    return found


@cache
def _entry(name: str) -> Any:
    """What the workload's entry point names: a declaration or a factory of one."""
    workloads = installed_workloads()
    if name not in workloads:
        raise UnknownWorkload(
            f"unknown workload {name!r}; installed workloads are {sorted(workloads)} "
            f"(a package declares one under the entry-point group {GROUP!r})"
        )
    return next(p for p in entry_points(group=GROUP) if p.name == name).load()


def get_workload(name: str, table: Mapping[str, Any] | None = None) -> WorkloadDeclaration:
    """The declaration of workload `name`; for a workload the document declares, built from its `table` (the
    factory raises TableError naming the field)."""
    entry = _entry(name)
    if isinstance(entry, WorkloadDeclaration):
        if table is not None:
            raise TableError("", f"workload {name!r} is declared by its code, not by the document: remove the table")
        return entry
    if not callable(entry):
        raise ValueError(
            f"workload {name!r}: its entry point {installed_workloads()[name]} is a {type(entry).__name__}, "
            f"neither a prereg.workload.WorkloadDeclaration nor a factory of one"
        )
    if table is None:
        raise TableError("", f"workload {name!r} is declared by the document: it needs its table (see `prereg new`)")
    # The table is plain TOML data; its canonical JSON is the cache key (a dict is not hashable).
    return _declare(name, json.dumps(table, sort_keys=True))


@cache
def _declare(name: str, table_json: str) -> WorkloadDeclaration:
    declaration = _entry(name)(json.loads(table_json))
    if not isinstance(declaration, WorkloadDeclaration):
        raise ValueError(
            f"workload {name!r}: its factory {installed_workloads()[name]} returned a "
            f"{type(declaration).__name__}, not a prereg.workload.WorkloadDeclaration"
        )
    return declaration
