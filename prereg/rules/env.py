"""Env: what an expression asks its caller for. MapEnv: an Env over values computed beforehand."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

from prereg.rules.values import Undefined, Value


class Env(Protocol):
    """Supplied by the caller (verdict, engine); the evaluator asks it for everything contextual.

    Each method returns a value or an Undefined whose reason says why ("rung C did not run"); the
    evaluator prefixes the name that was asked for ("C.s_per_step: rung C did not run").
    """

    def read(self, name: str) -> Value: ...  # a read's value (the caller evaluates reads lazily)

    def rung_metric(self, rung: str, metric: str) -> Value: ...

    # a per-row metric's rows on a rung: row id -> value (row functions pair them by id)
    def rows(self, rung: str, metric: str) -> Mapping[str, float] | Undefined: ...

    # bare metric: in a pass rule the judged rung's summary; in a kill line the window just finished
    def metric(self, name: str) -> Value: ...

    def step(self) -> Value: ...  # kill scope: the last step of the window just finished

    # kill scope: (step, value) of every finished window so far that has the metric, oldest first
    def history(self, metric: str) -> list[tuple[int, float]]: ...

    def oracle_passed(self, oracle_or_item_id: str) -> Value: ...  # passed("P1a") an oracle, passed("P1") an item

    def all_oracles_passed(self) -> Value: ...

    def killed(self, kill_or_rung_id: str) -> Value: ...

    def dropped(self, item_id: str) -> Value: ...


class MapEnv:
    """An Env over dicts: for tests, and for callers that have every value at hand.

    Whatever is absent evaluates to Undefined with the reason. `oracles` maps an oracle id or an item id
    to whether it passed; `all_oracles` defaults to the three-valued `and` of every entry of `oracles`.
    """

    def __init__(
        self,
        *,
        reads: Mapping[str, Value] | None = None,
        rung_metrics: Mapping[tuple[str, str], Value] | None = None,
        rows: Mapping[tuple[str, str], Mapping[str, float]] | None = None,
        metrics: Mapping[str, Value] | None = None,
        step: int | None = None,
        history: Mapping[str, Sequence[tuple[int, float]]] | None = None,
        oracles: Mapping[str, bool | Undefined] | None = None,
        all_oracles: bool | Undefined | None = None,
        kills: Mapping[str, bool | Undefined] | None = None,
        dropped: Iterable[str] = (),
    ):
        self._reads = MappingProxyType(dict(reads or {}))
        self._rung_metrics = MappingProxyType(dict(rung_metrics or {}))
        self._rungs_measured = frozenset(rung for rung, _ in self._rung_metrics)
        self._rows = MappingProxyType(dict(rows or {}))
        self._metrics = MappingProxyType(dict(metrics or {}))
        self._step = step
        self._history = MappingProxyType({name: list(series) for name, series in (history or {}).items()})
        self._oracles = MappingProxyType(dict(oracles or {}))
        self._all_oracles = all_oracles
        self._kills = MappingProxyType(dict(kills or {}))
        self._dropped = frozenset(dropped)

    def read(self, name: str) -> Value:
        return self._reads.get(name, Undefined("not computed"))

    def rung_metric(self, rung: str, metric: str) -> Value:
        if rung not in self._rungs_measured:
            return Undefined(f"rung {rung} has no measurements")
        return self._rung_metrics.get((rung, metric), Undefined(f"rung {rung} did not measure {metric}"))

    def rows(self, rung: str, metric: str) -> Mapping[str, float] | Undefined:
        return self._rows.get((rung, metric), Undefined(f"rung {rung} has no rows of {metric}"))

    def metric(self, name: str) -> Value:
        return self._metrics.get(name, Undefined("not measured"))

    def step(self) -> Value:
        return Undefined("no window has finished") if self._step is None else self._step

    def history(self, metric: str) -> list[tuple[int, float]]:
        return list(self._history.get(metric, []))

    def oracle_passed(self, oracle_or_item_id: str) -> Value:
        return self._oracles.get(oracle_or_item_id, Undefined("no result recorded"))

    def all_oracles_passed(self) -> Value:
        if self._all_oracles is not None:
            return self._all_oracles
        if not self._oracles:
            return Undefined("no oracle has a result")
        results = list(self._oracles.values())
        if any(result is False for result in results):
            return False
        undefined = [result for result in results if isinstance(result, Undefined)]
        return undefined[0] if undefined else True

    def killed(self, kill_or_rung_id: str) -> Value:
        return self._kills.get(kill_or_rung_id, Undefined("no record"))

    def dropped(self, item_id: str) -> Value:
        return item_id in self._dropped
