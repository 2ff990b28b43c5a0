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


def run_environment(profile: str, seed: int) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "git": git_state(Path(__file__).resolve().parent.parent),
        "tool": tool_version(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "driver": _driver_version() if cuda else None,
        "host": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "profile": profile,
        "seed": seed,
    }
