"""compile_expr: parse an expression with Python's parser, check it against the allow-list and the scope,
and build the nodes that evaluate it.

Only the node types handled below are accepted; everything else (subscripts, lambdas, comprehensions,
f-strings, `**`, attribute access, keyword arguments, ...) is refused by name, with its column. Nothing is
ever executed: Python's parser is used for its grammar only.
"""

from __future__ import annotations

import ast
import difflib
import io
import tokenize
import warnings
from collections.abc import Iterable

from prereg.rules.error import RuleError
from prereg.rules.expr import Expr
from prereg.rules.functions import (
    CONTEXT_FUNCTIONS,
    HISTORY_FUNCTIONS,
    HISTORY_QUALIFIED,
    PURE_FUNCTIONS,
    ROW_FUNCTIONS,
)
from prereg.rules.nodes import (
    Arithmetic,
    BoolOp,
    Comparison,
    Constant,
    ContextCall,
    HistoryCall,
    MetricRef,
    Node,
    Not,
    PureCall,
    ReadRef,
    RowsCall,
    RungMetricRef,
    Sign,
    StepRef,
)
from prereg.rules.scope import CONDITION_KINDS, KIND_NOUNS, REFERENCE_KINDS, Scope
from prereg.rules.values import StaticType

MAX_LENGTH = 1000  # characters: a rule is a line or two of arithmetic and conditions, not a program
MAX_DEPTH = 32  # nested sub-expressions or parentheses: keeps compiling and evaluating shallow and bounded

ALLOWED_SYNTAX = (
    "allowed: numbers, True, False, 'strings', names, RUNG.metric, calls of listed functions f(x, y), "
    "parentheses, + - * /, unary - and +, comparisons < <= > >= == != (chained too), and, or, not"
)
ALLOWED_OPERATORS = "the operators are + - * /, unary - and +, < <= > >= == != (chained too), and, or, not"

_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_REFUSED_BINARY = {
    ast.Pow: ("**", "power"),
    ast.Mod: ("%", "remainder"),
    ast.FloorDiv: ("//", "floor division"),
    ast.MatMult: ("@", "matrix multiplication"),
    ast.LShift: ("<<", "bit shift"),
    ast.RShift: (">>", "bit shift"),
    ast.BitOr: ("|", "bitwise or"),
    ast.BitXor: ("^", "bitwise xor"),
    ast.BitAnd: ("&", "bitwise and"),
}
_COMPARISONS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_REFUSED_COMPARISONS = {ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
_CONSTRUCTS = {
    ast.Subscript: "a subscript x[...]",
    ast.Slice: "a slice",
    ast.Lambda: "a lambda",
    ast.ListComp: "a comprehension",
    ast.SetComp: "a comprehension",
    ast.DictComp: "a comprehension",
    ast.GeneratorExp: "a comprehension",
    ast.JoinedStr: "an f-string",
    ast.FormattedValue: "an f-string",
    ast.NamedExpr: "an assignment expression (:=)",
    ast.IfExp: "a conditional expression (a if c else b)",
    ast.Starred: "a starred expression (*x)",
    ast.List: "a list display [...]",
    ast.Tuple: "a tuple",
    ast.Set: "a set display {...}",
    ast.Dict: "a dict display {...}",
    ast.Await: "await",
    ast.Yield: "yield",
    ast.YieldFrom: "yield",
}


def compile_expr(text: str, scope: Scope) -> Expr:
    """Parse, allow-list and resolve `text` in `scope`; raise RuleError naming what is refused and why."""
    if len(text) > MAX_LENGTH:
        raise RuleError(text, f"the expression is {len(text)} characters long; the cap is {MAX_LENGTH}")
    return _Compiler(text, scope).build()


class _Compiler:
    def __init__(self, text: str, scope: Scope):
        self.text = text
        self.scope = scope
        # Python's eval mode refuses leading indentation; a TOML multi-line string often starts with some.
        self.body = text.lstrip(" \t\r\n")
        self.offset = len(text) - len(self.body)
        self.line_starts = _line_starts(self.body)

    # -- positions and messages ---------------------------------------------------------------------

    def _index(self, lineno: int, col_offset: int) -> int:
        """Character index in `body` of an AST position (a 1-based line and a UTF-8 byte offset)."""
        start = self.line_starts[lineno - 1]
        return start + len(self.body[start:].encode("utf-8")[:col_offset].decode("utf-8"))

    def _column(self, node: ast.AST) -> int:
        return self.offset + self._index(node.lineno, node.col_offset) + 1

    def _segment(self, node: ast.AST) -> str:
        return self.body[self._index(node.lineno, node.col_offset) : self._index(node.end_lineno, node.end_col_offset)]

    def _operator_column(self, left: ast.AST, right: ast.AST, symbol: str) -> int:
        # The AST keeps no position for an operator; it is the first occurrence of its symbol between operands.
        found = self.body.find(
            symbol, self._index(left.end_lineno, left.end_col_offset), self._index(right.lineno, right.col_offset)
        )
        assert found >= 0, (symbol, self.body)
        return self.offset + found + 1

    def _refuse(
        self, problem: str, *, node: ast.AST | None = None, column: int | None = None, allowed: str | None = None
    ) -> RuleError:
        if node is not None:
            column = self._column(node)
        return RuleError(self.text, problem, column=column, allowed=allowed)

    # -- the pipeline ------------------------------------------------------------------------------

    def build(self) -> Expr:
        if not self.body.strip():
            raise RuleError(self.text, "the expression is empty", allowed=ALLOWED_SYNTAX)
        tree = self._parse()
        self._check_depth(tree)
        root, static = self._expr(tree.body)
        kind = self.scope.kind
        if static == "list":
            raise self._refuse(
                "last(...) gives a list, which is not a value on its own",
                node=tree.body,
                allowed="use it as the only argument of min, max, mean, median, sum, all, any or count",
            )
        if kind in CONDITION_KINDS and static not in ("boolean", "any"):
            raise self._refuse(
                f"{KIND_NOUNS[kind]} must be a condition (True or False), and this is a {static}",
                node=tree.body,
                allowed="compare it, e.g. x >= 0.05",
            )
        return Expr(text=self.text, scope_kind=kind, root=root)

    def _parse(self) -> ast.Expression:
        with warnings.catch_warnings():
            # SyntaxWarnings ("is" with a literal, invalid escapes) are about Python semantics this language
            # never runs; the allow-list reports what matters.
            warnings.simplefilter("ignore")
            try:
                return ast.parse(self.body, mode="eval")
            except SyntaxError as error:
                column = None
                if error.lineno and error.offset and error.lineno <= len(self.line_starts):
                    column = self.offset + self.line_starts[error.lineno - 1] + error.offset
                raise RuleError(
                    self.text, f"not a valid expression ({error.msg})", column=column, allowed=ALLOWED_SYNTAX
                ) from None

    def _check_depth(self, tree: ast.Expression) -> None:
        # Iterative on purpose: the tree may be hundreds deep (`- - - ... 1`) and is measured before any
        # recursive walk of it.
        deepest, stack = 0, [(tree.body, 1)]
        while stack:
            node, depth = stack.pop()
            if isinstance(node, ast.expr):
                deepest = max(deepest, depth)
                depth += 1
            stack.extend((child, depth) for child in ast.iter_child_nodes(node))
        parentheses, open_now = 0, 0
        for token in tokenize.generate_tokens(io.StringIO(self.body).readline):
            if token.type == tokenize.OP and token.string == "(":
                open_now += 1
                parentheses = max(parentheses, open_now)
            elif token.type == tokenize.OP and token.string == ")":
                open_now -= 1
        if max(deepest, parentheses) > MAX_DEPTH:
            raise RuleError(
                self.text,
                f"the expression nests {max(deepest, parentheses)} deep; "
                f"the cap is {MAX_DEPTH} nested sub-expressions or parentheses",
                allowed="split it into named reads, and write a long sum as sum(a, b, ...)",
            )

    # -- nodes -------------------------------------------------------------------------------------

    def _expr(self, node: ast.expr) -> tuple[Node, StaticType]:
        handler = {
            ast.Constant: self._constant,
            ast.Name: self._name,
            ast.Attribute: self._attribute,
            ast.UnaryOp: self._unary,
            ast.BinOp: self._binary,
            ast.BoolOp: self._boolean,
            ast.Compare: self._comparison,
            ast.Call: self._call,
        }.get(type(node))
        if handler is None:
            what = _CONSTRUCTS.get(type(node), f"{type(node).__name__} syntax")
            raise self._refuse(f"{what} is not allowed", node=node, allowed=ALLOWED_SYNTAX)
        return handler(node)

    def _constant(self, node: ast.Constant) -> tuple[Node, StaticType]:
        value, source = node.value, self._segment(node)
        if isinstance(value, bool):
            return Constant(value, source), "boolean"
        if isinstance(value, (int, float)):
            return Constant(value, source), "number"
        if isinstance(value, str):
            return Constant(value, source), "string"
        if value is None:
            raise self._refuse(
                "None is not a value here",
                node=node,
                allowed="a missing measurement is undefined: test it with defined(x)",
            )
        what = {complex: "a complex number", bytes: "a bytes literal"}.get(type(value), repr(value))
        raise self._refuse(
            f"{what} is not allowed",
            node=node,
            allowed="constants are int and float numbers, True, False and 'strings'",
        )

    def _spelled(self, node: ast.AST, written: str, expected: str) -> None:
        # Python folds look-alike identifiers (NFKC: 'ﬁnite' is 'finite') and allows `A . x`; a frozen rule
        # must read as what it does, so the text has to spell the name exactly.
        if written != expected:
            raise self._refuse(f"{written!r} must be written exactly as {expected!r} (ASCII, no spaces)", node=node)

    def _name(self, node: ast.Name) -> tuple[Node, StaticType]:
        name, scope, kind = node.id, self.scope, self.scope.kind
        self._spelled(node, self._segment(node), name)
        if kind in REFERENCE_KINDS and name in scope.reads:
            return ReadRef(name, name), "any"
        if kind == "kill" and name == "step":
            return StepRef("step"), "number"
        if kind not in REFERENCE_KINDS and name in scope.metrics:
            return MetricRef(name, name), "any"
        raise self._refuse(self._unknown_name(name), node=node, allowed=self._names_here())

    def _unknown_name(self, name: str) -> str:
        scope, kind = self.scope, self.scope.kind
        if kind in REFERENCE_KINDS and name in scope.metrics:
            example = sorted(scope.rungs - {"PASS"})[:1] or ["RUNG"]
            return (
                f"{name!r} is a metric; in {KIND_NOUNS[kind]} name the rung it was measured on, "
                f"e.g. {example[0]}.{name}"
            )
        if name == "step":
            return "'step' exists only in kill lines, where it is the last step of the window just finished"
        if name in scope.rungs:
            return f"{name!r} is a rung; name one of its measurements, {name}.metric"
        if name in self._functions_here():
            return f"{name!r} is a function; call it, {name}(...)"
        if name in ("true", "false", "null", "none"):
            return f"unknown name {name!r}; write True or False (and test a missing value with defined(x))"
        return f"unknown name {name!r}" + _suggestion(name, self._bare_names())

    def _bare_names(self) -> frozenset[str]:
        if self.scope.kind in REFERENCE_KINDS:
            return self.scope.reads
        return self.scope.metrics | ({"step"} if self.scope.kind == "kill" else set())

    def _names_here(self) -> str:
        scope = self.scope
        rungs = _listing(scope.rungs)
        if scope.kind in REFERENCE_KINDS:
            return f"names here are reads ({_listing(scope.reads)}) and rung metrics RUNG.metric with rungs {rungs}"
        bare = "the judged rung's metrics" if scope.kind == "pass_rule" else "the window's metrics"
        step = " and step" if scope.kind == "kill" else ""
        return f"names here are {bare} ({_listing(scope.metrics)}){step}, and RUNG.metric with rungs {rungs}"

    def _attribute(self, node: ast.Attribute) -> tuple[Node, StaticType]:
        scope = self.scope
        if not isinstance(node.value, ast.Name):
            raise self._refuse(
                f"attribute access '.{node.attr}' on {self._segment(node.value)!r} is not allowed",
                node=node,
                allowed="a dotted name is exactly RUNG.metric, one dot, a rung's measurement",
            )
        rung, metric = node.value.id, node.attr
        self._spelled(node, self._segment(node), f"{rung}.{metric}")
        if rung == "PASS" and scope.kind == "pass_rule":
            raise self._refuse(
                "PASS is not available in a pass rule: "
                "it names the rung that passed, which is what the pass rule decides",
                node=node,
            )
        if rung not in scope.rungs:
            other_name = rung in {*self._functions_here(), *scope.reads, *scope.metrics, "step"}
            raise self._refuse(
                f"attribute access '.{metric}' on {rung!r} is not allowed: {rung!r} is not a rung"
                if other_name
                else f"rung {rung!r} does not exist" + _suggestion(rung, scope.rungs),
                node=node,
                allowed=(
                    f"rungs are {_listing(scope.rungs)} (a dotted name is RUNG.metric, never Python attribute access)"
                ),
            )
        if metric not in scope.metrics:
            raise self._refuse(
                f"rung {rung} has no metric {metric!r}" + _suggestion(metric, scope.metrics),
                node=node,
                allowed=f"metrics are {_listing(scope.metrics)}",
            )
        return RungMetricRef(rung, metric, f"{rung}.{metric}"), "any"

    def _unary(self, node: ast.UnaryOp) -> tuple[Node, StaticType]:
        if isinstance(node.op, ast.Invert):
            raise self._refuse("'~' (bitwise not) is not allowed", node=node, allowed=ALLOWED_OPERATORS)
        operand, static = self._expr(node.operand)
        if isinstance(node.op, ast.Not):
            self._expect(node.operand, static, "boolean", "'not'")
            return Not(operand, self._segment(node)), "boolean"
        self._expect(node.operand, static, "number", "unary minus" if isinstance(node.op, ast.USub) else "unary plus")
        return Sign("-" if isinstance(node.op, ast.USub) else "+", operand, self._segment(node)), "number"

    def _binary(self, node: ast.BinOp) -> tuple[Node, StaticType]:
        if type(node.op) in _REFUSED_BINARY:
            symbol, what = _REFUSED_BINARY[type(node.op)]
            raise self._refuse(
                f"'{symbol}' ({what}) is not allowed",
                column=self._operator_column(node.left, node.right, symbol),
                allowed=ALLOWED_OPERATORS,
            )
        symbol = _BINARY[type(node.op)]
        left, left_type = self._expr(node.left)
        right, right_type = self._expr(node.right)
        self._expect(node.left, left_type, "number", f"'{symbol}'")
        self._expect(node.right, right_type, "number", f"'{symbol}'")
        return Arithmetic(symbol, left, right, self._segment(node)), "number"

    def _boolean(self, node: ast.BoolOp) -> tuple[Node, StaticType]:
        op = "and" if isinstance(node.op, ast.And) else "or"
        operands = []
        for value in node.values:
            operand, static = self._expr(value)
            self._expect(value, static, "boolean", f"'{op}'")
            operands.append(operand)
        return BoolOp(op, tuple(operands), self._segment(node)), "boolean"

    def _comparison(self, node: ast.Compare) -> tuple[Node, StaticType]:
        sides = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, sides, sides[1:]):
            if type(op) in _REFUSED_COMPARISONS:
                symbol = _REFUSED_COMPARISONS[type(op)]
                raise self._refuse(
                    f"'{symbol}' is not allowed",
                    column=self._operator_column(left, right, symbol.split()[0]),
                    allowed=ALLOWED_OPERATORS,
                )
        compiled = [self._expr(side) for side in sides]
        ops = [_COMPARISONS[type(op)] for op in node.ops]
        for index, op in enumerate(ops):
            left_ast, right_ast = sides[index], sides[index + 1]
            left_type, right_type = compiled[index][1], compiled[index + 1][1]
            if op in ("==", "!="):
                for side, static in ((left_ast, left_type), (right_ast, right_type)):
                    if static == "list":
                        raise self._refuse(f"{self._segment(side)!r} is a list, which cannot be compared", node=side)
                if "any" not in (left_type, right_type) and left_type != right_type:
                    raise self._refuse(
                        f"'{op}' compares a {left_type} with a {right_type}, which is never equal",
                        column=self._operator_column(left_ast, right_ast, op),
                    )
            else:
                self._expect(left_ast, left_type, "number", f"'{op}'")
                self._expect(right_ast, right_type, "number", f"'{op}'")
        return Comparison(tuple(ops), tuple(n for n, _ in compiled), self._segment(node)), "boolean"

    def _expect(self, node: ast.expr, static: StaticType, wanted: StaticType, where: str) -> None:
        if wanted != "any" and static not in (wanted, "any"):
            raise self._refuse(f"{where} needs a {wanted}, and {self._segment(node)!r} is a {static}", node=node)

    # -- calls -------------------------------------------------------------------------------------

    def _functions_here(self) -> list[str]:
        names = list(PURE_FUNCTIONS)
        if self.scope.kind in REFERENCE_KINDS:
            names += list(CONTEXT_FUNCTIONS) + list(ROW_FUNCTIONS)
        if self.scope.kind == "kill":
            names += list(HISTORY_FUNCTIONS)
        return names

    def _call(self, node: ast.Call) -> tuple[Node, StaticType]:
        if not isinstance(node.func, ast.Name):
            raise self._refuse(
                f"only a function's name can be called, and this calls {self._segment(node.func)!r}",
                node=node,
                allowed=f"functions are {', '.join(self._functions_here())}",
            )
        name = node.func.id
        self._spelled(node.func, self._segment(node.func), name)
        kind = self.scope.kind
        if name in CONTEXT_FUNCTIONS and kind not in REFERENCE_KINDS:
            raise self._refuse(
                f"{name}() is not available in {KIND_NOUNS[kind]}: it judges a finished ladder",
                node=node,
                allowed="it is available in reads, rules and expectations",
            )
        if name in ROW_FUNCTIONS and kind not in REFERENCE_KINDS:
            raise self._refuse(
                f"{name}() is not available in {KIND_NOUNS[kind]}: it pairs the rows of finished rungs",
                node=node,
                allowed="it is available in reads, rules and expectations",
            )
        if name in HISTORY_FUNCTIONS and kind != "kill":
            raise self._refuse(
                f"{name}() reaches back through a running rung's windows and exists only in kill lines", node=node
            )
        if name not in self._functions_here():
            raise self._refuse(
                f"unknown function {name!r}" + _suggestion(name, self._functions_here()),
                node=node,
                allowed=f"functions are {', '.join(self._functions_here())}",
            )
        for keyword in node.keywords:
            if name in HISTORY_QUALIFIED and keyword.arg == "after":
                continue  # last(m, n, after=s): the qualifier of a history call, compiled with it
            shown = f"'{keyword.arg}='" if keyword.arg else "'**' unpacking"
            raise self._refuse(
                f"keyword argument {shown} is not allowed in {name}()", node=keyword, allowed="arguments are positional"
            )
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                raise self._refuse(
                    f"a starred argument '*{self._segment(arg.value)}' is not allowed",
                    node=arg,
                    allowed="arguments are written out one by one",
                )
        if name in PURE_FUNCTIONS:
            return self._pure_call(node, name)
        if name in CONTEXT_FUNCTIONS:
            return self._context_call(node, name)
        if name in ROW_FUNCTIONS:
            return self._rows_call(node, name)
        return self._history_call(node, name)

    def _arity(self, node: ast.Call, name: str, usage: str, least: int, most: int | None) -> None:
        count = len(node.args)
        if count < least or (most is not None and count > most):
            wanted = f"{least}" if least == most else f"at least {least}" if most is None else f"{least} to {most}"
            raise self._refuse(f"{name}() takes {wanted} argument(s), got {count}", node=node, allowed=usage)

    def _pure_call(self, node: ast.Call, name: str) -> tuple[Node, StaticType]:
        fn = PURE_FUNCTIONS[name]
        self._arity(node, name, fn.usage, fn.min_args, fn.max_args)
        args = []
        for arg in node.args:
            compiled, static = self._expr(arg)
            list_allowed = fn.operand == "any" or (fn.takes_list and len(node.args) == 1)
            if static == "list" and not list_allowed:
                raise self._refuse(
                    f"{self._segment(arg)!r} is a list, which {name}() takes only as its sole argument"
                    if fn.takes_list
                    else f"{name}() does not take a list",
                    node=arg,
                    allowed=fn.usage,
                )
            if static != "list":
                self._expect(arg, static, fn.operand, f"{name}()")
            args.append(compiled)
        return PureCall(fn, tuple(args), self._segment(node)), fn.returns

    def _context_call(self, node: ast.Call, name: str) -> tuple[Node, StaticType]:
        fn = CONTEXT_FUNCTIONS[name]
        takes = 1 if fn.id_sources else 0
        self._arity(node, name, fn.usage, takes, takes)
        if not fn.id_sources:
            return ContextCall(name, None, self._segment(node)), "boolean"
        (arg,) = node.args
        known = frozenset().union(*(getattr(self.scope, source) for source in fn.id_sources))
        kinds = " or ".join(source.rstrip("s") for source in fn.id_sources)
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            raise self._refuse(f"{name}() takes a quoted {kinds} id, not an expression", node=arg, allowed=fn.usage)
        if arg.value not in known or arg.value == "PASS":
            raise self._refuse(
                f"{arg.value!r} is not a known {kinds} id" + _suggestion(arg.value, known),
                node=arg,
                allowed=f"{kinds} ids are {_listing(known - {'PASS'})}",
            )
        return ContextCall(name, arg.value, self._segment(node)), "boolean"

    def _rows_call(self, node: ast.Call, name: str) -> tuple[Node, StaticType]:
        fn = ROW_FUNCTIONS[name]
        self._arity(node, name, fn.usage, 2, 2)
        refs = []
        for arg in node.args:
            row_metrics = self.scope.row_metrics
            if not (isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name)):
                raise self._refuse(
                    f"{name}() pairs rows: {self._segment(arg)!r} is not RUNG.metric",
                    node=arg,
                    allowed=f"{fn.usage}; metrics recorded row by row are {_listing(row_metrics)}",
                )
            compiled, _ = self._attribute(arg)  # the rung and the metric exist, spelled exactly
            assert isinstance(compiled, RungMetricRef)
            if compiled.metric not in row_metrics:
                raise self._refuse(
                    f"{name}() pairs rows, and {compiled.metric!r} is not recorded row by row",
                    node=arg,
                    allowed=f"metrics recorded row by row are {_listing(row_metrics)}",
                )
            refs.append((compiled.rung, compiled.metric))
        return RowsCall(fn, refs[0], refs[1], self._segment(node)), "number"

    def _history_call(self, node: ast.Call, name: str) -> tuple[Node, StaticType]:
        fn = HISTORY_FUNCTIONS[name]
        self._arity(node, name, fn.usage, 2, 2)
        series, argument = node.args
        metrics = self.scope.metrics
        if not isinstance(series, ast.Name) or series.id not in metrics:
            shown = self._segment(series)
            problem = f"{shown!r} is not a metric" + (
                _suggestion(series.id, metrics) if isinstance(series, ast.Name) else ""
            )
            raise self._refuse(
                f"the first argument of {name}() names a metric's series: {problem}",
                node=series,
                allowed=f"metrics are {_listing(metrics)}",
            )
        self._spelled(series, self._segment(series), series.id)
        compiled, static = self._expr(argument)
        self._expect(argument, static, "number", f"{name}()")
        if (
            name == "last"
            and isinstance(argument, ast.Constant)
            and (not isinstance(argument.value, int) or argument.value < 1)
        ):
            raise self._refuse(
                f"last() counts windows: a whole number >= 1, got {argument.value!r}", node=argument, allowed=fn.usage
            )
        after = next((k.value for k in node.keywords if k.arg == "after"), None)
        if after is None:
            return HistoryCall(fn, series.id, compiled, self._segment(node)), fn.returns
        after_compiled, after_static = self._expr(after)
        self._expect(after, after_static, "number", f"{name}()'s after=")
        return HistoryCall(fn, series.id, compiled, self._segment(node), after_compiled), fn.returns


def _line_starts(text: str) -> list[int]:
    """Character index where each line starts, splitting as Python's tokenizer does (\\n, \\r\\n, \\r)."""
    starts, index = [0], 0
    while index < len(text):
        if text[index] == "\r" and text[index + 1 : index + 2] == "\n":
            index += 1
        if text[index] in "\r\n":
            starts.append(index + 1)
        index += 1
    return starts


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names) if names else "(none)"


def _suggestion(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, sorted(candidates), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
