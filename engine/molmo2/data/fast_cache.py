"""A directory of fitted FAST tokenizers, shared by the processes that fit the same one (opt-in).

A Molmo2 runner fits FAST on rig chunks at every load, about half a second of each process's start; the test suite
starts a hundred such processes, almost all of them fitting the same few tokenizers. With PREREG_FAST_CACHE naming
a directory, `make_fast_tokenizer` keeps each fit there under a key and loads it instead of fitting again. Unset
(the default), every call fits.

A key can never name a stale fit: it is the sha256 of everything the fit depends on — its arguments, the source of
every project module the fitting code imports (found by following the imports from collate.py, so a module the fit
comes to depend on joins the key without anyone listing it), the versions of the third-party packages among those
imports, and Python's version. Change any of them and the key changes; nothing is ever invalidated by hand.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

CACHE_VARIABLE = "PREREG_FAST_CACHE"
FITTING_MODULE = "engine.molmo2.data.collate"  # make_fast_tokenizer: the rig chunks, the bounds, FastTokenizer.fit
PROJECT_ROOT = Path(__file__).resolve().parents[3]


# An import statement: ruff (E401, E701, E702) keeps each one at the start of its own line. Groups: a from-import's
# module and its names (parenthesised over several lines, or the rest of its line), a plain import's modules.
IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+([.\w]+)[ \t]+import[ \t]+(\([^)]*\)|.*)|import[ \t]+(.*))", re.M)


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every module an import statement of `source` names (anywhere in it: lazy imports too), as absolute names;
    `from a import b` names `a` and `a.b` (b may be a submodule). Read as text, not parsed (parsing costs a
    process a fifth of a second): a docstring line that reads like an import adds a name, never misses one."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for base, imported, plain in IMPORT.findall(re.sub(r"#.*", "", source).replace("\\\n", " ")):
        listed = [words.split()[0] for words in (imported or plain).strip("() \t").split(",") if words.split()]
        if plain:
            names.update(listed)
            continue
        base = importlib.util.resolve_name(base, package) if base.startswith(".") else base
        names.add(base)
        names.update(f"{base}.{name}" for name in listed if name != "*")
    return names


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def project_file(name: str) -> Path | None:
    """The file of a module of this checkout (a package's __init__.py), or None for any other module. Found by
    path, never by importing: following the imports must not run them."""
    base = PROJECT_ROOT.joinpath(*name.split("."))
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def distribution_version(package: str) -> str:
    """The installed version of a third-party package ("absent" when it is not installed: an optional import)."""
    if importlib.util.find_spec(package) is None:
        return "absent"
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # a distribution named otherwise than its module
        distributions = importlib.metadata.packages_distributions().get(package)
        if not distributions:
            raise LookupError(f"no installed distribution provides {package!r}, which the FAST fit imports") from None
        return ", ".join(f"{d} {importlib.metadata.version(d)}" for d in sorted(distributions))


def fit_dependencies(start: str = FITTING_MODULE) -> tuple[dict[str, bytes], dict[str, str]]:
    """(project module -> its source, third-party package -> its version) for `start` and everything it imports,
    transitively. Packages' __init__ modules count: importing a submodule runs them."""
    sources: dict[str, bytes] = {}
    versions: dict[str, str] = {"python": sys.version}
    pending = _with_parents(start)
    while pending:
        name = pending.pop()
        top = name.partition(".")[0]
        if name in sources or top in versions or top in sys.stdlib_module_names:
            continue
        path = project_file(name)
        if path is None:
            if project_file(top) is None:
                versions[top] = distribution_version(top)
            continue  # else `from package import name` named an attribute, not a module
        sources[name] = path.read_bytes()
        for imported in imported_modules(sources[name].decode(), name, path.name == "__init__.py"):
            pending += _with_parents(imported)
    return sources, versions


def fit_key(arguments: dict[str, Any], sources: dict[str, bytes], versions: dict[str, str]) -> str:
    """The sha256 naming one fit: its arguments, the code that computes it, and the libraries that code calls."""
    digest = hashlib.sha256(json.dumps({"arguments": arguments, "versions": versions}, sort_keys=True).encode())
    for name in sorted(sources):
        digest.update(f"\0{name}\0".encode() + hashlib.sha256(sources[name]).digest())
    return digest.hexdigest()


@functools.cache
def _dependencies() -> tuple[dict[str, bytes], dict[str, str]]:
    # Once per process, at its first fit: the files its modules were imported from moments before.
    return fit_dependencies()


def cached_fit(arguments: dict[str, Any], fit: Callable[[], Any], load: Callable[[Path], Any]) -> Any:
    """`fit()`, or the fit kept under its key in the PREREG_FAST_CACHE directory (saved there when missing)."""
    directory = os.environ.get(CACHE_VARIABLE)
    if not directory:
        return fit()
    path = Path(directory) / f"{fit_key(arguments, *_dependencies())}.json"
    if path.is_file():
        return load(path)
    tokenizer = fit()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # another process may be writing the same key
    tokenizer.save(partial)
    os.replace(partial, path)
    return tokenizer
