"""The rung's script: train the MLP for PREREG_STEPS steps with the rung's switches, and append a window every
PREREG_LOG_EVERY steps through prereg.script (the helper; the contract needs nothing from prereg)."""

from __future__ import annotations

import statistics
import time

from mlp import Trainer

from prereg import script

config = script.config()
trainer = Trainer(script.seed(), config["hidden"], config["batch"], config["lr"], script.switches())
times: list[float] = []
losses: list[float] = []
for step in range(1, script.steps() + 1):
    start = time.perf_counter()
    loss, _ = trainer.step()
    times.append(time.perf_counter() - start)
    losses.append(loss)
    if step % script.log_every() == 0 or step == script.steps():
        seconds = statistics.median(times)
        script.window(
            steps=step, s_per_step=seconds, loss=statistics.fmean(losses), samples_per_s=config["batch"] / seconds
        )
        times, losses = [], []
    if script.should_stop():
        break
