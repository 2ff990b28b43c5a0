"""The Molmo2 workload's runner: one process's model, data, trainer and probes (engine.workload.WorkloadRunner).

The geometry comes from the profile (`tiny` on the CPU, `4b` on an H200), the protocol config from the
registration. Random initialisation, seeded: seed 000 explains why fresh init is representative for step time
("kernel-level deltas are geometry-dependent, not weight-dependent"). The batches of a run are prepared at load
(collated once and kept on the device, counted in the load time) and cycled, so the steps time the model, not
the data pipeline.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from engine.molmo2.ar import ar_greedy_decode
from engine.molmo2.collate import Collator, make_fast_tokenizer
from engine.molmo2.config import Molmo2Config
from engine.molmo2.fast import FastDecodeError
from engine.molmo2.model import Molmo2Model, init_weights
from engine.molmo2.processor import ImageGeometry
from engine.molmo2.prompt import ByteTokenizer, TokenLayout, parse_suffix
from engine.molmo2.rig import RigDataset
from engine.molmo2.switches import HEAD, Switches
from engine.molmo2.train import Step, TrainConfig, Trainer, prepare_step
from prereg.workload import Profile


@dataclass(frozen=True)
class Geometry:
    """Everything that differs between the tiny and the real workload, in one place."""

    model: str
    image_size: tuple[int, int]  # the rig's camera frames (the processor resizes them)
    fast_scale: float  # FAST's quantisation scale: the tiny FAST block (48 ids) needs a coarser one
    episodes: int  # training episodes the batch pool draws from
    pool_steps: int  # prepared steps, cycled
    eval_samples: int
    decode_tokens: int  # greedy decode budget of the evaluation / decode probes

    def layout(self, config: Molmo2Config) -> TokenLayout:
        if self.model == "4b":
            return TokenLayout.for_4b()
        t = config.text
        return TokenLayout.for_tiny(t.vocab_size, t.additional_vocab_size, config.fast_vocab_size)

    def image_geometry(self) -> ImageGeometry:
        return ImageGeometry.for_4b() if self.model == "4b" else ImageGeometry.for_tiny()


GEOMETRIES = {
    "tiny": Geometry("tiny", (42, 42), fast_scale=2.0, episodes=256, pool_steps=16, eval_samples=8, decode_tokens=128),
    "4b": Geometry("4b", (480, 640), fast_scale=10.0, episodes=96, pool_steps=4, eval_samples=4, decode_tokens=256),
}


def train_config(config: dict[str, Any]) -> TrainConfig:
    return TrainConfig(
        batch=int(config.get("batch", 12)),
        backward_chunks=int(config.get("backward_chunks", 1)),
        lr=float(config.get("lr", 1e-4)),
        backbone_lr=float(config.get("backbone_text_lr", 2e-5)),
        grad_clip=float(config.get("grad_clip", 100.0)),
        warmup=int(config.get("warmup", 0)),
    )


class Molmo2Runner:
    def __init__(self, profile: Profile, config: dict[str, Any], seed: int):
        if profile.geometry not in GEOMETRIES:
            raise ValueError(f"profile {profile.name}: geometry {profile.geometry!r} is not one of {sorted(GEOMETRIES)}")
        self.profile = profile
        self.run_config = config
        self.seed = seed
        self.geometry = GEOMETRIES[profile.geometry]
        self.device = torch.device("cuda" if profile.device == "cuda" else "cpu")
        self.devices = 1
        self.train_config = train_config(config)
        self.camera_counts = tuple(config.get("camera_counts", (1, 2)))
        self.max_crops = int(config.get("max_crops", 1))
        self._initial: dict[str, torch.Tensor] | None = None
        self.trainer: Trainer | None = None
        self.switches = HEAD

    # ---- load ----
    def load(self) -> None:
        torch.manual_seed(self.seed)
        self.config = Molmo2Config.named(self.geometry.model)
        self.layout = self.geometry.layout(self.config)
        self.fast = make_fast_tokenizer(self.seed, 2000, scale=self.geometry.fast_scale, vocab_size=self.config.fast_vocab_size)
        self.collator = Collator(self.layout, self.fast, ByteTokenizer.for_layout(self.layout), self.geometry.image_geometry(), self.max_crops)
        data = RigDataset(self.seed, self.geometry.episodes, camera_counts=self.camera_counts, image_size=self.geometry.image_size)
        self.eval_data = RigDataset(self.seed, self.geometry.eval_samples, camera_counts=self.camera_counts,
                                    image_size=self.geometry.image_size, split="eval")
        self.train_data = data
        self.pool = [self._prepare(data, index) for index in range(self.geometry.pool_steps)]
        self.probe_step = self.pool[0]
        with torch.device("meta"):
            self.model = Molmo2Model(self.config)
        self.model.to_empty(device=self.device)
        init_weights(self.model, self.seed)
        self.trainer = Trainer(self.model, self.train_config, self.device)
        self.cursor = 0

    def _prepare(self, data: RigDataset, index: int) -> Step:
        batch, size = self.train_config.batch, self.train_config.chunk_size
        first = index * batch
        samples = [data.sample((first + k) % len(data)) for k in range(batch)]
        chunks = [self.collator(samples[k: k + size]) for k in range(0, batch, size)]
        return prepare_step(chunks, self.device)

    # ---- training ----
    def set_switches(self, switches: tuple[str, ...]) -> None:
        self.switches = Switches.from_names(list(switches))
        self.model.switches = self.switches

    def steps_for(self, n: int) -> list[Step]:
        return [self.pool[k % len(self.pool)] for k in range(n)]

    def train_window(self, steps: int, should_stop: Callable[[], bool]) -> dict[str, Any]:
        assert self.trainer is not None, "load() first"
        batch = [self.pool[(self.cursor + k) % len(self.pool)] for k in range(steps)]
        window = self.trainer.window(batch, self.switches.windowed_vram_peak, should_stop)
        self.cursor += window["steps"]
        return window

    # ---- evaluation ----
    def decode(self, samples: list) -> list[list[int]]:
        batch = self.collator(samples).to(self.device)
        self.model.eval()
        with torch.no_grad():
            ids = ar_greedy_decode(self.model, batch.prefix, batch.suffix.input_ids[:, :1], self.geometry.decode_tokens, self.layout.end_id)
        self.model.train()
        return ids.tolist()

    def decode_plan(self) -> torch.Tensor:
        """The pinned small eval plan of the decode byte-match probe: the first two held-out episodes."""
        samples = [self.eval_data.sample(i) for i in range(2)]
        return torch.tensor([row + [self.layout.end_id] * (self.geometry.decode_tokens - len(row)) for row in self.decode(samples)])

    def evaluate(self) -> dict[str, float]:
        """Greedy-decoded action error on held-out episodes (seed 003's probe: chunk MAE and first-action MAE)."""
        return self.decode_error([self.eval_data.sample(i) for i in range(len(self.eval_data))])

    def decode_error(self, samples: list) -> dict[str, float]:
        """Chunk and first-action MAE of greedy decodes against the samples' true chunks. A decode with the wrong
        number of FAST coefficients is completed (missing high frequencies are 0) and counted as partial; one that
        yields no chunk at all counts as the zero chunk and as a failure."""
        chunk_errors, first_errors, failures, partial = [], [], 0, 0
        tokenizer = self.collator.text
        for sample, ids in zip(samples, self.decode(samples)):
            truth = sample.actions.numpy()
            try:
                fast_ids = parse_suffix(ids, self.layout, tokenizer).fast_ids
                if not fast_ids:
                    raise FastDecodeError("no FAST ids were generated")
                try:
                    predicted = self.fast.decode(fast_ids)
                except FastDecodeError:
                    predicted = self.fast.decode(fast_ids, partial=True)
                    partial += 1
            except (FastDecodeError, ValueError):
                predicted = np.zeros_like(truth)
                failures += 1
            chunk_errors.append(float(np.abs(predicted - truth).mean()))
            first_errors.append(float(np.abs(predicted[0] - truth[0]).mean()))
        return {"probe_chunk_mae": statistics.fmean(chunk_errors), "probe_first_mae": statistics.fmean(first_errors),
                "probe_decode_failures": failures, "probe_decode_partial": partial, "probe_samples": len(samples)}

    def save(self, directory: str) -> None:
        from engine.molmo2.checkpoint import write_checkpoint

        write_checkpoint(self.model, self.config, directory)

    # ---- probes ----
    def fresh(self, switches: Switches) -> Trainer:
        """The initial weights again, the given switches, a new optimizer: every probe arm starts alike."""
        if self._initial is None:
            self._initial = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        self.model.load_state_dict(self._initial)
        self.model.zero_grad(set_to_none=True)
        self.model.switches = switches
        self.switches = switches
        self.trainer = Trainer(self.model, self.train_config, self.device)
        return self.trainer

    def probe(self, probe: str, switch: str, oracle: dict[str, Any]) -> dict[str, Any]:
        from engine.molmo2.probes import PROBES

        observed = PROBES[probe](self, switch, oracle)
        self.fresh(HEAD)
        return observed
