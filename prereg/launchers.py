"""The lab's launchers: `prereg.toml`, found in the current folder or the nearest folder above it (as pyproject.toml
is found), names where rungs may run. A registration picks one with `launcher = "NAME"`; absent, this machine.

```toml
[launchers.cluster]
kind = "slurm"            # local | torchrun | slurm
partition = "gpu"
nodes = 1
gpus_per_node = 8
time = "04:00:00"         # sbatch --time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS
account = "lab"           # optional
qos = "normal"            # optional
sbatch = { constraint = "h200", exclusive = true }   # more sbatch options: a table, or a list of "--opt=value"
```

The registration names a launcher and is frozen with the name; what the name means is the lab's (a partition
changes, a time limit grows) and is recorded, resolved, on every run that used it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from prereg.documents import read_toml, validate
from prereg.errors import InvalidInput

FILE_NAME = "prereg.toml"
FIX = f"correct {FILE_NAME} ([launchers.NAME] with kind = local | torchrun | slurm); nothing was written"
# sbatch --time's forms: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]].
SLURM_TIME = re.compile(r"^(\d+(:\d{2}){0,2}|\d+-\d+(:\d{2}){0,2})$")
SBATCH_OPTION = re.compile(r"^[a-z][a-z0-9-]*$")
# What the launcher sets itself, from its own keys and the rung's needs: an `sbatch` option may not say otherwise.
OWNED_OPTIONS = frozenset(
    {"partition", "nodes", "gpus-per-node", "time", "account", "qos", "ntasks-per-node", "output", "error"}
)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LocalLauncher(Strict):
    """Processes on this machine (the default): one rung process, or torchrun's ranks when the profile asks."""

    kind: Literal["local"]


class TorchrunLauncher(Strict):
    """N processes on this host under torchrun, as the profile asks: what `local` does for a profile of N ranks."""

    kind: Literal["torchrun"]


class SlurmLauncher(Strict):
    """One Slurm job per rung (and one for the oracle gate), submitted through submitit."""

    kind: Literal["slurm"]
    partition: str = Field(min_length=1)
    nodes: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=0, ge=0, description="0 for CPU profiles")
    time: str = Field(default="01:00:00", description="the job's time limit, as sbatch --time takes it")
    account: str | None = None
    qos: str | None = None
    sbatch: dict[str, str | int | bool] | list[str] = Field(default_factory=dict)

    @field_validator("time")
    @classmethod
    def _time(cls, value: str) -> str:
        if not SLURM_TIME.match(value):
            raise ValueError(
                f"time = {value!r} is not a Slurm time limit; write MM, HH:MM:SS or D-HH:MM:SS (for example '04:00:00')"
            )
        return value

    @field_validator("sbatch")
    @classmethod
    def _sbatch(cls, value: dict[str, Any] | list[str]) -> dict[str, Any] | list[str]:
        names = list(value) if isinstance(value, dict) else [option_name(word) for word in value]
        for name in names:
            if not SBATCH_OPTION.match(name):
                raise ValueError(
                    f"sbatch option {name!r} is not an option name; write it as sbatch spells it without the dashes"
                    " (a table: { constraint = 'h200' }) or as '--constraint=h200' in a list"
                )
            if name in OWNED_OPTIONS:
                raise ValueError(
                    f"sbatch option {name!r} is the launcher's own; set it with the launcher's key"
                    f" ({name.replace('-', '_')} = …) or leave it to the launcher"
                )
        return value

    def sbatch_options(self) -> dict[str, str | int | bool]:
        """The extra options as one table: option name (without dashes) -> value (True: a flag)."""
        if isinstance(self.sbatch, dict):
            return dict(self.sbatch)
        options: dict[str, str | int | bool] = {}
        for word in self.sbatch:
            name, equals, value = word.removeprefix("--").partition("=")
            options[name] = value if equals else True
        return options


def option_name(word: str) -> str:
    if not word.startswith("--"):
        return word  # refused by the caller's pattern check: it names the word
    return word.removeprefix("--").partition("=")[0]


Launcher = Annotated[LocalLauncher | TorchrunLauncher | SlurmLauncher, Field(discriminator="kind")]


class LaunchersFile(Strict):
    launchers: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")], Launcher] = Field(
        default_factory=dict
    )


LOCAL = LocalLauncher(kind="local")


def find_file(start: Path) -> Path | None:
    """prereg.toml in `start` or the nearest folder above it."""
    folder = start.resolve()
    for candidate in (folder, *folder.parents):
        path = candidate / FILE_NAME
        if path.is_file():
            return path
    return None


def load_launchers(path: Path) -> LaunchersFile:
    data, raw = read_toml(path)
    return validate(LaunchersFile, data, where=str(path), source=raw, fix=FIX)


def resolve_launcher(name: str | None, start: Path) -> tuple[str, LocalLauncher | TorchrunLauncher | SlurmLauncher]:
    """(name, launcher) for a registration's `launcher`: absent, this machine; a name, from the nearest prereg.toml."""
    if name is None:
        return "local", LOCAL
    path = find_file(start)
    if path is None:
        raise InvalidInput(
            f"the registration's launcher = {name!r} needs a {FILE_NAME}, and there is none in {start.resolve()} or"
            " any folder above it",
            where="launcher",
            fix=f"write {FILE_NAME} with [launchers.{name}] (kind = local | torchrun | slurm), or run from its folder",
        )
    launchers = load_launchers(path).launchers
    if name not in launchers:
        known = ", ".join(sorted(launchers)) or "none"
        raise InvalidInput(
            f"launcher {name!r} is not in {path} (it names: {known})",
            where="launcher",
            fix=f"add [launchers.{name}] to {path}, or name one of its launchers",
        )
    return name, launchers[name]


__all__ = [
    "FILE_NAME",
    "LOCAL",
    "LaunchersFile",
    "LocalLauncher",
    "SlurmLauncher",
    "TorchrunLauncher",
    "find_file",
    "load_launchers",
    "resolve_launcher",
]
