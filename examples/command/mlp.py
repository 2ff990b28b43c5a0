"""A small real model for the example: a two-hidden-layer MLP in numpy, trained by SGD with momentum to fit a
smooth function of 16 inputs. The switches change how its training step computes, not what it computes:

- `blas_matmul`: the matrix products through BLAS (`a @ b`) instead of numpy's own einsum loops. The same
  products, in another summation order: equal to float32 rounding, and several times faster.
- `fp16_activations`: the hidden activations stored in float16, halving their memory. A numerics change: the
  loss moves by far more than float32 rounding, which the parity oracle catches.
"""

from __future__ import annotations

import os

# One BLAS thread: both arms measured alike on a shared machine, and the same summation order on every run.
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import numpy as np  # noqa: E402

INPUTS = 16
SAMPLES = 4096


def dataset(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets: a smooth function with structure an MLP learns (its loss falls steadily)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((SAMPLES, INPUTS)).astype(np.float32)
    a, b = rng.standard_normal(INPUTS), rng.standard_normal(INPUTS)
    y = np.sin(x @ a / 2) + 0.25 * (x @ b / 4) ** 2
    return x, y[:, None].astype(np.float32)


def init(seed: int, hidden: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    shapes = {"w1": (INPUTS, hidden), "w2": (hidden, hidden), "w3": (hidden, 1)}
    params = {k: (rng.standard_normal(s) * np.sqrt(2.0 / s[0])).astype(np.float32) for k, s in shapes.items()}
    params.update(b1=np.zeros(hidden, np.float32), b2=np.zeros(hidden, np.float32), b3=np.zeros(1, np.float32))
    return params


def matmul(a: np.ndarray, b: np.ndarray, blas: bool) -> np.ndarray:
    return a @ b if blas else np.einsum("ij,jk->ik", a, b)


def loss_and_grads(
    params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, switches: frozenset[str]
) -> tuple[float, dict[str, np.ndarray]]:
    blas = "blas_matmul" in switches
    store = np.float16 if "fp16_activations" in switches else np.float32
    h1 = np.maximum(matmul(x, params["w1"], blas) + params["b1"], 0).astype(store)
    h2 = np.maximum(matmul(h1.astype(np.float32), params["w2"], blas) + params["b2"], 0).astype(store)
    out = matmul(h2.astype(np.float32), params["w3"], blas) + params["b3"]
    error = out - y
    loss = float(np.mean(error**2))
    d_out = (2.0 / len(x)) * error
    h1f, h2f = h1.astype(np.float32), h2.astype(np.float32)
    grads = {"w3": matmul(h2f.T, d_out, blas), "b3": d_out.sum(0)}
    d_h2 = matmul(d_out, params["w3"].T, blas) * (h2f > 0)
    grads.update(w2=matmul(h1f.T, d_h2, blas), b2=d_h2.sum(0))
    d_h1 = matmul(d_h2, params["w2"].T, blas) * (h1f > 0)
    grads.update(w1=matmul(x.T, d_h1, blas), b1=d_h1.sum(0))
    return loss, grads


class Trainer:
    """SGD with momentum over fixed batches drawn from the seed: two trainers of one seed see the same samples."""

    def __init__(self, seed: int, hidden: int, batch: int, lr: float, switches: frozenset[str]):
        self.x, self.y = dataset(seed)
        self.params = init(seed, hidden)
        self.velocity = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.order = np.random.default_rng(seed + 2)
        self.batch, self.lr, self.switches = batch, lr, switches

    def step(self) -> tuple[float, float]:
        """One training step; (loss before the update, gradient norm)."""
        rows = self.order.integers(0, len(self.x), self.batch)
        loss, grads = loss_and_grads(self.params, self.x[rows], self.y[rows], self.switches)
        for name, grad in grads.items():
            self.velocity[name] = 0.9 * self.velocity[name] + grad
            self.params[name] -= self.lr * self.velocity[name]
        return loss, float(np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values())))
