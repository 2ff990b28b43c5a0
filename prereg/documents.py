"""Reading TOML documents (registrations, amendments, records) into validated models, with errors a person can
act on: the file, the line or the field path, what is wrong, and what to do."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from prereg.canonical import canonical_hash, file_hash
from prereg.errors import InvalidInput
from prereg.schema import CONFIG_DEFAULTS, Amendment, ExternalRecord, Registration

M = TypeVar("M", bound=BaseModel)

FIX = {
    Registration: "correct the registration; `prereg check FILE` validates without writing anything",
    Amendment: "correct the amendment file (reason, [add.…], [set.…]); nothing was written",
    ExternalRecord: "correct the record file (provenance, [oracles.ID], [rungs.ID]); nothing was written",
}


def read_toml(path: Path) -> tuple[dict[str, Any], bytes]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InvalidInput("no such file", where=str(path), fix="check the path") from None
    try:
        return tomllib.loads(raw.decode("utf-8")), raw
    except UnicodeDecodeError as error:
        raise InvalidInput(f"not UTF-8 text ({error.reason} at byte {error.start})", where=str(path)) from None
    except tomllib.TOMLDecodeError as error:
        # tomllib's message carries "(at line L, column C)".
        raise InvalidInput(
            f"malformed TOML: {error}", where=str(path), fix="fix the TOML syntax at that line"
        ) from None


def _path_with_ids(data: Any, loc: tuple[Any, ...]) -> str:
    """('items', 0, 'oracles', 1, 'bounds') -> 'items.P1.oracles.P1b.bounds' using the ids in the raw data."""
    parts: list[str] = []
    node = data
    for key in loc:
        if isinstance(key, int) and isinstance(node, list) and key < len(node):
            element = node[key]
            label = element.get("id", element.get("n")) if isinstance(element, dict) else None
            parts.append(str(label) if label is not None else f"[{key}]")
            node = element
        else:
            parts.append(str(key))
            node = node.get(key) if isinstance(node, dict) else None
    return ".".join(parts)


def _line_of(source: bytes, loc: tuple[Any, ...]) -> int | None:
    """The line that assigns the innermost named key of the path, when exactly one line does: a key assigned on
    several lines (`id`, `items`) cannot be placed by its name alone, and a wrong line would mislead."""
    names = [k for k in loc if isinstance(k, str)]
    if not names:
        return None
    needle = names[-1]
    found = []
    for number, line in enumerate(source.decode("utf-8", "replace").splitlines(), start=1):
        stripped = line.strip()
        if (
            stripped.startswith(f"{needle} ")
            or stripped.startswith(f"{needle}=")
            or f" {needle} =" in stripped
            or f"{{ {needle} =" in stripped
        ):
            found.append(number)
    return found[0] if len(found) == 1 else None


def validate(
    model: type[M],
    data: dict[str, Any],
    *,
    where: str,
    source: bytes | None = None,
    fix: str | None = None,
    context: dict[str, Any] | None = None,
) -> M:
    try:
        return model.model_validate(data, context=context)
    except ValidationError as error:
        first = error.errors()[0]
        loc = tuple(first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = f"unknown key {loc[-1]!r} (unknown keys are errors)"
        elif first["type"] == "missing":
            message = f"required key {loc[-1]!r} is missing"
        path = _path_with_ids(data, loc)
        line = _line_of(source, loc) if source is not None else None
        location = where + (f":{line}" if line else "") + (f": {path}" if path else "")
        more = len(error.errors()) - 1
        if more:
            message += f" (and {more} more problem{'s' if more > 1 else ''})"
        raise InvalidInput(message, where=location, fix=fix or FIX.get(model)) from None


def load_registration(path: Path, config_defaults: dict[str, Any] | None = None) -> tuple[Registration, bytes]:
    """The registration in `path`; its run configs resolve with `config_defaults` (a frozen document's table), else
    with its workload's current defaults."""
    data, raw = read_toml(path)
    context = None if config_defaults is None else {CONFIG_DEFAULTS: config_defaults}
    return validate(Registration, data, where=str(path), source=raw, context=context), raw


def registration_id(path: Path) -> str | None:
    """The id a registration file declares, read before it is validated (None when it declares none)."""
    reg_id = read_toml(path)[0].get("id")
    return reg_id if isinstance(reg_id, str) else None


def load_amendment(path: Path) -> tuple[Amendment, bytes]:
    data, raw = read_toml(path)
    return validate(Amendment, data, where=str(path), source=raw), raw


def load_record(path: Path) -> tuple[ExternalRecord, bytes]:
    data, raw = read_toml(path)
    return validate(ExternalRecord, data, where=str(path), source=raw), raw


def document_dict(reg: Registration) -> dict[str, Any]:
    """The canonical content of a registration: what its document hash is taken over."""
    return reg.model_dump(mode="json", by_alias=True)


def document_hash(reg: Registration) -> str:
    return canonical_hash(document_dict(reg))


__all__ = [
    "read_toml",
    "validate",
    "load_registration",
    "registration_id",
    "load_amendment",
    "load_record",
    "document_dict",
    "document_hash",
    "file_hash",
]
