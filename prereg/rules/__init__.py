"""The rule language: the small expression language of reads, rules, pass rules, kill lines and
expectation checks (docs/design.md, "The rule language").

    expr = compile_expr("(A.s_per_step - C.s_per_step) / A.s_per_step", Scope("reads", rungs=..., metrics=...))
    expr.evaluate(env)   # a number, a boolean, ... or Undefined("C.s_per_step: rung C did not run")
"""

from prereg.rules.env import Env, MapEnv
from prereg.rules.error import RuleError
from prereg.rules.expr import Expr
from prereg.rules.parse import MAX_DEPTH, MAX_LENGTH, compile_expr
from prereg.rules.scope import Scope
from prereg.rules.values import Undefined, Value

__all__ = [
    "Env",
    "Expr",
    "MAX_DEPTH",
    "MAX_LENGTH",
    "MapEnv",
    "RuleError",
    "Scope",
    "Undefined",
    "Value",
    "compile_expr",
]
