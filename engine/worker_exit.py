"""How a gate or rung process ends once its work is recorded.

Everything such a process leaves behind is in the ledger (closed before this is called) and in the events it
printed. What remains after its main function returns is the interpreter's teardown of torch and of the libraries
behind it: 1.5 s or more of every process on the CPU, measured, for nothing anyone reads. So the process flushes its
streams and leaves at once, as multiprocessing's child processes do.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def end_worker(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
