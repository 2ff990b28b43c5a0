"""The registration document: pydantic models, validated at construction, every reference resolved.

A `Registration` that exists is one that can be evaluated: every item in a rung, rung and read in a rule,
switch, probe, metric, profile and config key is checked here against the workload's declaration, and every
expression is compiled by the rule language with the names of its scope. Unknown keys are errors.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from prereg.assumed import check_paths
from prereg.registry import TableError, UnknownWorkload, get_workload
from prereg.rules import RuleError, Scope, compile_expr
from prereg.template import first_blank
from prereg.workload import ConfigError, RetiredOption, RunConfig, WorkloadDeclaration

# No "." in ids: amendments and review name fields by dotted paths (items.P1.oracles.P1a.bounds), and an id with a
# dot would make a path ambiguous, letting a change to something measured pass as a change to something else.
ID_PATTERN = r"^[A-Za-z][A-Za-z0-9_'-]*$"
Ident = Annotated[str, Field(pattern=ID_PATTERN, max_length=64)]

OracleKind = Literal["tolerance", "bitwise", "byte_match", "curve_overlay", "finite", "schema", "raises", "memory"]
Confidence = Literal["low", "medium-low", "medium", "medium-high", "high"]
# Calibration maps each confidence level to a probability: used by `audit calibration`'s Brier score.
CONFIDENCE_PROBABILITY: dict[str, float] = {
    "low": 0.2,
    "medium-low": 0.35,
    "medium": 0.5,
    "medium-high": 0.65,
    "high": 0.8,
}

# The validation context's key for the defaults table a document's run configs resolve with: a frozen document's
# own (prereg/state.py); absent, the workload's current defaults for the document's profile (a new document).
CONFIG_DEFAULTS = "config_defaults"

# Oracle kinds whose pass condition needs bounds, and the bound names each requires.
KINDS_WITHOUT_BOUNDS = {"bitwise", "byte_match", "finite", "schema", "raises"}
CURVE_OVERLAY_BOUNDS = {"max_abs_diff", "steady_band"}
STEADY_BAND_MIN_STEPS = 4  # the warm-up is the curve's first half: 4 steps leave one move between steady steps


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=False)


class Cost(Strict):
    ceiling_gpu_h: float = Field(gt=0, description="counts model loads, not only steps")
    on_ceiling: Literal["stop", "finish-rung", "continue"] = "stop"

    @field_validator("ceiling_gpu_h")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number of GPU-hours, got {value}")
        return value


class Oracle(Strict):
    id: Ident
    kind: OracleKind
    probe: str
    bounds: dict[str, float] = Field(default_factory=dict)
    steps: int | None = Field(default=None, gt=0, description="curve length for curve_overlay probes")
    title: str | None = None
    notes: str | None = None

    @field_validator("bounds")
    @classmethod
    def _bounds_finite_nonnegative(cls, bounds: dict[str, float]) -> dict[str, float]:
        for name, value in bounds.items():
            if isinstance(value, bool):
                raise ValueError(f"bound {name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"bound {name} = {value} must be a finite number >= 0")
        return bounds

    @model_validator(mode="after")
    def _bounds_fit_kind(self) -> "Oracle":
        if self.kind == "tolerance" and not self.bounds:
            raise ValueError("a tolerance oracle needs bounds, e.g. bounds = { loss_abs = 1e-3 }")
        if self.kind == "memory" and set(self.bounds) != {"peak_gib"}:
            raise ValueError(f"a memory oracle takes exactly bounds = {{ peak_gib = … }}, got {sorted(self.bounds)}")
        if self.kind == "curve_overlay":
            self._curve_overlay_bounds()
        if self.kind in KINDS_WITHOUT_BOUNDS and self.bounds:
            raise ValueError(f"a {self.kind} oracle has no bounds (it passes on equality/truth), got {self.bounds}")
        if self.kind == "curve_overlay" and self.steps is None:
            raise ValueError("a curve_overlay oracle needs steps = N (the curve length)")
        return self

    def _curve_overlay_bounds(self) -> None:
        """No bound: within the baseline's whole band (max step-to-step move); max_abs_diff: within that; steady_band
        = k: within k times the baseline's steady band, its largest move after its warm-up (oracles/judge.py)."""
        bounds = set(self.bounds)
        if bounds - CURVE_OVERLAY_BOUNDS or len(bounds) > 1:
            raise ValueError(
                f"a curve_overlay oracle takes at most one of the bounds {sorted(CURVE_OVERLAY_BOUNDS)}, got "
                f"{sorted(bounds)}; e.g. bounds = {{ steady_band = 1.0 }} (within the baseline's steady band)"
            )
        if "steady_band" in bounds and self.steps is not None and self.steps < STEADY_BAND_MIN_STEPS:
            raise ValueError(
                f"steps = {self.steps}: a steady band needs a curve of at least {STEADY_BAND_MIN_STEPS} steps (a move "
                "between two steps after the warm-up half); set steps >= 4"
            )


class Item(Strict):
    id: Ident
    title: str
    switch: str
    bitwise: bool
    oracles: list[Oracle] = Field(min_length=1)
    notes: str | None = None


class Rung(Strict):
    id: Ident
    items: list[str] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)
    title: str | None = None
    notes: str | None = None


class Noise(Strict):
    """[protocol.noise]: an A/A calibration. Before the ladder the gate runs the baseline twice for `windows` read
    windows; their window-to-window noise is what the sensitivity of every bar is estimated from."""

    windows: int = Field(strict=True, description="read windows of each of the two baseline runs")

    @field_validator("windows")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(
                f"windows = {value}: the calibration runs the baseline twice for N read windows; N must be > 0"
            )
        return value

    @field_validator("windows")
    @classmethod
    def _enough_for_an_estimate(cls, value: int) -> int:
        from prereg.sensitivity import MIN_RUN_WINDOWS  # here: prereg.sensitivity imports this module

        if 0 < value < MIN_RUN_WINDOWS:
            raise ValueError(
                f"windows = {value}: a run's noise is estimated from at least {MIN_RUN_WINDOWS} read windows (its "
                f"lag-1 autocorrelation's bias correction divides by N - 3); N must be >= {MIN_RUN_WINDOWS}"
            )
        return value


class Protocol(Strict):
    kind: Literal["compare", "until_pass"] = "compare"
    schedule: Literal["sequential", "interleaved"] = "sequential"
    steps: int = Field(gt=0)
    log_every: int = Field(gt=0)
    discard_first: int = Field(default=0, ge=0)
    seed: int = 0
    eval_every: int = Field(default=0, ge=0)
    save_every: int = Field(default=0, ge=0)
    config: dict[str, Any] = Field(default_factory=dict)
    rungs: list[Rung] = Field(min_length=1)
    pass_rule: str | None = None
    noise: Noise | None = None
    # What a bar whose minimum detectable effect exceeds its distance from no effect does to the run: warn, refuse
    # to run, or extend the read windows (within the cost ceiling) to the number the bar needs.
    on_underpowered: Literal["warn", "refuse", "extend"] = "warn"

    @model_serializer(mode="wrap")
    def _unstated_sensitivity_is_not_written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A document that states neither keeps the canonical form (and so the hash) of one written without them.
        data = handler(self)
        if self.noise is None:
            del data["noise"]
        if self.on_underpowered == "warn":
            del data["on_underpowered"]
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "Protocol":
        if self.discard_first >= self.steps:
            raise ValueError(f"discard_first = {self.discard_first} leaves no step of steps = {self.steps} to read")
        if self.kind == "until_pass" and not self.pass_rule:
            raise ValueError('an until_pass ladder needs protocol.pass_rule, e.g. pass_rule = "rc == 0"')
        if self.schedule == "interleaved":
            # One process, one model load: the rungs may differ in their items (switches), not in their config.
            differing = [r.id for r in self.rungs if r.config]
            if differing:
                raise ValueError(
                    f"an interleaved schedule shares one model load, so rungs cannot set their own config; "
                    f'rungs {differing} do: move it to protocol.config or use schedule = "sequential"'
                )
        if self.kind == "compare" and self.pass_rule:
            raise ValueError('pass_rule belongs to until_pass ladders; set kind = "until_pass" or remove it')
        return self


class ConditionalLand(Strict):
    item: str
    if_: str = Field(alias="if")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


LandEntry = str | ConditionalLand


class Rule(Strict):
    id: Ident
    when: str
    outcome: str = Field(min_length=1)
    land: list[LandEntry] = Field(default_factory=list)
    park: list[str] = Field(default_factory=list)
    notes: str | None = None


class KillLine(Strict):
    id: Ident
    when: str
    rungs: list[str] = Field(default_factory=list, description="empty: every rung")
    drops: list[str] = Field(default_factory=list, description="items a firing drops before the ladder re-plans")
    at: Literal["window", "save"] = "window"
    notes: str | None = None


class Expectation(Strict):
    n: int = Field(ge=1)
    part: str | None = Field(
        default=None, pattern=r"^[a-z]$", description="a seed expectation with several confidences: 3a, 3b"
    )
    claim: str
    confidence: Confidence
    check: str


class AdoptionCheck(Strict):
    """[[adoption]]: a check that only data recorded after the decision can answer (a transfer check: the box smoke
    shows at least half the local gain). `requires` names the rungs (or RUNG.metric) a later `prereg record` must
    bring; `when` is a condition over reads, like a rule's. prereg.adoption says how it is met, failed or pending."""

    id: Ident
    claim: str = Field(min_length=1)
    when: str
    requires: list[str] = Field(min_length=1, description="RUNG or RUNG.metric, each entered by `prereg record`")
    notes: str | None = None


class Registration(Strict):
    id: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=80)]
    title: str
    question: str
    workload: str
    profile: str
    source: str | None = Field(default=None, description="where the practice this encodes is written down")
    out_of_scope: list[str] = Field(default_factory=list)
    cost: Cost
    items: list[Item] = Field(default_factory=list)
    protocol: Protocol
    reads: dict[str, str] = Field(default_factory=dict)
    rules: list[Rule] = Field(default_factory=list)
    kill: list[KillLine] = Field(default_factory=list)
    expectations: list[Expectation] = Field(default_factory=list)
    adoption: list[AdoptionCheck] = Field(default_factory=list)
    # field path -> why the value is the encoder's, not the source's (prereg.assumed)
    assumed: dict[str, str] = Field(default_factory=dict)

    @model_serializer(mode="wrap")
    def _unstated_adoption_is_not_written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A document that states no adoption checks (or no assumed values) keeps the canonical form (and so the hash)
        # of one without the field.
        data = handler(self)
        for optional in ("adoption", "assumed"):
            if not getattr(self, optional):
                del data[optional]
        return data

    # Set by validation: the defaults table the run configs resolved with, and each rung's effective config.
    _config_defaults: dict[str, Any] = PrivateAttr(default_factory=dict)
    _effective: dict[str, RunConfig] = PrivateAttr(default_factory=dict)
    _gate_config: RunConfig | None = PrivateAttr(default=None)
    # The declaration of a workload the document declares itself (workload = "command"), validated by that
    # workload's factory. Absent, it is left out of the document, so documents without one hash as they always did.
    command: dict[str, Any] | None = Field(default=None, exclude_if=lambda table: table is None)
    # Where the rungs run: the name of a launcher in the lab's prereg.toml (prereg/launchers.py); absent, this
    # machine. Absent, it is left out of the document, so documents without one hash as they always did.
    launcher: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$", max_length=64)] | None = Field(
        default=None, exclude_if=lambda name: name is None
    )

    @model_validator(mode="before")
    @classmethod
    def _no_blanks(cls, data: Any) -> Any:
        blank = first_blank(data)
        if blank is not None:
            path, text = blank
            raise ValueError(f"{path}: {text!r} is a blank of the template; fill it in")
        return data

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo) -> "Registration":
        resolve_references(self, (info.context or {}).get(CONFIG_DEFAULTS))
        return self

    @model_validator(mode="after")
    def _assumed_paths_exist(self) -> "Registration":
        if self.assumed:
            check_paths(self.model_dump(mode="json", by_alias=True), self.assumed)
        return self

    def declaration(self) -> WorkloadDeclaration:
        """The workload's declaration, as this document resolves it (built from its own table where it has one)."""
        return get_workload(self.workload, self.command)

    # Convenience lookups (pure functions of the document).
    def item(self, item_id: str) -> Item:
        return next(i for i in self.items if i.id == item_id)

    def rung(self, rung_id: str) -> Rung:
        return next(r for r in self.protocol.rungs if r.id == rung_id)

    def oracle_owner(self) -> dict[str, str]:
        return {o.id: i.id for i in self.items for o in i.oracles}

    def rung_config(self, rung_id: str) -> dict[str, Any]:
        """What the document sets for a rung: protocol.config merged with the rung's own."""
        return {**self.protocol.config, **self.rung(rung_id).config}

    def effective_config(self, rung_id: str) -> RunConfig:
        """The rung's run config with every key set: its own keys over the defaults table it resolved with."""
        return self._effective[rung_id]

    @property
    def gate_config(self) -> RunConfig | None:
        """The oracle gate's run config (protocol.config alone); None for a document without items."""
        return self._gate_config

    @property
    def config_defaults(self) -> dict[str, Any]:
        """The defaults table the run configs resolved with, as plain data (what a freeze records)."""
        return json.loads(json.dumps(self._config_defaults))

    def effective_configs(self) -> dict[str, Any]:
        """Every effective config as plain data: what a freeze and an amendment record."""
        gate = None if self._gate_config is None else self._gate_config.model_dump(mode="json")
        rungs = {rung_id: config.model_dump(mode="json") for rung_id, config in self._effective.items()}
        return {"oracle_gate": gate, "rungs": rungs}


def _duplicates(values: list[str]) -> list[str]:
    seen: set[str] = set()
    return sorted({v for v in values if v in seen or seen.add(v)})


def _check_unique(where: str, kind: str, ids: list[str]) -> None:
    duplicated = _duplicates(ids)
    if duplicated:
        raise ValueError(f"{where}: duplicate {kind} id(s) {duplicated}: every {kind} id must be unique")


def _key_origins(reg: Registration, rung: Rung | None) -> dict[str, str]:
    """config key -> the field that sets it for this rung (the oracle gate's config when `rung` is None)."""
    origins = {key: "protocol.config" for key in reg.protocol.config}
    if rung is not None:
        origins.update({key: f"protocol.rungs.{rung.id}.config" for key in rung.config})
    return origins


def _config_path(reg: Registration, rung: Rung | None, key: str) -> str:
    """Where a key is set for this rung; a key it does not set is named where it would be set for every rung."""
    return f"{_key_origins(reg, rung).get(key, 'protocol.config')}.{key}"


def _resolve_config(reg: Registration, workload: WorkloadDeclaration, rung: Rung | None, defaults: dict[str, Any]):
    raw = reg.protocol.config if rung is None else reg.rung_config(rung.id)
    try:
        return workload.run_config.resolve(raw, workload.profiles[reg.profile], defaults)
    except ConfigError as error:
        shared = rung is not None and rung.config and error.key not in rung.config
        where = f" (in rung {rung.id}, with its own config)" if shared else ""
        raise ValueError(f"{_config_path(reg, rung, error.key)}: {error.message}{where}") from None


def _in_baseline_because(workload: WorkloadDeclaration, switch: str, raw: dict[str, Any]) -> str:
    """Why a switch is in a rung's baseline: the document put it there, or a verdict landed it into the defaults."""
    if workload.run_config.model.BASELINE_KEY in raw:
        return f"this document's {workload.run_config.model.BASELINE_KEY} puts it there"
    return f"landed by {workload.run_config.landed[switch]}"


def resolve_run_configs(reg: Registration, workload: WorkloadDeclaration, defaults: dict[str, Any] | None) -> None:
    """Every rung's effective config (and the oracle gate's): typed, every key set, each cross-key rule held. An
    item whose switch the baseline already runs is refused: the rung would compare the baseline with itself."""
    table = dict(workload.run_config.defaults(workload.profiles[reg.profile]) if defaults is None else defaults)
    reg._config_defaults = table
    if reg.items:
        gate = _resolve_config(reg, workload, None, table)
        for item in reg.items:
            if item.switch in gate.baseline():
                raise ValueError(
                    f"items.{item.id}.switch: {item.switch!r} is already in the baseline; "
                    f"{_in_baseline_because(workload, item.switch, reg.protocol.config)}. Its oracles would compare "
                    f"the baseline with itself: remove item {item.id}, or set baseline_switches without it"
                )
        reg._gate_config = gate
    for rung in reg.protocol.rungs:
        config = _resolve_config(reg, workload, rung, table)
        for item_id in rung.items:
            switch = reg.item(item_id).switch
            if switch in config.baseline():
                because = _in_baseline_because(workload, switch, reg.rung_config(rung.id))
                raise ValueError(
                    f"protocol.rungs.{rung.id}.items: {item_id} switches {switch!r}, which is already in the "
                    f"baseline; {because}. Remove {item_id} from the rung (every rung runs it), or set "
                    f"baseline_switches without it"
                )
        reg._effective[rung.id] = config


@dataclass(frozen=True)
class RetiredUse:
    path: str  # the field that uses it
    option: RetiredOption

    def note(self) -> str:
        return (
            f"{self.path}: uses retired option {self.option.label}, retired by {self.option.retired_by}; "
            f"a new freeze would be refused"
        )

    def refusal(self) -> str:
        return f"{self.path}: {self.option.label} is retired, retired by {self.option.retired_by}"


RETIRED_FIX = (
    "remove it: a retired option's code has left the workload (a document frozen with it keeps it, and re-running "
    "one means checking out the commit its freeze records)"
)


def retired_uses(reg: Registration) -> list[RetiredUse]:
    """Every use of a retired option in the document, by the field that makes it."""
    run_config = reg.declaration().run_config
    switches = {r.name: r for r in run_config.retired if r.kind == "switch"}
    uses = [RetiredUse(f"items.{i.id}.switch", switches[i.switch]) for i in reg.items if i.switch in switches]
    configs = [(None, reg.gate_config)] if reg.gate_config is not None else []
    configs += [(rung, reg.effective_config(rung.id)) for rung in reg.protocol.rungs]
    for rung, config in configs:
        for option in run_config.retired_in(config):
            key = option.name if option.kind != "switch" else run_config.model.BASELINE_KEY
            uses.append(RetiredUse(_config_path(reg, rung, key), option))
    return list(dict.fromkeys(uses))


def _compile(where: str, text: str, scope: Scope):
    try:
        return compile_expr(text, scope)
    except RuleError as error:
        raise ValueError(f"{where}: {error}") from None


def scope_names(reg: Registration, workload: WorkloadDeclaration) -> dict[str, frozenset[str]]:
    """The names an expression of this registration may use besides its reads (the Scope's other fields)."""
    rung_ids = [r.id for r in reg.protocol.rungs]
    return dict(
        rungs=frozenset(rung_ids) | ({"PASS"} if reg.protocol.kind == "until_pass" else set()),
        metrics=frozenset(workload.metrics),
        items=frozenset(i.id for i in reg.items),
        oracles=frozenset(o.id for i in reg.items for o in i.oracles),
        kills=frozenset([k.id for k in reg.kill] + rung_ids),
        row_metrics=frozenset(m.name for m in workload.metrics.values() if m.rows),
    )


def resolve_references(reg: Registration, config_defaults: dict[str, Any] | None = None) -> None:
    """Resolve every name the document uses; raise ValueError naming the field path and the allowed names.
    The run configs resolve with `config_defaults` (a frozen document's table), else the workload's current ones."""
    try:
        workload = reg.declaration()
    except UnknownWorkload as error:
        raise ValueError(f"workload: {error}") from None
    except TableError as error:  # the table's own field path, under the document's
        raise ValueError(f"{f'command.{error.path}' if error.path else 'command'}: {error.message}") from None
    if reg.profile not in workload.profiles:
        raise ValueError(
            f"profile: {reg.profile!r} is not a profile of {workload.name}; it has {sorted(workload.profiles)}"
        )
    if workload.own_process and reg.protocol.schedule == "interleaved":
        raise ValueError(
            f"protocol.schedule: workload {workload.name} runs each rung as a process of its own, from start to "
            f"finish, and rungs cannot take turns in it window by window (a process paused with SIGSTOP still holds "
            f'its device memory); set schedule = "sequential"'
        )

    item_ids = [i.id for i in reg.items]
    oracle_ids = [o.id for i in reg.items for o in i.oracles]
    rung_ids = [r.id for r in reg.protocol.rungs]
    _check_unique("items", "item", item_ids)
    _check_unique("items.*.oracles", "oracle", oracle_ids)
    _check_unique("protocol.rungs", "rung", rung_ids)
    _check_unique("rules", "rule", [r.id for r in reg.rules])
    _check_unique("kill", "kill line", [k.id for k in reg.kill])
    _check_unique("expectations", "expectation", [f"{e.n}{e.part or ''}" for e in reg.expectations])
    clash = set(item_ids) & set(oracle_ids)
    if clash:
        raise ValueError(f"items: ids {sorted(clash)} name both an item and an oracle; passed(id) must be unambiguous")
    if "PASS" in rung_ids:
        raise ValueError(
            "protocol.rungs: rung id 'PASS' is reserved: it names the rung that passed an until_pass ladder"
        )

    switches_used = [i.switch for i in reg.items]
    _check_unique("items.*.switch", "switch (one item per switch)", switches_used)
    for item in reg.items:
        if item.switch not in workload.switches:
            raise ValueError(
                f"items.{item.id}.switch: {item.switch!r} is not a switch of {workload.name}; it has "
                f"{sorted(workload.switches)}"
            )
        for oracle in item.oracles:
            where = f"items.{item.id}.oracles.{oracle.id}"
            probe = workload.probes.get(oracle.probe)
            if probe is None:
                raise ValueError(
                    f"{where}.probe: {oracle.probe!r} is not a probe of {workload.name}; it has "
                    f"{sorted(workload.probes)}"
                )
            if oracle.kind not in probe.oracle_kinds:
                raise ValueError(
                    f"{where}.kind: probe {probe.name} cannot be judged by a {oracle.kind} oracle; it supports "
                    f"{sorted(probe.oracle_kinds)}"
                )
            if oracle.kind == "tolerance":
                unknown = sorted(set(oracle.bounds) - probe.observes)
                if unknown:
                    raise ValueError(
                        f"{where}.bounds: probe {probe.name} does not observe {unknown}; it observes "
                        f"{sorted(probe.observes)}"
                    )

    for rung in reg.protocol.rungs:
        for item_id in rung.items:
            if item_id not in item_ids:
                raise ValueError(f"protocol.rungs.{rung.id}.items: {item_id!r} is not an item; items are {item_ids}")
        _check_unique(f"protocol.rungs.{rung.id}.items", "item", rung.items)
    resolve_run_configs(reg, workload, config_defaults)

    names = scope_names(reg, workload)
    metrics = names["metrics"]
    if reg.protocol.pass_rule:
        _compile("protocol.pass_rule", reg.protocol.pass_rule, Scope(kind="pass_rule", **names))

    read_names = frozenset(reg.reads)
    clash = read_names & (frozenset(rung_ids) | metrics)
    if clash:
        raise ValueError(f"reads {sorted(clash)} shadow a rung or metric name; rename them")
    dependencies: dict[str, frozenset[str]] = {}
    for name, text in reg.reads.items():
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise ValueError(f"reads.{name}: a read name must be an identifier (letters, digits, _)")
        expr = _compile(f"reads.{name}", text, Scope(kind="reads", reads=read_names, **names))
        dependencies[name] = expr.reads_used()
    _check_acyclic(dependencies)

    for rule in reg.rules:
        where = f"rules.{rule.id}"
        _compile(f"{where}.when", rule.when, Scope(kind="rules", reads=read_names, **names))
        landed: list[str] = []
        for entry in rule.land:
            item_id = entry if isinstance(entry, str) else entry.item
            if not isinstance(entry, str):
                _compile(f"{where}.land.{item_id}.if", entry.if_, Scope(kind="rules", reads=read_names, **names))
            landed.append(item_id)
        for item_id in landed + rule.park:
            if item_id not in item_ids:
                raise ValueError(f"{where}: {item_id!r} in land/park is not an item; items are {item_ids}")
        both = sorted(set(landed) & set(rule.park))
        if both:
            raise ValueError(f"{where}: {both} both land and park")

    for kill in reg.kill:
        where = f"kill.{kill.id}"
        _compile(f"{where}.when", kill.when, Scope(kind="kill", **names))
        for rung_id in kill.rungs:
            if rung_id not in rung_ids:
                raise ValueError(f"{where}.rungs: {rung_id!r} is not a rung; rungs are {rung_ids}")
        for item_id in kill.drops:
            if item_id not in item_ids:
                raise ValueError(f"{where}.drops: {item_id!r} is not an item; items are {item_ids}")
        if kill.at == "save" and reg.protocol.save_every == 0:
            raise ValueError(f'{where}.at: "save" waits for save boundaries, but protocol.save_every = 0')

    for expectation in reg.expectations:
        _compile(
            f"expectations.{expectation.n}.check",
            expectation.check,
            Scope(kind="expectations", reads=read_names, **names),
        )
    _check_adoption(reg, names, read_names)


def _check_adoption(reg: Registration, names: dict[str, frozenset[str]], read_names: frozenset[str]) -> None:
    """Each check's `when` compiles as a rule; each required rung is a rung (and metric a metric) that `when`
    reads, directly or through reads: a requirement the condition never looks at would wait for nothing."""
    _check_unique("adoption", "adoption check", [check.id for check in reg.adoption])
    scope = Scope(kind="rules", reads=read_names, **names)
    rung_ids = [r.id for r in reg.protocol.rungs]
    for check in reg.adoption:
        where = f"adoption.{check.id}"
        pending = [_compile(f"{where}.when", check.when, scope)]
        read_rungs: set[str] = set()
        seen: set[str] = set()
        while pending:
            expr = pending.pop()
            read_rungs |= expr.rungs_used()
            for name in expr.reads_used() - seen:
                seen.add(name)
                pending.append(compile_expr(reg.reads[name], replace(scope, kind="reads")))
        _check_unique(f"{where}.requires", "requirement", check.requires)
        for need in check.requires:
            rung_id, dot, metric = need.partition(".")
            if rung_id not in rung_ids:
                raise ValueError(
                    f"{where}.requires: {need!r} names no rung; rungs are {rung_ids} (RUNG or RUNG.metric)"
                )
            if dot and metric not in names["metrics"]:
                raise ValueError(
                    f"{where}.requires: {need!r}: {metric!r} is not a metric; metrics are {sorted(names['metrics'])}"
                )
            if rung_id not in read_rungs:
                raise ValueError(
                    f"{where}.requires: {need!r}: its when ({check.when!r}) does not read rung {rung_id}, directly or "
                    f"through its reads; it reads {sorted(read_rungs)}"
                )


def _check_acyclic(dependencies: dict[str, frozenset[str]]) -> None:
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = path[path.index(name) :] + [name]
            raise ValueError(f"reads form a cycle: {' -> '.join(cycle)}")
        state[name] = 1
        for dep in sorted(dependencies.get(name, ())):
            visit(dep, path + [name])
        state[name] = 2

    for name in sorted(dependencies):
        visit(name, [])


# --- amendments and external records -------------------------------------------------------------------------


class Amendment(Strict):
    reason: str = Field(min_length=1)
    add: dict[str, Any] = Field(default_factory=dict)
    set: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _not_empty(self) -> "Amendment":
        if not self.add and not self.set:
            raise ValueError("an amendment needs an [add…] or [set…] table; this one changes nothing")
        return self


RungStatus = Literal["finished", "killed", "failed", "over-ceiling"]


class RecordedRung(Strict):
    items: list[str]
    status: RungStatus
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    windows: list[dict[str, float | int | bool]] = Field(default_factory=list)
    # A per-row metric's rows: metric -> row id (a frame id) -> value.
    rows: dict[str, dict[str, float]] = Field(default_factory=dict)
    notes: str | None = None

    @model_validator(mode="after")
    def _has_data(self) -> "RecordedRung":
        if not self.metrics and not self.windows and not self.rows:
            raise ValueError("a recorded rung needs metrics = { … }, [[…windows]] or [….rows.METRIC]")
        for index, window in enumerate(self.windows):
            if "step" not in window:
                raise ValueError(f"windows[{index}] needs step = N (the window's last step)")
        return self


class ExternalRecord(Strict):
    provenance: str = Field(min_length=1)
    oracles: dict[str, dict[str, float | int | bool | str | list[str] | None]] = Field(default_factory=dict)
    rungs: dict[str, RecordedRung] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _not_empty(self) -> "ExternalRecord":
        if not self.oracles and not self.rungs:
            raise ValueError("a record needs [oracles.ID] observations or [rungs.ID] measurements")
        return self
