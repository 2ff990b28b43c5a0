"""The values an expression produces, and Undefined: the third truth value.

A value is a number (int or float, never a bool), a boolean, a string, a list of values (only history
functions make lists), or Undefined. Bool is kept apart from int on purpose: `True + 1` is a type error
here, not 2.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Undefined:
    """A value that cannot be known: a rung that did not run, a division by zero, a type error.

    `reason` names the first cause ("C.s_per_step: rung C did not run"), so a verdict can say why.
    """

    reason: str

    def __bool__(self) -> bool:
        # Never silently truthy or falsy: a caller branching on an unknown must decide what unknown means.
        raise TypeError(f"an undefined value has no truth value ({self.reason}); test it with isinstance(v, Undefined)")


Value = float | int | bool | str | list | Undefined

# What the compiler knows about a sub-expression's value before any data exists; "any" for names whose
# values only the environment knows (reads, metrics).
StaticType = Literal["number", "boolean", "string", "list", "any"]


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def type_name(value: Value) -> StaticType | Literal["undefined"]:
    if isinstance(value, Undefined):
        return "undefined"
    if isinstance(value, bool):
        return "boolean"
    if is_number(value):
        return "number"
    if isinstance(value, str):
        return "string"
    assert isinstance(value, list), f"not a rule-language value: {value!r}"
    return "list"


def describe(value: Value) -> str:
    shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"the {type_name(value)} {shown}"


def matches(value: Value, wanted: StaticType) -> bool:
    return wanted == "any" or type_name(value) == wanted


def admit(value: object, source: str) -> Value:
    """Normalise a value an Env handed over (numpy numbers become int/float).

    Anything that is not a rule-language value is the caller's bug, not the expression's: TypeError.
    """
    if isinstance(value, (Undefined, bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [admit(item, source) for item in value]
    raise TypeError(
        f"{source} returned {value!r} ({type(value).__name__}); an Env returns bool, int, float, str, list or Undefined"
    )
