"""The workloads this installation knows: found through the entry-point group `prereg.workloads`.

A package declares a workload in its own metadata, for example in its pyproject.toml:

    [project.entry-points."prereg.workloads"]
    molmo2 = "engine.molmo2.declaration:DECLARATION"

The entry point names a `WorkloadDeclaration` (prereg.workload); loading it never imports torch. prereg itself
names no workload: what is installed is what validates.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import entry_points

from prereg.workload import WorkloadDeclaration

GROUP = "prereg.workloads"


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
def get_workload(name: str) -> WorkloadDeclaration:
    workloads = installed_workloads()
    if name not in workloads:
        raise ValueError(
            f"unknown workload {name!r}; installed workloads are {sorted(workloads)} "
            f"(a package declares one under the entry-point group {GROUP!r})"
        )
    declaration = next(p for p in entry_points(group=GROUP) if p.name == name).load()
    if not isinstance(declaration, WorkloadDeclaration):
        raise ValueError(
            f"workload {name!r}: its entry point {workloads[name]} is a {type(declaration).__name__}, "
            f"not a prereg.workload.WorkloadDeclaration"
        )
    return declaration
