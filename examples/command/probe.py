"""The oracles' probe: baseline and the item's switch from the same weights over the same batches, and how far
apart they end. It keeps the contract by hand (environment in, one JSON line out), without prereg."""

from __future__ import annotations

import json
import os

from mlp import Trainer

PARITY_STEPS = 20  # long enough for a numerics change to show in the loss, short enough to cost a second

probe, switch = os.environ["PREREG_PROBE"], os.environ["PREREG_SWITCH"]
seed, config = int(os.environ["PREREG_SEED"]), json.loads(os.environ["PREREG_CONFIG"])
if probe != "parity":
    print(json.dumps({"error": f"no probe {probe!r} here; this script measures parity"}))
    raise SystemExit(0)

arms = {
    name: Trainer(seed, config["hidden"], config["batch"], config["lr"], switches)
    for name, switches in (("baseline", frozenset()), ("item", frozenset({switch})))
}
loss_abs = grad_norm_rel = 0.0
for _ in range(PARITY_STEPS):
    (loss_a, grad_a), (loss_b, grad_b) = arms["baseline"].step(), arms["item"].step()
    loss_abs = max(loss_abs, abs(loss_a - loss_b))
    grad_norm_rel = max(grad_norm_rel, abs(grad_a - grad_b) / grad_a)
print(json.dumps({"loss_abs": loss_abs, "grad_norm_rel": grad_norm_rel}))
