"""The compiled form of an expression and its three-valued evaluation.

The compiler (parse.py) turns Python's AST into these nodes after the allow-list and name checks; no
Python AST object survives compilation, and nothing here executes Python code: each node computes its
value from its children's.

Three-valued (Kleene) logic: anything touching an Undefined is Undefined, keeping the first cause as its
reason, except that a defined deciding operand settles `and`/`or` whatever its position (`U and False` is
False, `U or True` is True) and `defined(U)` is False. A type error at evaluation (a read that turned out
to be a string, say) is Undefined too, never a crash.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prereg.rules.functions import HistoryFunction, PureFunction, RowFunction
from prereg.rules.rows import differences
from prereg.rules.values import Undefined, Value, admit, describe, is_number, matches

if TYPE_CHECKING:
    from prereg.rules.env import Env


class Node:
    """A compiled sub-expression. `source` is its text, quoted in the reasons of Undefined values."""

    source: str

    def evaluate(self, env: Env) -> Value:
        raise NotImplementedError

    def children(self) -> tuple[Node, ...]:
        return ()

    def walk(self):
        yield self
        for child in self.children():
            yield from child.walk()


def _located(prefix: str, value: Value) -> Value:
    return Undefined(f"{prefix}: {value.reason}") if isinstance(value, Undefined) else value


@dataclass(frozen=True)
class Constant(Node):
    value: bool | int | float | str
    source: str

    def evaluate(self, env: Env) -> Value:
        return self.value


@dataclass(frozen=True)
class ReadRef(Node):
    name: str
    source: str

    def evaluate(self, env: Env) -> Value:
        value = admit(env.read(self.name), f"Env.read({self.name!r})")
        return Undefined(f"read {self.name} is undefined: {value.reason}") if isinstance(value, Undefined) else value


@dataclass(frozen=True)
class RungMetricRef(Node):
    rung: str
    metric: str
    source: str

    def evaluate(self, env: Env) -> Value:
        value = admit(env.rung_metric(self.rung, self.metric), f"Env.rung_metric({self.rung!r}, {self.metric!r})")
        return _located(f"{self.rung}.{self.metric}", value)


@dataclass(frozen=True)
class MetricRef(Node):
    name: str
    source: str

    def evaluate(self, env: Env) -> Value:
        return _located(self.name, admit(env.metric(self.name), f"Env.metric({self.name!r})"))


@dataclass(frozen=True)
class StepRef(Node):
    source: str

    def evaluate(self, env: Env) -> Value:
        return _located("step", admit(env.step(), "Env.step()"))


def _needs_boolean(source: str, word: str, value: Value) -> Undefined:
    return Undefined(f"{source}: '{word}' needs True or False, got {describe(value)}")


@dataclass(frozen=True)
class Not(Node):
    operand: Node
    source: str

    def evaluate(self, env: Env) -> Value:
        value = self.operand.evaluate(env)
        if isinstance(value, Undefined):
            return value  # not U = U
        if isinstance(value, bool):
            return not value
        return _needs_boolean(self.operand.source, "not", value)

    def children(self) -> tuple[Node, ...]:
        return (self.operand,)


@dataclass(frozen=True)
class BoolOp(Node):
    op: str  # "and" | "or"
    operands: tuple[Node, ...]
    source: str

    def evaluate(self, env: Env) -> Value:
        deciding = self.op == "or"  # the operand value that settles the result: True for or, False for and
        first_undefined: Undefined | None = None
        for operand in self.operands:
            value = operand.evaluate(env)
            if value is deciding:
                return deciding  # later operands are not evaluated: a read is computed only if needed
            if value is not (not deciding) and first_undefined is None:
                first_undefined = (
                    value if isinstance(value, Undefined) else _needs_boolean(operand.source, self.op, value)
                )
        return (not deciding) if first_undefined is None else first_undefined

    def children(self) -> tuple[Node, ...]:
        return self.operands


@dataclass(frozen=True)
class Sign(Node):
    op: str  # "-" | "+"
    operand: Node
    source: str

    def evaluate(self, env: Env) -> Value:
        value = self.operand.evaluate(env)
        if isinstance(value, Undefined):
            return value
        if not is_number(value):
            return Undefined(f"{self.source}: unary '{self.op}' needs a number, got {describe(value)}")
        return -value if self.op == "-" else value

    def children(self) -> tuple[Node, ...]:
        return (self.operand,)


_ARITHMETIC: dict[str, Callable[[float, float], float]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
}


@dataclass(frozen=True)
class Arithmetic(Node):
    op: str  # one of _ARITHMETIC
    left: Node
    right: Node
    source: str

    def evaluate(self, env: Env) -> Value:
        left = self.left.evaluate(env)
        if isinstance(left, Undefined):
            return left
        right = self.right.evaluate(env)
        if isinstance(right, Undefined):
            return right
        for value in (left, right):
            if not is_number(value):
                return Undefined(f"{self.source}: '{self.op}' needs numbers, got {describe(value)}")
        if self.op == "/" and right == 0:
            return Undefined(f"division by zero in {self.source}")
        try:
            return _ARITHMETIC[self.op](left, right)
        except OverflowError:  # an integer too large to become a float
            return Undefined(f"overflow in {self.source}")

    def children(self) -> tuple[Node, ...]:
        return (self.left, self.right)


_ORDERINGS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
_EQUALITIES: dict[str, Callable[[object, object], bool]] = {"==": operator.eq, "!=": operator.ne}


def _compare(op: str, left: Value, right: Value, source: str) -> Value:
    for value in (left, right):
        if isinstance(value, Undefined):
            return value
    if is_number(left) and is_number(right):
        return {**_ORDERINGS, **_EQUALITIES}[op](left, right)
    if op in _EQUALITIES and type(left) is type(right) and isinstance(left, (bool, str)):
        return _EQUALITIES[op](left, right)
    return Undefined(f"{source}: cannot compare {describe(left)} with {describe(right)} by '{op}'")


@dataclass(frozen=True)
class Comparison(Node):
    """`a < b <= c` is `a < b and b <= c` with b evaluated once, three-valued like `and`."""

    ops: tuple[str, ...]
    operands: tuple[Node, ...]  # one more than ops
    source: str

    def evaluate(self, env: Env) -> Value:
        first_undefined: Undefined | None = None
        left_node, left = self.operands[0], self.operands[0].evaluate(env)
        for op, right_node in zip(self.ops, self.operands[1:]):
            right = right_node.evaluate(env)
            result = _compare(op, left, right, f"{left_node.source} {op} {right_node.source}")
            if result is False:
                return False
            if isinstance(result, Undefined) and first_undefined is None:
                first_undefined = result
            left_node, left = right_node, right
        return True if first_undefined is None else first_undefined

    def children(self) -> tuple[Node, ...]:
        return self.operands


@dataclass(frozen=True)
class PureCall(Node):
    function: PureFunction
    args: tuple[Node, ...]
    source: str

    def evaluate(self, env: Env) -> Value:
        fn = self.function
        values = [arg.evaluate(env) for arg in self.args]
        if fn.takes_list and len(values) == 1 and isinstance(values[0], list):
            values = values[0]  # min(last(m, 3)) is the min of those three values
        elif fn.operand != "any" and any(isinstance(v, list) for v in values):
            return Undefined(f"{self.source}: a list can only be the sole argument of {fn.name}()")
        if fn.strict:
            for value in values:
                if isinstance(value, Undefined):
                    return value
        for value in values:
            if not isinstance(value, Undefined) and not matches(value, fn.operand):
                return Undefined(f"{self.source}: {fn.name}() takes {fn.operand}s, got {describe(value)}")
        if not values:
            return Undefined(f"{self.source}: {fn.name}() of no values")
        try:
            return fn.apply(values)
        except OverflowError:  # an integer too large to become a float
            return Undefined(f"overflow in {self.source}")

    def children(self) -> tuple[Node, ...]:
        return self.args


@dataclass(frozen=True)
class ContextCall(Node):
    function: str  # a key of CONTEXT_FUNCTIONS
    id: str | None  # the quoted id; None for all_oracles_passed()
    source: str

    def evaluate(self, env: Env) -> Value:
        if self.function == "all_oracles_passed":
            value = env.all_oracles_passed()
        else:
            ask = {"passed": env.oracle_passed, "killed": env.killed, "dropped": env.dropped}[self.function]
            value = ask(self.id)
        if not isinstance(value, (bool, Undefined)):
            raise TypeError(f"the Env answered {self.source} with {value!r}; it must answer True, False or Undefined")
        return _located(self.source, value)


@dataclass(frozen=True)
class HistoryCall(Node):
    function: HistoryFunction
    metric: str  # a bare metric name: the series, not a value
    argument: Node
    source: str
    after: Node | None = None  # after=s: only windows ending after step s

    def evaluate(self, env: Env) -> Value:
        argument = self.argument.evaluate(env)
        if isinstance(argument, Undefined):
            return argument
        if not is_number(argument):
            return Undefined(f"{self.source}: the second argument must be a number, got {describe(argument)}")
        history = [(step, admit(value, f"Env.history({self.metric!r})")) for step, value in env.history(self.metric)]
        steps = [step for step, _ in history]
        if steps != sorted(set(steps)) or not all(isinstance(v, (bool, int, float)) for _, v in history):
            raise ValueError(
                f"Env.history({self.metric!r}) must be (step, value) pairs, oldest first, one per step; "
                f"got steps {steps}"
            )
        if self.after is not None:
            after = self.after.evaluate(env)
            if isinstance(after, Undefined):
                return after
            if not is_number(after):
                return Undefined(f"{self.source}: after= must be a step number, got {describe(after)}")
            history = [(step, value) for step, value in history if step > after]
        return _located(self.source, self.function.apply(self.metric, history, argument))

    def children(self) -> tuple[Node, ...]:
        return (self.argument,) if self.after is None else (self.argument, self.after)


@dataclass(frozen=True)
class RowsCall(Node):
    function: RowFunction
    rows: tuple[str, str]  # (rung, metric): the rows, not a value
    anchor: tuple[str, str]
    source: str

    def evaluate(self, env: Env) -> Value:
        names = (".".join(self.rows), ".".join(self.anchor))
        found = []
        for (rung, metric), name in zip((self.rows, self.anchor), names):
            rows = env.rows(rung, metric)
            if isinstance(rows, Undefined):
                return Undefined(f"{self.source}: {name}: {rows.reason}")
            found.append({str(k): admit(v, f"Env.rows({rung!r}, {metric!r})") for k, v in rows.items()})
        deltas = differences(found[0], found[1], names)
        if isinstance(deltas, Undefined):
            return Undefined(f"{self.source}: {deltas.reason}")
        return self.function.apply(deltas)
