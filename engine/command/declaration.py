"""The command workload's declaration, built from a registration's `[command]` table (the entry point
`command = "engine.command.declaration:declare"`), so what a document may name is frozen with it.

    [command]
    run = "python train.py"               # the rung's command: split like a shell line, no shell, run in cwd
    probe = "python probe.py"             # what oracles run (needed when probes are declared)
    cwd = "."                             # relative to the registration file's folder
    sources = ["train.py", "probe.py"]    # relative to cwd; hashed at freeze, a changed one refuses the run
    switches = ["fused_adamw"]            # the names items may switch on
    config = ["lr", "batch"]              # the keys protocol.config and rungs may set
    numerics_keys = []                    # of config: keys that change numerics (kernels, precision); default none
    metrics = ["s_per_step", "loss"]      # what the script's windows report
    paired_metrics = ["loss"]             # of metrics: those that rungs on the same samples compare pairwise
    probes = { one_step = ["loss_abs"] }  # probe -> the observations it reports

Profiles: `local` (this machine's CPU; no GPU is visible to the script), `cuda` (one GPU), `cuda-xN` (N GPUs of
one host: the script under torchrun, N processes). A script's metric is summarized over a rung's kept windows by
its median. Importing this module never imports torch.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass
from typing import Annotated, Any, Mapping

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from oracles.judge import JUDGES, OBSERVED
from prereg.registry import TableError
from prereg.workload import (
    CHANGES_NUMERICS,
    ENGINE_METRICS,
    Metric,
    Probe,
    Profile,
    RunConfig,
    RunConfigDeclaration,
    WorkloadDeclaration,
)

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Keys the engine writes into every window entry beside the script's metrics.
ENGINE_WINDOW_KEYS = frozenset({"step", "elapsed_s", "ledger_s", "read_s"})

# The largest single hosts hold 16 GPUs (DGX-2, HGX-2); torchrun --standalone spans one host.
MAX_GPUS_PER_HOST = 16

PROFILES = {
    "local": Profile("local", "cpu", 0, "script", "this machine's CPU: no GPU is visible to the script"),
    "cuda": Profile("cuda", "cuda", 1, "script", "one GPU of this machine"),
    **{
        f"cuda-x{n}": Profile(
            f"cuda-x{n}",
            "cuda",
            n,
            "script",
            f"{n} GPUs of this host: the script under torchrun, {n} ranks",
            processes=1,
        )
        for n in range(2, MAX_GPUS_PER_HOST + 1)
    },
}


def command_line(text: str) -> list[str]:
    """A command as its argument vector, split like a shell line (quotes, escapes; no expansion, no shell)."""
    try:
        words = shlex.split(text)
    except ValueError as error:
        raise ValueError(f"{text!r} does not split like a shell line ({error}); check its quotes") from None
    if not words:
        raise ValueError('an empty command; e.g. "python train.py"')
    return words


def _names(values: list[str], what: str) -> list[str]:
    for value in values:
        if not NAME.match(value):
            raise ValueError(f"{value!r} is not a name: a {what} is letters, digits and _, not starting with a digit")
    duplicated = sorted({v for v in values if values.count(v) > 1})
    if duplicated:
        raise ValueError(f"{duplicated} appear more than once")
    return values


def _relative(path: str, what: str) -> str:
    if not path or posixpath.isabs(path) or "\\" in path:
        raise ValueError(
            f"{what} {path!r} must be a relative path with / separators: the document must run wherever it is "
            f"checked out"
        )
    return path


class CommandTable(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str
    probe: str | None = None
    cwd: str = "."
    sources: list[str] = Field(default_factory=list)
    switches: list[str] = Field(default_factory=list)
    config: list[str] = Field(default_factory=list)
    # Keys of `config` that compute the same thing in other arithmetic: compared rungs that differ in one need a
    # frozen numeric check (prereg/numerics_guard.py). The script's keys are the user's: none unless listed.
    numerics_keys: list[str] = Field(default_factory=list)
    metrics: list[str] = Field(min_length=1)
    # Metrics whose values rungs on the same samples compare pairwise (a loss): a rule's bound on their
    # difference is a numeric check of the rungs' numerics difference.
    paired_metrics: list[str] = Field(default_factory=list)
    probes: dict[str, list[str]] = Field(default_factory=dict)

    @field_validator("run", "probe")
    @classmethod
    def _splits(cls, text: str | None) -> str | None:
        if text is not None:
            command_line(text)
        return text

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, path: str) -> str:
        return _relative(path, "cwd")

    @field_validator("sources")
    @classmethod
    def _sources(cls, paths: list[str]) -> list[str]:
        for path in paths:
            _relative(path, "source")
        duplicated = sorted({p for p in paths if paths.count(p) > 1})
        if duplicated:
            raise ValueError(f"{duplicated} appear more than once")
        return paths

    @field_validator("switches")
    @classmethod
    def _switches(cls, values: list[str]) -> list[str]:
        return _names(values, "switch")

    @field_validator("config")
    @classmethod
    def _config(cls, values: list[str]) -> list[str]:
        return _names(values, "config key")

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, values: list[str]) -> list[str]:
        _names(values, "metric")
        for value in values:
            if value == "steps":
                raise ValueError("'steps' is every window's own key (the cumulative step count, required): remove it")
            if value in ENGINE_METRICS or value in ENGINE_WINDOW_KEYS:
                raise ValueError(f"{value!r} is measured by the engine, not reported by the script: remove it")
        return values

    @field_validator("probes")
    @classmethod
    def _probes(cls, probes: dict[str, list[str]]) -> dict[str, list[str]]:
        _names(list(probes), "probe")
        for name, observations in probes.items():
            try:
                _names(observations, "observation")
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
            if "error" in observations:
                raise ValueError(f'{name}: "error" is how a probe says it could not run, not an observation')
        return probes

    @model_validator(mode="after")
    def _subsets(self) -> "CommandTable":
        for field, values, within in (
            ("numerics_keys", self.numerics_keys, self.config),
            ("paired_metrics", self.paired_metrics, self.metrics),
        ):
            unknown = sorted(set(values) - set(within))
            if unknown:
                raise ValueError(f"{field} {unknown} are not in {'config' if within is self.config else 'metrics'}")
        return self

    def source_paths(self) -> tuple[str, ...]:
        """The sources relative to the registration file's folder."""
        return tuple(posixpath.normpath(posixpath.join(self.cwd, source)) for source in self.sources)


@dataclass(frozen=True)
class CommandDeclaration(WorkloadDeclaration):
    command: CommandTable | None = None  # the table it was built from: what the runner runs


def _oracle_kinds(observations: frozenset[str]) -> frozenset[str]:
    """The oracle kinds that can judge what a probe reports: tolerance (its bounds are checked against the
    observations), and every kind whose required observations the probe declares."""
    return frozenset({"tolerance"} | {kind for kind, (required, _) in OBSERVED.items() if required <= observations})


def _table_error(error: ValidationError) -> TableError:
    first = error.errors()[0]
    location = [str(part) for part in first["loc"]]
    if first["type"] == "extra_forbidden":
        return TableError(
            ".".join(location),
            f"unknown key {location[-1]!r} (unknown keys are errors); "
            f"[command] takes {sorted(CommandTable.model_fields)}",
        )
    if first["type"] == "missing":
        return TableError(".".join(location), "required key is missing")
    field = location[0] if location else ""
    return TableError(field, first["msg"].removeprefix("Value error, "))


def declare(table: Mapping[str, Any]) -> CommandDeclaration:
    """The declaration a `[command]` table makes; TableError names the field that is wrong."""
    try:
        command = CommandTable.model_validate(dict(table))
    except ValidationError as error:
        raise _table_error(error) from None
    if command.probes and command.probe is None:
        raise TableError(
            "probe", f'probes {sorted(command.probes)} are declared: add probe = "…", the command that runs them'
        )
    if command.probe is not None and not command.probes:
        raise TableError(
            "probe", "a probe command, and no probes declared: declare probes = { NAME = [...] } or remove it"
        )
    assert set(JUDGES) >= set(OBSERVED)
    metrics = {
        name: Metric(
            name,
            "",
            "median",
            "reported by the script's windows (command.metrics)",
            paired=name in command.paired_metrics,
        )
        for name in command.metrics
    }
    return CommandDeclaration(
        name="command",
        switches={name: "a switch of the script (command.switches)" for name in command.switches},
        probes={
            name: Probe(
                name,
                f"`{command.probe}` with PREREG_PROBE={name} (command.probes)",
                _oracle_kinds(frozenset(observes)),
                frozenset(observes),
            )
            for name, observes in command.probes.items()
        },
        metrics=metrics,
        profiles=PROFILES,
        run_config=command_run_config(command.config, command.numerics_keys),
        runner="engine.command.process:CommandRunner",
        sources=command.source_paths(),
        own_process=True,
        command=command,
    )


def command_run_config(
    keys: tuple[str, ...] | list[str], numerics: tuple[str, ...] | list[str] = ()
) -> RunConfigDeclaration:
    """The run config of a command: the keys the table names, each any JSON value, unset (None) unless a document
    sets it; the script sees the set ones in PREREG_CONFIG. It has no defaults of its own to change, so every
    document resolves the same way whenever it was frozen."""
    description = "a key of the script's config (command.config)"
    fields = {
        name: (
            Annotated[JsonValue | None, CHANGES_NUMERICS] if name in numerics else JsonValue | None,
            Field(default=None, description=description),
        )
        for name in keys
    }
    model = create_model("CommandRunConfig", __base__=RunConfig, **fields)
    unset = {name: None for name in keys}
    return RunConfigDeclaration(model=model, defaults=lambda profile: dict(unset), unrecorded_defaults=unset)


def script_config(config: RunConfig) -> dict[str, Any]:
    """What PREREG_CONFIG carries: the keys a document set."""
    return {key: value for key, value in config.model_dump(mode="json").items() if value is not None}
