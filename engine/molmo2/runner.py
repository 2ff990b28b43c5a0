"""The Molmo2 workload's runner: one process's model, data, trainer and probes (engine.workload.WorkloadRunner).

The geometry comes from the profile (`tiny` on the CPU, `4b` on an H200), the protocol config from the
registration. Random initialisation, seeded: seed 000 explains why fresh init is representative for step time
("kernel-level deltas are geometry-dependent, not weight-dependent"). The batches of a run are prepared at load
(collated once and kept on the device, counted in the load time) and cycled, so the steps time the model, not
the data pipeline.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from engine.memory.snapshot import MemoryInstrument
from engine.molmo2.attention.execution import Execution
from engine.molmo2.attention.packing import pack
from engine.molmo2.data.collate import Collator, make_fast_tokenizer
from engine.molmo2.data.fast import FastDecodeError
from engine.molmo2.data.processor import ImageGeometry
from engine.molmo2.data.prompt import ByteTokenizer, TokenLayout, parse_suffix
from engine.molmo2.data.rig import STATE_DIM, RigDataset
from engine.molmo2.model.ar import ar_greedy_decode
from engine.molmo2.model.config import Molmo2Config
from engine.molmo2.model.model import Molmo2Model, init_weights
from engine.molmo2.planted import mismatched, planted_crash
from engine.molmo2.run_config import RUN_CONFIG, Molmo2RunConfig
from engine.molmo2.switches import Switches
from engine.molmo2.train.distributed import (
    OPTIMIZER_STATE,
    describe,
    make_gradient_sync,
    optimizer_factory,
    save_training_state,
    with_global_loss_tokens,
)
from engine.molmo2.train.step import Step, TrainConfig, Trainer, prepare_step
from engine.workload import MEMORY_DIR_VARIABLE, Ranks, RunContext
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
            return TokenLayout.for_4b(config.fast_vocab_size)
        t = config.text
        return TokenLayout.for_tiny(t.vocab_size, t.additional_vocab_size, config.fast_vocab_size)

    def image_geometry(self) -> ImageGeometry:
        return ImageGeometry.for_4b() if self.model == "4b" else ImageGeometry.for_tiny()


GEOMETRIES = {
    "tiny": Geometry("tiny", (42, 42), fast_scale=2.0, episodes=256, pool_steps=16, eval_samples=8, decode_tokens=128),
    "4b": Geometry("4b", (480, 640), fast_scale=10.0, episodes=96, pool_steps=4, eval_samples=4, decode_tokens=256),
}


# Compiled runs pad the prefix and the suffix to multiples of 16, so a pool's chunks share a few shapes (each
# distinct shape is one compilation, 10-30 s on an H200). 128 (FlexAttention's block) padded 17.3% of the tokens
# against 14.1% for 16, for no fewer shapes at one chunk per step (bench/results/peer_molmo2_h200-4b_pad128
# and _pad16).
COMPILED_PAD_MULTIPLE = (16, 16)


def data_banner(datasets: list[RigDataset]) -> dict[str, int]:
    """What the run trains on, counted from its own datasets at load: seed 003's E1 data gate ("878 datasets /
    38,571 episodes / 18,636,749 frames / dims 6/6") as this workload can count it. A rig episode is one moment of
    a pick, its frames one per camera; the dims are the robot state's and the action chunk's. Every window carries
    it, so a kill line sees it on the first one."""
    return {
        "data_datasets": len(datasets),
        "data_episodes": sum(len(d) for d in datasets),
        "data_frames": sum(d.scene(i).n_cameras for d in datasets for i in range(len(d))),
        "data_state_dim": STATE_DIM,
        "data_action_dim": min(d.action_dim for d in datasets),
    }


class Molmo2Runner:
    def __init__(self, profile: Profile, config: Molmo2RunConfig, seed: int, context: RunContext | None = None):
        """`config`: the rung's effective config, resolved against `profile` (engine.molmo2.run_config)."""
        del context  # the model trains in this process: the rung reaches it through set_switches and train_window
        if profile.geometry not in GEOMETRIES:
            raise ValueError(
                f"profile {profile.name}: geometry {profile.geometry!r} is not one of {sorted(GEOMETRIES)}"
            )
        assert isinstance(config, Molmo2RunConfig), "the runner takes the typed run config (run_config.resolve)"
        retired = RUN_CONFIG.retired_in(config)
        if retired:
            # Validation keeps frozen documents that use them meaningful; their code has left the workload.
            uses = "; ".join(f"{r.label}, retired by {r.retired_by}" for r in retired)
            raise ValueError(
                f"this config uses retired options ({uses}): their code has left the workload; re-run such a rung "
                "from the commit its freeze records"
            )
        self.profile = profile
        self.run_config = config
        self.seed = seed
        self.geometry = GEOMETRIES[profile.geometry]
        self.device = torch.device("cuda" if profile.device == "cuda" else "cpu")
        self.devices = 1
        self.train_config = TrainConfig.of(config)
        # bucket_by_length regroups the pool's samples into steps by camera count: cheaper steps, but other steps,
        # so another optimisation trajectory (seed 002: "paired arms must share the flag"). chunk_by_cameras keeps
        # the steps and cuts only each step's chunks where the camera counts meet: the step's gradient is the same.
        self.chunk_by_cameras = config.bucket_by_length or config.chunk_by_cameras
        self.execution = Execution.of(config)
        if config.pack_attention == "varlen-cudnn" and self.device.type == "cuda":
            from engine.molmo2.attention.cudnn import cudnn_frontend

            cudnn_frontend()  # a missing package is a config error now, not a failure in the first step
        # A rung of several processes: this process's rank (engine.workload.join_ranks ran before), and how the
        # ranks train (recorded on the run's end).
        self.ranks = Ranks.current()
        self.parallel = describe(config, self.ranks.world_size)
        # seed 003's BIJOU_MEM_SNAPSHOT as run config: allocation history from load, a snapshot after the first
        # window and at an out-of-memory
        self.memory = MemoryInstrument.from_config(
            config.memory_snapshot, self.device, os.environ.get(MEMORY_DIR_VARIABLE, "reports/memory")
        )
        self._initial: dict[str, torch.Tensor] | None = None
        self.trainer: Trainer | None = None
        # The switches every rung of this config runs; a rung's items add theirs (set_switches).
        self.baseline = Switches.from_names(config.baseline_switches)
        self.switches = self.baseline
        self.planted_crash = planted_crash(os.environ)  # (switch, step): engine/molmo2/planted.py

    # ---- load ----
    def load(self) -> None:
        if self.memory is not None:
            self.memory.start()  # from before the model exists: the whole allocation history
        self.load_data()
        self.load_model()

    def load_data(self) -> None:
        """Tokenizers, collator, datasets and the prepared step pool (collated once, on the device)."""
        torch.manual_seed(self.seed)
        self.config = Molmo2Config.named(self.geometry.model, fast_vocab_size=self.run_config.fast_vocab_size)
        self.layout = self.geometry.layout(self.config)
        self.fast = make_fast_tokenizer(
            self.seed, 2000, scale=self.geometry.fast_scale, vocab_size=self.config.fast_vocab_size
        )
        text = ByteTokenizer.for_layout(self.layout)
        self.collator = Collator(
            self.layout, self.fast, text, self.geometry.image_geometry(), self.run_config.max_crops,
            pad_multiple=self.pad_multiple(),
        )  # fmt: skip
        cameras = self.run_config.camera_counts
        data = RigDataset(self.seed, self.geometry.episodes, camera_counts=cameras, image_size=self.geometry.image_size)
        self.eval_data = RigDataset(
            self.seed,
            self.geometry.eval_samples,
            camera_counts=cameras,
            image_size=self.geometry.image_size,
            split="eval",
        )
        self.train_data = data
        self.banner = data_banner([data])
        self.pool = with_global_loss_tokens(self._prepare_pool(data), self.ranks)
        self.probe_step = self.pool[0]

    def load_model(self) -> None:
        """The model (seeded init on the device), its execution options, the trainer."""
        with torch.device("meta"):
            self.model = Molmo2Model(self.config)
        self.model.to_empty(device=self.device)
        init_weights(self.model, self.seed)
        self.model.set_execution(self.execution)
        self.trainer = Trainer(
            self.model,
            self.train_config,
            self.device,
            sync=make_gradient_sync(self.model, self.run_config, self.device, self.ranks),
            optimizer_factory=optimizer_factory(self.run_config, self.ranks.world_size),
        )
        self.cursor = 0

    def _prepare_pool(self, data: RigDataset) -> list[Step]:
        """The run's steps: the first pool_steps x batch episodes in order. With `bucket_by_length` the same
        episodes are sorted by camera count before they are cut into steps and chunks (seed 002's 2a,
        camera-count keys), so a chunk pads a prefix to its own camera count, not to the batch's largest."""
        batch, steps = self.train_config.batch, self.geometry.pool_steps
        # Several ranks cut the same global sequence into global steps of world x batch episodes; rank r takes
        # slice r of each: a different slice per rank, together the one-process run at the global batch.
        world, rank = self.ranks.world_size, self.ranks.rank
        indices = [i % len(data) for i in range(steps * batch * world)]
        if self.run_config.bucket_by_length:
            indices.sort(key=lambda i: data.scene(i).n_cameras)  # stable: episode order within a count
        return [
            self._prepare(data, indices[(k * world + rank) * batch : (k * world + rank + 1) * batch])
            for k in range(steps)
        ]

    def _prepare(self, data: RigDataset, indices: list[int]) -> Step:
        size = self.train_config.chunk_size
        samples = [data.sample(i) for i in indices]
        groups = [samples]
        if self.chunk_by_cameras:
            # Where the camera counts meet inside a step, the chunk splits there too: a one-camera sample never
            # pads to a two-camera prefix. Chunk sizes then vary; the loss is normalised by the step's token
            # count, so the step's gradient is the same however it is chunked.
            groups = [[s for s in samples if s.n_cameras == n] for n in sorted({s.n_cameras for s in samples})]
        chunks = [self.collator(group[k : k + size]) for group in groups for k in range(0, len(group), size)]
        if self.run_config.pack:
            chunks = [pack(chunk, self.pad_multiple()) for chunk in chunks]
        return prepare_step(chunks, self.device)

    def pad_multiple(self) -> tuple[int, int]:
        """The (prefix, suffix) length multiple of padded and packed rows: few shapes to compile, else none."""
        return COMPILED_PAD_MULTIPLE if self.execution.compile else (1, 1)

    # ---- training ----
    def set_switches(self, switches: tuple[str, ...]) -> None:
        """A rung's items' switches, on top of the baseline's."""
        self.switches = self.with_switches(switches)
        self.model.switches = self.switches

    def with_switches(self, switches: tuple[str, ...] | list[str]) -> Switches:
        """The baseline with these switches on too."""
        return Switches.from_names(sorted({*self.baseline.on(), *switches}))

    def steps_for(self, n: int) -> list[Step]:
        return [self.pool[k % len(self.pool)] for k in range(n)]

    def train_window(self, steps: int, should_stop: Callable[[], bool]) -> dict[str, Any]:
        assert self.trainer is not None, "load() first"
        batch = [self.pool[(self.cursor + k) % len(self.pool)] for k in range(steps)]
        if self.planted_crash is not None and self.planted_crash[0] in self.switches.on():
            k = self.planted_crash[1] - self.cursor - 1
            if 0 <= k < steps:
                first, *rest = batch[k].chunks
                planted = mismatched(first, self.config.image_patch_id, self.layout.end_id)
                batch[k] = dataclasses.replace(batch[k], chunks=(planted, *rest))
        if self.memory is None:
            window = self.trainer.window(batch, self.switches.windowed_vram_peak, should_stop)
        else:
            holders = lambda: (self.model, self.trainer.optimizer)  # noqa: E731
            with self.memory.dump_on_oom(holders):
                window = self.trainer.window(batch, self.switches.windowed_vram_peak, should_stop)
            # After the first window the last step's gradients and the optimizer state are still live.
            self.memory.dump_once("first-window", *holders())
        self.cursor += window["steps"]
        return {**window, **self.banner}

    # ---- evaluation ----
    def decode(self, samples: list) -> list[list[int]]:
        batch = self.collator(samples).to(self.device)
        self.model.eval()
        with torch.no_grad(), self.trainer.master_weights():  # decode runs in fp32, without autocast
            ids = ar_greedy_decode(
                self.model, batch.prefix, batch.suffix.input_ids[:, :1], self.geometry.decode_tokens, self.layout.end_id
            )
        self.model.train()
        return ids.tolist()

    def decode_plan(self) -> torch.Tensor:
        """The pinned small eval plan of the decode byte-match probe: the first two held-out episodes."""
        samples = [self.eval_data.sample(i) for i in range(2)]
        return torch.tensor(
            [row + [self.layout.end_id] * (self.geometry.decode_tokens - len(row)) for row in self.decode(samples)]
        )

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
        return {
            "probe_chunk_mae": statistics.fmean(chunk_errors),
            "probe_first_mae": statistics.fmean(first_errors),
            "probe_decode_failures": failures,
            "probe_decode_partial": partial,
            "probe_samples": len(samples),
        }

    def save(self, directory: str) -> None:
        """The weights (rank 0) and the consolidated optimizer state; every rank calls it (ZeRO-1 consolidates
        with a collective)."""
        from engine.molmo2.model.checkpoint import write_checkpoint

        if self.ranks.writer:
            with self.trainer.master_weights():
                write_checkpoint(self.model, self.config, directory)
        save_training_state(self.trainer, os.path.join(directory, OPTIMIZER_STATE), self.ranks)

    def close(self) -> None:
        """Nothing to end: the model lives in this process, which ends with the rung."""
        return None

    # ---- probes ----
    def fresh(self, switches: Switches) -> Trainer:
        """The initial weights again, the given switches, a new optimizer: every probe arm starts alike."""
        if self.trainer is not None:
            self.trainer.release_weights()  # fp32 parameters of their own (X10 undone), to reload below
            self.trainer.settle()  # the weights are reloaded below: no update may still be writing them
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
        self.fresh(self.baseline)
        return observed
