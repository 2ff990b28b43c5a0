"""The AR training step of seed 003's recipe, and the window it reports.

fp32 master weights; bf16 autocast on CUDA (fp32 on the CPU); AdamW (fused where available) over the AR
trainables in two groups (decoder-side FAST/state modules at `lr`, the Qwen3 blocks and ln_f at
`backbone_lr`); gradient clipping; the vision tower frozen (no gradients, no optimizer state). A step's batch
arrives as `backward_chunks` chunks; each chunk's sum-form loss is divided by the whole step's count of
loss-bearing tokens before its backward, so the accumulated gradient is the unchunked mean's gradient.

Several ranks (engine.molmo2.train.distributed) share this one loop through two seams: a `GradientSync` (how the
chunks' forward/backward run and how the ranks' gradients meet) and an optimizer factory (AdamW, or ZeRO-1
over AdamW). With the defaults the step is exactly the single-process step.
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Sequence

import torch

from engine.memory.meter import MemoryMeter
from engine.molmo2.model.ar import ar_forward, ar_loss_sums, set_ar_trainable
from engine.molmo2.model.batch import IGNORE_INDEX, ARBatch
from engine.molmo2.model.model import Molmo2Model
from engine.molmo2.train.master_adamw import MasterAdamW, shadowed_parameters

if TYPE_CHECKING:
    from engine.molmo2.run_config import Molmo2RunConfig

# Parameters trained at the decoder learning rate (seed 003: --decoder-lr); the rest of the trainables (the
# text blocks and ln_f) take --backbone-text-lr.
DECODER_SIDE = ("model.transformer.wte.fast_embed", "fast_head.", "state_proj.")


@dataclass(frozen=True)
class TrainConfig:
    """The step's settings. A run takes them from its run config (`of`), which owns their defaults and rules;
    tests and benchmarks name them all."""

    batch: int
    backward_chunks: int
    lr: float
    backbone_lr: float
    grad_clip: float
    warmup: int
    weight_decay: float = 0.0  # not a run-config key: the seeds' recipe trains without weight decay

    def __post_init__(self) -> None:
        assert self.batch >= 1 and self.backward_chunks >= 1 and self.batch % self.backward_chunks == 0, self
        assert all(math.isfinite(v) and v > 0 for v in (self.lr, self.backbone_lr, self.grad_clip)), self

    @classmethod
    def of(cls, config: "Molmo2RunConfig") -> "TrainConfig":
        return cls(config.batch, config.backward_chunks, config.lr, config.backbone_text_lr, config.grad_clip,
                   config.warmup)  # fmt: skip

    @property
    def chunk_size(self) -> int:
        return self.batch // self.backward_chunks


@dataclass(frozen=True)
class Step:
    """One prepared optimizer step: its chunks (on the device) and what the host knows about them already."""

    chunks: tuple[ARBatch, ...]
    loss_tokens: int  # loss-bearing tokens of the whole step (counted on the host, at collate time); across
    # ranks, of the GLOBAL step (every rank's slice: distributed.with_global_loss_tokens), the normaliser
    # that makes the ranks' summed gradients the global batch's mean-loss gradient
    useful_tokens: int  # real (non-padding) prefix + suffix tokens


def prepare_step(chunks: Sequence[ARBatch], device: torch.device) -> Step:
    loss_tokens = sum(int((c.suffix.labels != IGNORE_INDEX).sum()) for c in chunks)
    useful = sum(int(c.prefix.attention_mask.sum()) + int(c.suffix.attention_mask.sum()) for c in chunks)
    return Step(tuple(c.to(device) for c in chunks), loss_tokens, useful)


ADAM_BETAS = (0.9, 0.95)

# (param groups, config, fused) -> the optimizer over them
OptimizerFactory = Callable[[list[dict[str, Any]], TrainConfig, bool], torch.optim.Optimizer]


def param_groups(model: Molmo2Model, config: TrainConfig) -> list[dict[str, Any]]:
    """The run's two groups: the decoder side at `lr`, the rest of the trainables at `backbone_lr`."""
    set_ar_trainable(model)
    decoder, backbone = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decoder if name.startswith(DECODER_SIDE) else backbone).append(p)
    return [{"params": decoder, "lr": config.lr}, {"params": backbone, "lr": config.backbone_lr}]


def adamw(groups: list[dict[str, Any]], config: TrainConfig, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, betas=ADAM_BETAS, weight_decay=config.weight_decay, fused=fused)


def make_optimizer(model: Molmo2Model, config: TrainConfig, factory: OptimizerFactory = adamw) -> torch.optim.Optimizer:
    groups = param_groups(model, config)
    fused = next(model.parameters()).device.type == "cuda"
    return factory(groups, config, fused)


class GradientSync:
    """How the ranks of a step make its gradient the global batch's. One process has nothing to agree on: this
    base class runs the plain AR forward, no context around the chunks, no reduction — the baseline's step exactly.
    engine.molmo2.train.distributed implements the multi-process modes (DDP, explicit allreduce)."""

    world_size = 1

    def forward(self, model: Molmo2Model, chunk: ARBatch) -> torch.Tensor:
        return ar_forward(model, chunk)

    def chunk_context(self, last: bool) -> ContextManager:
        """Around one chunk's forward and backward (DDP's no_sync goes here)."""
        return nullcontext()

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """After the last chunk's backward, before clipping."""

    def reduce_window(self, seconds: list[float], losses: list[float], tokens: list[int], memory: dict[str, float]):
        """The window's per-step values as the whole rung saw them (one process: as they are)."""
        return seconds, losses, tokens, memory


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    def __init__(
        self,
        model: Molmo2Model,
        config: TrainConfig,
        device: torch.device,
        sync: GradientSync | None = None,
        optimizer_factory: OptimizerFactory = adamw,
    ):
        self.model = model
        self.config = config
        self.device = device
        self.sync = sync if sync is not None else GradientSync()
        self.optimizer_factory = optimizer_factory
        self.optimizer: torch.optim.Optimizer = make_optimizer(model, config, optimizer_factory)
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.steps_done = 0
        self.memory = MemoryMeter(device)
        # X7: the stream the optimizer step runs on (made at its first use), and the event of the update in flight
        # (None: none is). Read the switch at each step: an interleaved ladder turns it on and off in one process.
        self._update_stream: torch.cuda.Stream | None = None
        self.update_in_flight: torch.cuda.Event | None = None

    def _overlapping(self) -> bool:
        if not self.model.switches.optimizer_overlaps_vision:
            return False
        if self.device.type != "cuda" or type(self.sync) is not GradientSync:
            raise ValueError(
                "optimizer_overlaps_vision (X7) runs the optimizer on a second CUDA stream of one process; this "
                f"run trains on {self.device.type} with {self.sync.world_size} rank(s): use it on a CUDA profile "
                "with one rank"
            )
        if self._update_stream is None:
            self._update_stream = torch.cuda.Stream(self.device)
        return True

    def settle(self) -> None:
        """Orders the device's current stream after the update in flight (X7): whatever runs next on it (a read of
        the weights, the gradient norm, the next step's trainable layers) sees the updated weights."""
        if self.update_in_flight is not None:
            torch.cuda.current_stream(self.device).wait_event(self.update_in_flight)
            self.update_in_flight = None

    def _weights_for_switches(self) -> None:
        """X10 on: the trainable linears become bf16 over fp32 masters in a MasterAdamW; off: fp32 parameters and
        torch's AdamW again. Moments and step carry over either way. Read at each step, as X7 is: an interleaved
        ladder turns it on and off in one process."""
        wanted = self.model.switches.bf16_linear_weights
        if wanted == isinstance(self.optimizer, MasterAdamW):
            return
        self.settle()  # no update may still be writing the weights being moved
        if not wanted:
            self.release_weights()
            return
        if self.config.backward_chunks != 1:
            raise ValueError(
                f"bf16_linear_weights (X10) keeps gradients in bf16; backward_chunks = {self.config.backward_chunks} "
                "would sum the chunks' gradients in bf16: use it with backward_chunks = 1"
            )
        if self.device.type != "cuda" or type(self.sync) is not GradientSync or self.optimizer_factory is not adamw:
            raise ValueError(
                "bf16_linear_weights (X10) runs its update as Triton kernels over one process's whole AdamW state; "
                f"this run trains on {self.device.type} with {self.sync.world_size} rank(s) and "
                f"{getattr(self.optimizer_factory, '__name__', self.optimizer_factory)}: use it on a CUDA profile "
                "with one rank and plain AdamW"
            )
        self.optimizer = MasterAdamW.from_adamw(self.optimizer, shadowed_parameters(self.model))

    def release_weights(self) -> None:
        """Every parameter an fp32 tensor of its own again and torch's AdamW over them (X10 undone; a no-op
        without it): before the weights are reloaded or the switch is turned off."""
        if isinstance(self.optimizer, MasterAdamW):
            self.settle()
            states = self.optimizer.release()
            self.optimizer = make_optimizer(self.model, self.config, self.optimizer_factory)
            self.optimizer.state.update(states)  # the learning rates follow steps_done at the next update

    @contextmanager
    def master_weights(self) -> Iterator[None]:
        """The model's parameters at full precision for the duration (checkpoints, fp32 decoding): with X10 the
        shadowed linears read and write their fp32 masters; without it the parameters already are fp32."""
        self.settle()
        if isinstance(self.optimizer, MasterAdamW):
            with self.optimizer.masters():
                yield
        else:
            yield

    def _set_lr(self) -> None:
        scale = min(1.0, (self.steps_done + 1) / self.config.warmup) if self.config.warmup else 1.0
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * scale

    def accumulate_gradients(self, step: Step) -> torch.Tensor:
        """Forward and backward over the step's chunks; the gradients sum to those of the step's mean loss."""
        self.model.train()
        chunks = list(step.chunks)
        if self.update_in_flight is not None:
            # X7: the frozen tower reads no weight the update writes, so the first chunk's images go through it while
            # the update runs; everything after waits for the update.
            with autocast(self.device):
                features = self.model.image_features(chunks[0].prefix.pixel_values,
                                                     chunks[0].prefix.image_token_pooling)  # fmt: skip
            chunks[0] = replace(chunks[0], prefix=replace(chunks[0].prefix, image_features=features))
            self.settle()
        # After settle: the update read these gradients, and their memory returns to this stream's pool.
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros(
            (),
            device=self.device,
            dtype=torch.float64 if self.model.lm_head.weight.dtype == torch.float64 else torch.float32,
        )
        last = len(chunks) - 1
        for index, chunk in enumerate(chunks):
            with self.sync.chunk_context(index == last):
                with autocast(self.device):
                    logits = self.sync.forward(self.model, chunk)
                sums = ar_loss_sums(logits.to(loss.dtype), chunk.suffix, self.model.switches)
                chunk_loss = sums["loss_sum"] / step.loss_tokens
                chunk_loss.backward()
            loss = loss + chunk_loss.detach()
        self.sync.reduce_gradients(self.trainable)
        return loss

    def update(self) -> torch.Tensor:
        """The optimizer step from the gradients in place: this step's warm-up learning rate, clipping, AdamW.
        Returns the pre-clip gradient norm. With X7 the update is only enqueued, on its own stream after the
        backward: the norm and the weights are the current stream's to read after `settle`."""
        if not self._overlapping():
            return self._update()
        self._update_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._update_stream):
            grad_norm = self._update()
            self.update_in_flight = torch.cuda.Event()
            self.update_in_flight.record(self._update_stream)
        return grad_norm

    def _update(self) -> torch.Tensor:
        self._set_lr()
        if isinstance(self.optimizer, MasterAdamW):
            grad_norm = self.optimizer.clip_and_step(self.config.grad_clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.config.grad_clip)
            self.optimizer.step()
        self.steps_done += 1
        return grad_norm

    def _drain(self) -> None:
        """Waits for the device to finish what the step enqueued. With X7 that is the current stream's work only:
        the update in flight belongs under the next step's tower, so a step's seconds run from the end of the last
        backward to the end of this one, and include the wait for the last update that the tower did not hide."""
        if self.update_in_flight is None:
            synchronize(self.device)
        else:
            torch.cuda.current_stream(self.device).synchronize()

    def step(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (loss, grad norm) as device tensors (no host sync here). Across ranks the
        loss is this rank's share of the global mean (its chunk sums over the global token count)."""
        self._weights_for_switches()
        loss = self.accumulate_gradients(step)
        grad_norm = self.update()
        return loss, grad_norm

    def window(
        self, steps: Sequence[Step], windowed_memory: bool, should_stop: Callable[[], bool] = lambda: False
    ) -> dict:
        """Run the steps (stopping early if asked between steps) and report the window (DESIGN.md "Windows")."""
        seconds, losses, norms, tokens = [], [], [], []
        for step in steps:
            self._drain()
            start = time.perf_counter()
            loss, grad_norm = self.step(step)
            self._drain()  # device-synchronized step time
            seconds.append(time.perf_counter() - start)
            losses.append(float(loss))
            norms.append(grad_norm)
            tokens.append(step.useful_tokens)
            if should_stop():  # several ranks: a collective, so every rank stops after the same step
                break
        if self.update_in_flight is not None:
            # X7: the window's last update runs past its last step; its tail is the window's, so the seconds sum to
            # the window's wall time (and the next window's first step starts with no update to hide).
            start = time.perf_counter()
            self.settle()
            synchronize(self.device)
            seconds[-1] += time.perf_counter() - start
        norms = [float(norm) for norm in norms]
        memory = self.memory.window_end(windowed_memory)
        # Several ranks: a step takes its slowest rank's seconds, its loss and tokens are the ranks' sums, the
        # memory fields the largest rank's. Grad norms are already equal (the gradients were reduced).
        seconds, losses, tokens, memory = self.sync.reduce_window(seconds, losses, tokens, memory)
        finite = all(math.isfinite(v) for v in losses + norms)
        window = {
            "steps": len(seconds),
            "s_per_step": statistics.median(seconds),
            "tokens_per_s": sum(tokens) / sum(seconds),
            "loss": statistics.fmean(losses),
            "grad_norm": statistics.fmean(norms),
            "finite": finite,
        }
        window.update(memory)
        return window
