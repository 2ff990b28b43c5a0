"""X9: the optimizer update in stages, in the order the next step's forward reads the weights, each stage waited
for only where the forward first reads it.

X7 enqueues the whole update (clip and fused AdamW) on a side stream under the next step's frozen vision tower; the
first trainable layer then waits for all of it, and the update (about 50 ms under the tower) outlasts the tower. X9
cuts the same update into stages: the embedding side (the FAST rows, the state projection), then each decoder block,
then the head side (ln_f, the FAST head). The gradient norm is taken over every gradient first, as the clip needs;
then each stage is clipped and stepped on its own and records an event. The forward waits for a stage's event just
before its first read of that stage's weights, so block i's update runs under blocks 0..i-1's forward.

The kernels and their inputs are the same: the norm over the same gradients in the same order, each gradient
multiplied by the same clip coefficient (computed from the same norm), each parameter's AdamW update by the same
fused kernel, which updates every element independently; only which launch carries which parameters changes. A
stage's gradients are freed where the forward waits for it, on the stream that made them, after the update read
them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Hashable, Iterator

import torch

if TYPE_CHECKING:
    from engine.molmo2.model.model import Molmo2Model

EMBED, HEAD = "embed", "head"  # the stages before block 0 and after the last block; blocks are keyed by index


def stages_of(model: "Molmo2Model") -> list[tuple[Hashable, list[torch.nn.Parameter]]]:
    """The trainable parameters in the forward's reading order: embed side, each block, head side. Every trainable
    parameter is in exactly one stage."""
    t = model.transformer
    stages: list[tuple[Hashable, list[torch.nn.Parameter]]] = [
        (EMBED, [*t.wte.parameters(), *model.state_proj.parameters()])
    ]
    stages += [(index, list(block.parameters())) for index, block in enumerate(t.blocks)]
    stages.append((HEAD, [*t.ln_f.parameters(), *model.fast_head.parameters()]))
    stages = [(key, [p for p in params if p.requires_grad]) for key, params in stages]
    staged = [id(p) for _, params in stages for p in params]
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert sorted(staged) == sorted(trainable), "every trainable parameter in exactly one stage"
    return stages


@contextmanager
def _stepping_only(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> Iterator[None]:
    """optimizer.step() over `params` alone, each under its own group's settings; the state is keyed by parameter,
    so it carries over."""
    chosen = {id(p) for p in params}
    groups = optimizer.param_groups
    subsets = [{**g, "params": [p for p in g["params"] if id(p) in chosen]} for g in groups]
    optimizer.param_groups = [g for g in subsets if g["params"]]
    try:
        yield
    finally:
        optimizer.param_groups = groups


def step_in_stages(
    stages: list[tuple[Hashable, list[torch.nn.Parameter]]],
    trainable: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    grad_clip: float,
    after_stage: Callable[[Hashable], None],
) -> torch.Tensor:
    """clip_grad_norm_(trainable, grad_clip) and optimizer.step(), stage by stage; `after_stage(key)` once each
    stage's update is enqueued. Returns the pre-clip norm."""
    # clip_grad_norm_ is this norm over `trainable`'s gradients in its order (the per-tensor norms are stacked, so
    # the order is the reduction's), then clip_grads_with_norm_ over every gradient: here, stage by stage
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in trainable if p.grad is not None])
    for key, params in stages:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm)
        with _stepping_only(optimizer, params):
            optimizer.step()
        after_stage(key)
    return grad_norm


class StagedUpdate:
    """One step's update, enqueued stage by stage on the current stream (the caller's side stream); `wait` orders
    the caller's stream after one stage, `wait_all` after every stage not waited for yet."""

    def __init__(
        self,
        stages: list[tuple[Hashable, list[torch.nn.Parameter]]],
        trainable: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        grad_clip: float,
    ) -> None:
        self.params = dict(stages)
        self.events: dict[Hashable, torch.cuda.Event] = {}

        def record(key: Hashable) -> None:
            self.events[key] = torch.cuda.Event()
            self.events[key].record()

        self.grad_norm = step_in_stages(stages, trainable, optimizer, grad_clip, record)

    def wait(self, key: Hashable, stream: torch.cuda.Stream) -> None:
        """`stream` waits for stage `key`'s update (once; later calls do nothing), then frees its gradients: the
        update read them, and the backward will make new ones."""
        event = self.events.pop(key, None)
        if event is None:
            return
        stream.wait_event(event)
        for p in self.params.pop(key):
            p.grad = None

    def wait_all(self, stream: torch.cuda.Stream) -> None:
        """`stream` waits for every stage not waited for yet; their gradients stay (a probe may read them)."""
        for event in self.events.values():
            stream.wait_event(event)
        self.events.clear()
        self.params.clear()
