"""Per-window memory fields: the lifetime peak of allocated device memory (`vram_peak_gib`), the allocator's
reserved pool and the device-level figure, and, when asked (`windowed`), the window's own peak.

Left alone, `max_memory_allocated()` is never reset: a lifetime ratchet. A windowed meter reports
`vram_window_peak_gib` per window, then resets the peak; the lifetime field keeps its exact monotone meaning as
a Python-side running max, so every consumer parses it unchanged. A workload that reports these fields declares
them as its metrics.

On a CPU the device is the process: its memory is the resident set, whose peak (VmHWM) Linux keeps per process
and resets when "5" is written to /proc/self/clear_refs — the same lifetime/window pair, measured the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

GIB = 1024**3


def _cpu_peak_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def _cpu_reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


class MemoryMeter:
    def __init__(self, device: torch.device):
        self.device = device
        self.lifetime_peak = 0  # bytes, the Python-side running max used once peaks are reset
        self.reserved_peak = 0
        self.smi_peak = 0

    def window_end(self, windowed: bool) -> dict[str, float]:
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            self.smi_peak = max(self.smi_peak, total - free)  # device-level, context and other processes included
        else:
            peak = reserved = _cpu_peak_bytes()
        self.lifetime_peak = max(self.lifetime_peak, peak)
        self.reserved_peak = max(self.reserved_peak, reserved)
        fields = {
            "vram_peak_gib": round(self.lifetime_peak / GIB, 4),
            "vram_reserved_peak_gib": round(self.reserved_peak / GIB, 4),
        }
        if self.device.type == "cuda":
            fields["smi_peak_mib"] = round(self.smi_peak / 2**20, 1)
        if windowed:
            fields["vram_window_peak_gib"] = round(peak / GIB, 4)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            else:
                _cpu_reset_peak()
        return fields
