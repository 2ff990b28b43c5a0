"""What a workload declares, without importing torch: the names a registration may use.

Validation resolves every switch, probe, metric, profile and config key of a registration against this
declaration, so a document that names something the workload cannot do is refused before it is frozen. Each rung's
run config resolves into the workload's typed `RunConfig` (every key set, every cross-key rule held) against the
profile and a defaults table: the workload's current one for a new document, the frozen one for a frozen document.
The implementation behind a declaration (engine/…) is imported only to run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Mapping, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo
from pydantic.fields import FieldInfo

SummaryKind = Literal["median", "max", "last", "sum"]


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    summary: SummaryKind  # how a rung's windows reduce to one value: median for times and rates, max for peaks
    description: str
    eval_only: bool = False  # present only on evaluation windows (probe metrics)
    relative_ok: bool = True  # whether a bootstrap interval makes sense for reads over it
    # Whether the value depends on which samples shared each step (a loss, an evaluation of the trained weights):
    # two rungs compare on it only if they trained on the same steps (prereg/pairing.py). Speed and memory do not.
    paired: bool = False
    # Recorded row by row (one value per frame id, `prereg record`'s [rungs.R.rows.METRIC]) rather than per window:
    # row functions pair two rungs' rows by id (prereg/rules/rows.py); a rung has no summary of it.
    rows: bool = False
    # How a person sees it. The CLI and the report show every rung's WINDOW_FIELDS; a metric marked `display` is
    # shown beside them, as a column headed `label` (units included: people read the table, not the catalogue),
    # its values written with `format` (a format spec: ",.0f" for a count in the hundred thousands, not 1.435e+05).
    display: bool = False
    label: str = ""
    format: str = ".4g"
    # The report's per-window plot it is drawn on (a lowercase name, also its file's); the metrics that name the
    # same plot share it, and its unit.
    plot: str = ""

    def __post_init__(self) -> None:
        if self.plot and not re.fullmatch(r"[a-z][a-z0-9_-]*", self.plot):
            raise ValueError(f"metric {self.name}: plot = {self.plot!r} must be a lowercase name such as 'memory'")
        if self.display and not self.label:
            raise ValueError(f"metric {self.name}: display = True needs a label (the column heading it is shown under)")
        try:
            format(1.5, self.format)
        except ValueError:
            raise ValueError(
                f"metric {self.name}: format = {self.format!r} is not a format spec for numbers (e.g. '.4g', ',.0f')"
            ) from None

    @property
    def heading(self) -> str:
        """What a column or a legend calls it."""
        return self.label or self.name

    def written(self, value: Any) -> str:
        """A value of it as a person reads it: `format` for numbers, yes/no for booleans, "—" when absent."""
        if value is None:
            return "—"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, (int, float)):
            return format(value, self.format)
        return str(value)


# The engine's own metrics: what every rung process reports whatever its workload (engine/rung.py writes them on
# the run-end and on every window). Merged into every workload's catalogue, so reads, pass rules and kill lines
# name them for any workload; a workload does not declare them again.
ENGINE_METRICS: dict[str, Metric] = {
    m.name: m
    for m in [
        Metric("rc", "code", "last", "the rung process's exit status", relative_ok=False),
        Metric("steps", "steps", "last", "steps completed", relative_ok=False),
        Metric("load_s", "s", "last", "model load time of the rung process"),
        Metric("gpu_s", "GPU-s", "last", "device-seconds held by the rung: wall time from start to end x devices"),
        Metric("world_size", "ranks", "last", "processes in the rung", relative_ok=False),
        Metric("finite", "bool", "last", "every loss and gradient in the window was finite", relative_ok=False),
    ]
}

# The fields every window carries, for every workload (engine/workload.py, WorkloadRunner.train_window): the CLI
# and the report show these for every rung, then what the workload's declaration marks `display`.
WINDOW_FIELDS = ("steps", "s_per_step", "loss", "finite")


@dataclass(frozen=True)
class Probe:
    name: str
    description: str
    oracle_kinds: frozenset[str]  # the oracle kinds that can judge what this probe measures
    observes: frozenset[str] = frozenset()  # for tolerance oracles: the bound names it reports


@dataclass(frozen=True)
class Profile:
    name: str
    device: Literal["cpu", "cuda"]
    gpus: int  # 0 for CPU profiles
    geometry: str
    description: str
    # Processes of a rung; 0: one per GPU, one on the CPU. More than one: the engine starts them under torchrun.
    # 1 on several GPUs: one engine process holds them all and its runner starts the ranks (the command workload).
    processes: int = 0

    def __post_init__(self) -> None:
        if self.processes < 0:
            raise ValueError(f"profile {self.name}: processes = {self.processes} must be >= 0 (0: one per GPU)")
        if self.device == "cuda" and self.processes not in (0, 1, self.gpus):
            # One engine process per GPU: each rank owns one device (nccl), so the two counts cannot differ.
            raise ValueError(
                f"profile {self.name}: processes = {self.processes} on {self.gpus} GPUs; allowed: 0, 1 or {self.gpus}"
            )

    @property
    def world_size(self) -> int:
        """The rung's processes (ranks); the oracle gate is always one process."""
        return self.processes or max(self.gpus, 1)


# --- the run config ------------------------------------------------------------------------------------------

PROFILE_CONTEXT = "profile"  # the validation context's key that carries the Profile a run config is resolved against


class RunConfig(BaseModel):
    """A workload's run config: one typed, frozen object that owns every key (its type, its allowed values, its
    description) and every cross-key rule (model validators). It is built against a profile only
    (`RunConfigDeclaration.resolve` and `.load`), so the rules that depend on where it runs (CPU or CUDA, how many
    processes) hold at construction too; a validator reads the profile with `profile_of(info)`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    # The key that lists the switches on in every rung (a rung's items add theirs); None: the workload has none.
    BASELINE_KEY: ClassVar[str | None] = None

    @classmethod
    def fill(cls, raw: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
        """Every key's value before validation: the document's where it set one, else the defaults table's. A
        workload whose keys apply only with another (a packing option without packing) leaves those unset here."""
        return {**defaults, **raw}

    def baseline(self) -> tuple[str, ...]:
        """The switches on in every rung run with this config; a rung's items add theirs."""
        return tuple(getattr(self, self.BASELINE_KEY)) if self.BASELINE_KEY else ()


def profile_of(info: ValidationInfo) -> Profile:
    """The profile a run config is being validated against (a validator's `info`)."""
    profile = (info.context or {}).get(PROFILE_CONTEXT)
    if not isinstance(profile, Profile):
        # Not a user error: every construction goes through RunConfigDeclaration, which passes the profile.
        raise TypeError("a run config is built against a profile: use RunConfigDeclaration.resolve or .load")
    return profile


@dataclass(frozen=True)
class RegroupsSamples:
    """Field metadata of a run-config flag that puts other samples together in a step (bucketing): rungs that differ
    in it train on other steps, so their paired metrics do not compare (prereg/pairing.py)."""


REGROUPS_SAMPLES = RegroupsSamples()


@dataclass(frozen=True)
class ChangesNumerics:
    """Field metadata of a run-config key that computes the same step in other arithmetic (a kernel, a precision,
    packing, the grouping of a reduction): compared rungs that differ in it need a frozen numeric check of that
    difference (prereg/numerics_guard.py)."""


CHANGES_NUMERICS = ChangesNumerics()


class ConfigConflict(ValueError):
    """A cross-key rule refused a run config. `keys` are the keys it involves, the one to change first first; the
    message says what is wrong, what is allowed, and the fix."""

    def __init__(self, keys: tuple[str, ...], message: str):
        self.keys = keys
        super().__init__(message)


class ConfigError(ValueError):
    """A raw run config that does not resolve: the key to blame (one the document set, where one is involved) and
    what is wrong with it."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


@dataclass(frozen=True)
class RetiredOption:
    """An option that a verdict parked or dropped, or that nothing reads. Documents frozen with it still validate
    and audit; a new freeze (or an amendment) that introduces it is refused, naming `retired_by`."""

    kind: Literal["key", "value", "switch"]  # a whole config key, one value of a key, or a switch
    name: str  # the config key, or the switch
    # What retired it, read after "retired by": a verdict ("registration-id (outcome)"), or "nothing reading it".
    retired_by: str
    value: Any = None  # kind "value": the retired value of key `name`

    @property
    def label(self) -> str:
        if self.kind == "value":
            return f"{self.name} = {self.value!r}"
        return f"{'switch' if self.kind == 'switch' else 'config key'} {self.name}"

    def used_by(self, config: RunConfig) -> bool:
        if self.kind == "switch":
            return self.name in config.baseline()
        value = getattr(config, self.name)
        # A retired key is unset (None) in every defaults table, so a value means the document set it.
        return value is not None if self.kind == "key" else value == self.value


def _literal_values(annotation: Any) -> tuple[Any, ...]:
    """The values a Literal annotation allows (inside `X | None` too); () for any other type."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return tuple(v for arg in get_args(annotation) for v in _literal_values(arg))


@dataclass(frozen=True)
class RunConfigDeclaration:
    """What a workload declares about its run config: the typed model, the defaults a new freeze resolves with (per
    profile; the freeze records them), the defaults of documents frozen before freezes recorded any, the options
    its verdicts retired, and the switches its verdicts landed into the baseline."""

    model: type[RunConfig]
    defaults: Callable[[Profile], dict[str, Any]]
    # A document whose freeze recorded no defaults table resolves with this one: the values the code used for the
    # keys a document did not set before freezes recorded their defaults. A key added later holds here the value
    # that means the code as it ran before the key existed: recorded tables that lack the key resolve with it.
    unrecorded_defaults: Mapping[str, Any]
    retired: tuple[RetiredOption, ...] = ()
    landed: Mapping[str, str] = field(default_factory=dict)  # baseline switch -> the verdict that landed it

    def retired_keys(self) -> frozenset[str]:
        return frozenset(r.name for r in self.retired if r.kind == "key")

    def keys(self) -> dict[str, FieldInfo]:
        """The keys a new document may set (retired ones left out), with their descriptions and metadata."""
        return {k: f for k, f in self.model.model_fields.items() if k not in self.retired_keys()}

    def allowed_values(self, key: str) -> tuple[Any, ...]:
        """The values a closed-set key allows a new document (retired ones left out); () for an open type."""
        retired = {r.value for r in self.retired if r.kind == "value" and r.name == key}
        return tuple(v for v in _literal_values(self.model.model_fields[key].annotation) if v not in retired)

    def regrouping_keys(self) -> list[str]:
        return [k for k, f in self.model.model_fields.items() if REGROUPS_SAMPLES in f.metadata]

    def numerics_keys(self) -> list[str]:
        return [k for k, f in self.model.model_fields.items() if CHANGES_NUMERICS in f.metadata]

    def resolve(self, raw: Mapping[str, Any], profile: Profile, defaults: Mapping[str, Any]) -> RunConfig:
        """A rung's raw config (protocol.config merged with the rung's) against a profile and a defaults table:
        every key set, validated, frozen. Raises ConfigError naming the key to blame."""
        # A table recorded before a key existed lacks it: the key resolves as the code ran before it existed, which
        # is what unrecorded_defaults holds for a key added after freezes began recording their tables.
        missing = set(self.model.model_fields) - set(defaults)
        defaults = {**{k: self.unrecorded_defaults[k] for k in missing}, **defaults}
        try:
            return self.model.model_validate(self.model.fill(raw, defaults), context={PROFILE_CONTEXT: profile})
        except ValidationError as error:
            raise self._explain(error.errors()[0], raw) from None

    def load(self, values: Mapping[str, Any], profile: Profile) -> RunConfig:
        """An effective config as dumped (every key set), validated again against its profile."""
        return self.model.model_validate(dict(values), context={PROFILE_CONTEXT: profile})

    def retired_in(self, config: RunConfig) -> list[RetiredOption]:
        return [r for r in self.retired if r.used_by(config)]

    def _explain(self, error: Any, raw: Mapping[str, Any]) -> ConfigError:
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigConflict):
            blamed = next((k for k in cause.keys if k in raw), cause.keys[0])
            return ConfigError(blamed, str(cause))
        key = str(error["loc"][0]) if error["loc"] else "config"
        if error["type"] == "extra_forbidden":
            return ConfigError(key, f"unknown config key {key!r}; allowed: {sorted(self.keys())}")
        value = raw.get(key, error.get("input"))
        allowed = self.allowed_values(key) if key in self.model.model_fields else ()
        if error["type"] == "literal_error" and allowed:
            return ConfigError(key, f"{key} = {value!r}; allowed: {list(allowed)}")
        message = str(cause) if cause is not None else error["msg"][:1].lower() + error["msg"][1:]
        return ConfigError(key, f"{key} = {value!r}: {message}")


@dataclass(frozen=True)
class WorkloadDeclaration:
    name: str
    switches: dict[str, str]  # name -> what it changes
    probes: dict[str, Probe]
    metrics: dict[str, Metric]
    profiles: dict[str, Profile]
    run_config: RunConfigDeclaration
    runner: str  # "module:callable" of the implementation, imported only to run
    notes: dict[str, str] = field(default_factory=dict)
    # Functions of the workload's own code whose allocations are activations although no module's `forward` is
    # on their stack (a functional forward, the loss, the step that casts the logits): the memory forensics
    # (engine/memory/forensics.py) reads the workload's snapshots with these beside its generic frame rules.
    activation_frames: frozenset[str] = frozenset()

    # Files the document's behaviour rests on beyond the workload's own code, relative to the registration file's
    # folder: hashed at freeze, and a run refused when one changed (a command workload's scripts).
    sources: tuple[str, ...] = ()
    # Whether its runner does a rung's work in a process of its own (a command's script) rather than in the rung
    # process: such a rung runs from start to finish (no interleaved schedule), and the engine's own torch and
    # devices describe nothing that process ran.
    own_process: bool = False

    def __post_init__(self) -> None:
        redeclared = sorted(set(self.metrics) & set(ENGINE_METRICS))
        if redeclared:
            raise ValueError(
                f"workload {self.name}: metrics {redeclared} are the engine's own, declared for every workload "
                f"(prereg.workload.ENGINE_METRICS); remove them from the workload's metrics"
            )
        # The catalogue that validation and verdicts read: the workload's metrics, then the engine's.
        object.__setattr__(self, "metrics", {**self.metrics, **ENGINE_METRICS})
        units: dict[str, str] = {}
        for metric in self.metrics.values():
            if metric.plot and units.setdefault(metric.plot, metric.unit) != metric.unit:
                raise ValueError(
                    f"workload {self.name}: metric {metric.name} ({metric.unit}) is drawn on plot {metric.plot!r}, "
                    f"whose metrics are in {units[metric.plot]}; one plot has one unit: name another plot"
                )
        # The tables are code: a default that breaks a cross-key rule, or a retired option in a table, is a bug of
        # the workload, found when it is loaded rather than when a document happens to rely on it.
        config = self.run_config
        missing = sorted(set(config.model.model_fields) - set(config.unrecorded_defaults))
        assert not missing, f"{self.name}: the unrecorded defaults table has no value for {missing}"
        for profile in self.profiles.values():
            table = config.defaults(profile)
            resolved = config.resolve({}, profile, table)
            assert not config.retired_in(resolved), (self.name, profile.name, config.retired_in(resolved))
            # A default baseline names the verdict behind each of its switches (the refusal of an item quotes it).
            assert set(resolved.baseline()) <= set(config.landed), (self.name, profile.name, resolved.baseline())
        for table in [config.unrecorded_defaults, *(config.defaults(p) for p in self.profiles.values())]:
            assert all(table[r.name] is None for r in config.retired if r.kind == "key"), "retired keys default to None"
        unknown = sorted(set(config.landed) - set(self.switches))
        assert not unknown, f"{self.name}: landed switches {unknown} are not switches"
