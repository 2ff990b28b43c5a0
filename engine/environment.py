"""What every run records about where it ran (docs/design.md: git, Python, torch, CUDA, cuDNN, GPU, driver, host)."""

from __future__ import annotations

import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

from prereg.provenance import git_state, tool_version


def _driver_version() -> str | None:
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.decode().splitlines()[0].strip() if result.returncode == 0 and result.stdout else None


def _smi_gpus() -> list[str]:
    """The GPU names nvidia-smi lists (none without a driver)."""
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if result.returncode != 0:
        return []
    return [line.strip() for line in result.stdout.decode().splitlines() if line.strip()]


def _torch_facts() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "driver": _driver_version() if cuda else None,
        "threads": torch.get_num_threads(),
    }


def _driver_facts() -> dict[str, Any]:
    gpus = _smi_gpus()
    return {
        "torch": None,
        "cuda": None,
        "cudnn": None,
        "gpu": gpus[0] if gpus else None,
        "gpu_count": len(gpus),
        "driver": _driver_version() if gpus else None,
        "threads": None,
    }


def run_environment(profile: str, seed: int, *, engine_torch: bool = True) -> dict[str, Any]:
    """Where a rung ran. `engine_torch`: the rung trains in this process, so this process's torch and devices are
    the run's; a rung whose work runs in a process of its own (a command's script, in its own interpreter) records
    the machine's GPUs as the driver lists them, and no torch of the engine's."""
    return {
        "git": git_state(Path(__file__).resolve().parent.parent),
        "tool": tool_version(),
        "python": platform.python_version(),
        **(_torch_facts() if engine_torch else _driver_facts()),
        "host": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(),
        "profile": profile,
        "seed": seed,
    }
