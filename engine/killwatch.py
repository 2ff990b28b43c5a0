"""Kill lines, checked on every window of a running rung (docs/design.md "Kill lines").

In a kill line a bare metric is the value in the window just finished, `step` its last step, and the history
functions reach back over every finished window of this run. A run that crashes is judged once more, on its crash
window (engine/crash.py): `rc` and `step` only. A line with at = "save" that holds waits for the
next save boundary before it kills ("kills wait for save boundaries").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prereg.rules import Expr, Scope, Undefined, compile_expr
from prereg.schema import KillLine, Registration, scope_names


class KillEnv:
    """The rule language's Env over one run's windows."""

    def __init__(self, windows: list[dict[str, Any]]):
        self.windows = windows

    def metric(self, name: str) -> Any:
        current = self.windows[-1]
        if name not in current:
            return Undefined(f"{name} is not in this window")
        return current[name]

    def step(self) -> Any:
        return self.windows[-1]["step"]

    def history(self, metric: str) -> list[tuple[int, float]]:
        return [(w["step"], w[metric]) for w in self.windows if metric in w]

    def read(self, name: str) -> Any:
        return Undefined("reads are not visible to kill lines")

    def rung_metric(self, rung: str, metric: str) -> Any:
        return Undefined("rung summaries are not visible to kill lines")

    def rows(self, rung: str, metric: str) -> Any:
        return Undefined("recorded rows are not visible to kill lines")

    def oracle_passed(self, ident: str) -> Any:
        return Undefined("oracles are not visible to kill lines")

    def all_oracles_passed(self) -> Any:
        return Undefined("oracles are not visible to kill lines")

    def killed(self, ident: str) -> Any:
        return False

    def dropped(self, item_id: str) -> Any:
        return False


def kill_scope(reg: Registration) -> Scope:
    """The names a kill line may use: the ones it was validated with (prereg/schema.py)."""
    return Scope(kind="kill", **scope_names(reg, reg.declaration()))


@dataclass
class KillWatch:
    reg: Registration
    rung: str  # the declared rung id (a primed rung C' is watched by C's lines)
    items: tuple[str, ...] = ()  # what this run runs
    lines: list[tuple[KillLine, Expr]] = field(default_factory=list)
    pending: dict[str, int] = field(default_factory=dict)  # at="save" lines that held, waiting for a boundary

    def __post_init__(self) -> None:
        scope = kill_scope(self.reg)
        # A line whose contingency drops items suspects those items: it watches only runs that still carry one
        # (K-cudnn of registrations/molmo2-perf-pass1.toml is about P1; C' re-benched without P1 is not its
        # business).
        self.lines = [
            (k, compile_expr(k.when, scope))
            for k in self.reg.kill
            if (not k.rungs or self.rung in k.rungs) and (not k.drops or set(k.drops) & set(self.items))
        ]

    def check(self, windows: list[dict[str, Any]], *, final: bool = False) -> dict[str, Any] | None:
        """The kill that fires on the window just finished, or None. `final`: it is the run's crash window
        (engine/crash.py): no save boundary will come, so a save line that holds, or held, fires on it."""
        env = KillEnv(windows)
        step = windows[-1]["step"]
        save_every = self.reg.protocol.save_every
        for line, expr in self.lines:
            held = expr.evaluate(env) is True
            if line.at == "save":
                if held and line.id not in self.pending:
                    self.pending[line.id] = step
                if line.id in self.pending and (final or (save_every and step % save_every == 0)):
                    return {
                        "kill": line.id,
                        "step": step,
                        "held_since": self.pending[line.id],
                        "drops": list(line.drops),
                        "reason": (
                            f"`{line.when}` held at step {self.pending[line.id]}; "
                            + (f"the run crashed at step {step}" if final else f"killed at the save boundary {step}")
                        ),
                    }
            elif held:
                return {
                    "kill": line.id,
                    "step": step,
                    "drops": list(line.drops),
                    "reason": f"`{line.when}` held at step {step}" + (" (the run crashed)" if final else ""),
                }
        return None
