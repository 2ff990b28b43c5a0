"""Seed 003's 2-process oracles for its memory plumbing, on the CPU with two gloo ranks (torch.multiprocessing).

(a) ZeRO-1 (tests/test_zero1.py in the seed): ZeroRedundancyOptimizer(AdamW) is bit-equal (torch.equal) to plain
    AdamW over this run's parameter-group shape (the tiny Molmo2's two groups at different learning rates) with
    a stepping warm-up schedule, and its consolidated checkpoint resumes sharded and un-sharded, bit-equal to the
    uninterrupted run.
(b) --chunk-grad-allreduce (tests/test_chunk_grad_allreduce.py): from deliberately rank-divergent initialisation,
    the no-wrapper path (broadcast_module_states + plain autograd + one in-place allreduce) equals the DDP path
    and a single-process global-batch reference to 1e-12 in fp64 over three optimizer steps.

Each oracle runs once (a module fixture: two processes); the ranks report what they measured and the tests judge
it, so each claim fails on its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.molmo2.data.collate import Collator, make_fast_tokenizer
from engine.molmo2.data.prompt import ByteTokenizer
from engine.molmo2.data.rig import RigDataset
from engine.molmo2.model.batch import ARBatch
from engine.molmo2.model.config import Molmo2Config
from engine.molmo2.model.model import Molmo2Model, init_weights
from engine.molmo2.runner import GEOMETRIES
from engine.molmo2.train.distributed import (
    DataParallelSync,
    load_training_state,
    resume_sharded,
    resume_unsharded,
    save_training_state,
    with_global_loss_tokens,
    zero_adamw,
)
from engine.molmo2.train.step import TrainConfig, Trainer, prepare_step
from engine.workload import Ranks, join_ranks

WORLD = 2
CPU = torch.device("cpu")
pytestmark = pytest.mark.xdist_group("engine")  # two ranks each: one such test at a time on the two cores


# ---- two gloo ranks ----


def _rank_main(rank: int, worker_name: str, port: int, out: str) -> None:
    # The C++ side (gloo, c10d) reports on fd 2 and may abort the process: keep what it said beside the result
    stderr = open(Path(out) / f"rank{rank}.stderr", "w")  # noqa: SIM115 — open until the process ends
    os.dup2(stderr.fileno(), 2)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # as under torchrun: the store is the launcher's, not rank 0's
    )
    torch.set_num_threads(1)  # two ranks on two cores
    ranks = join_ranks("cpu")  # the engine's own join, from torchrun's environment variables
    try:
        result = WORKERS[worker_name](ranks, Path(out))
    finally:
        ranks.leave()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def two_ranks(worker_name: str, out: Path) -> list[dict]:
    """Run the worker on two spawned ranks. The rendezvous store lives in this process, as torchrun's agent
    hosts it, so it outlasts both ranks' teardown and its port is bound before either rank starts."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    try:
        mp.spawn(_rank_main, args=(worker_name, store.port, str(out)), nprocs=WORLD, join=True)
    except mp.ProcessExitedException as error:
        said = "\n".join(f"rank {r} stderr:\n{_tail(out / f'rank{r}.stderr')}" for r in range(WORLD))
        raise AssertionError(f"{error}\n{said}") from error
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _tail(path: Path) -> str:
    if not path.exists():
        return "(none written)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-40:])  # a C++ abort's message is its last lines


def tiny_model(seed: int) -> Molmo2Model:
    with torch.device("meta"):
        model = Molmo2Model(Molmo2Config.named("tiny"))
    model.to_empty(device=CPU)
    init_weights(model, seed)
    return model


def gathered(value) -> list:
    box = [None] * WORLD
    dist.all_gather_object(box, value)
    return box


def params_equal(a: Trainer, b: Trainer) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


# ---- (a) ZeRO-1 ----

ZERO_CONFIG = TrainConfig(batch=1, backward_chunks=1, lr=1e-3, backbone_lr=2e-4, grad_clip=100.0, warmup=3)
ZERO_STEPS, ZERO_SAVE_AFTER = 5, 3


def _gradients(step: int, trainer: Trainer) -> list[torch.Tensor]:
    """The step's (already all-reduced) gradients: seeded by the step, so every rank and every trainer sees the
    same; large enough that grad_clip = 100 clips them."""
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=generator) for p in trainer.trainable]


def _update(trainer: Trainer, step: int) -> None:
    for p, g in zip(trainer.trainable, _gradients(step, trainer)):
        p.grad = g
    trainer.update()


def zero1_worker(ranks: Ranks, out: Path) -> dict:
    plain = Trainer(tiny_model(0), ZERO_CONFIG, CPU)
    zero = Trainer(tiny_model(0), ZERO_CONFIG, CPU, optimizer_factory=zero_adamw)
    report: dict = {"equal": [], "lrs": []}
    for step in range(ZERO_STEPS):
        _update(plain, step)
        _update(zero, step)
        report["equal"].append(params_equal(plain, zero))
        report["lrs"].append([g["lr"] for g in zero.optimizer.param_groups])
        if step + 1 == ZERO_SAVE_AFTER:
            save_training_state(zero, str(out / "optimizer.pt"), ranks)  # consolidate_state_dict(to=0), rank 0 writes
            weights = {k: v.clone() for k, v in zero.model.state_dict().items()}
    report["plain_lrs"] = [g["lr"] for g in plain.optimizer.param_groups]
    report["own_state"] = len(zero.optimizer.optim.state)  # the Adam state this rank holds: its shard
    report["trainable"] = len(zero.trainable)

    state = load_training_state(str(out / "optimizer.pt"))
    resumed = {}
    for name, factory, resume in (("sharded", zero_adamw, resume_sharded), ("unsharded", None, resume_unsharded)):
        model = tiny_model(1)  # other weights, then the checkpoint's: nothing carries over but what was saved
        model.load_state_dict(weights)
        trainer = Trainer(model, ZERO_CONFIG, CPU, **({"optimizer_factory": factory} if factory else {}))
        resume(trainer, state)
        for step in range(ZERO_SAVE_AFTER, ZERO_STEPS):
            _update(trainer, step)
        resumed[name] = params_equal(plain, trainer)
        resumed[name + "_steps_done"] = trainer.steps_done
    report["resumed"] = resumed
    return report


@pytest.fixture(scope="module")
def zero1(tmp_path_factory) -> list[dict]:
    return two_ranks("zero1", tmp_path_factory.mktemp("zero1"))


def test_zero1_adamw_is_bit_equal_to_plain_adamw_over_the_run_param_groups(zero1):
    for report in zero1:
        assert report["equal"] == [True] * ZERO_STEPS, report["equal"]
        # the schedule stepped (warm-up 1/3, 2/3, 1, ...) and the two groups kept their own learning rates
        assert [round(lr, 12) for lr in report["lrs"][0]] == [round(1e-3 / 3, 12), round(2e-4 / 3, 12)]
        assert report["lrs"][-1] == report["plain_lrs"] == [1e-3, 2e-4]


def test_zero1_really_shards_the_adam_state(zero1):
    owned = [r["own_state"] for r in zero1]
    assert all(0 < n < zero1[0]["trainable"] for n in owned), owned  # each rank: a strict, non-empty part
    assert sum(owned) == zero1[0]["trainable"]  # and together: every trainable parameter, once


def test_zero1_checkpoint_resumes_sharded(zero1):
    for report in zero1:
        assert report["resumed"]["sharded"] is True
        assert report["resumed"]["sharded_steps_done"] == ZERO_STEPS


def test_zero1_checkpoint_resumes_unsharded(zero1):
    for report in zero1:
        assert report["resumed"]["unsharded"] is True
        assert report["resumed"]["unsharded_steps_done"] == ZERO_STEPS


# ---- (b) the gradient sync paths ----

SYNC_STEPS, PER_RANK = 3, 2
SYNC_MODES = ("allreduce", "ddp", "ddp+allreduce")


def _fp64(batch: ARBatch) -> ARBatch:
    prefix = type(batch.prefix)(
        **{
            **vars(batch.prefix),
            "pixel_values": batch.prefix.pixel_values.double(),
            "state": batch.prefix.state.double(),
        }
    )
    return ARBatch(prefix=prefix, suffix=batch.suffix, actions=batch.actions.double(), n_cameras=batch.n_cameras)


def _samples() -> tuple[Collator, list]:
    geometry = GEOMETRIES["tiny"]
    config = Molmo2Config.named("tiny")
    layout = geometry.layout(config)
    fast = make_fast_tokenizer(0, 2000, scale=geometry.fast_scale, vocab_size=config.fast_vocab_size)
    collator = Collator(layout, fast, ByteTokenizer.for_layout(layout), geometry.image_geometry(), 1)
    data = RigDataset(0, SYNC_STEPS * WORLD * PER_RANK, camera_counts=(1, 2), image_size=geometry.image_size)
    return collator, [data.sample(i) for i in range(len(data))]


class RecordingSync(DataParallelSync):
    """The real sync, noting this rank's own gradient norm before the ranks' gradients meet."""

    def reduce_gradients(self, params):
        self.local_norms = getattr(self, "local_norms", []) + [
            float(torch.stack([p.grad.norm() for p in params]).norm())
        ]
        super().reduce_gradients(params)


def sync_worker(ranks: Ranks, out: Path) -> dict:
    torch.manual_seed(0)
    collator, samples = _samples()
    global_batch = WORLD * PER_RANK
    chunk = lambda sample: _fp64(collator([sample]))  # noqa: E731 — chunks of one sample on both sides
    # Rank r's slice of global step k: samples [k*4 + 2r, k*4 + 2r + 2); the reference takes all four.
    local = [
        prepare_step([chunk(s) for s in samples[k * global_batch + ranks.rank * PER_RANK :][:PER_RANK]], CPU)
        for k in range(SYNC_STEPS)
    ]
    local_counts = [s.loss_tokens for s in local]
    local = with_global_loss_tokens(local, ranks)
    reference_steps = [
        prepare_step([chunk(s) for s in samples[k * global_batch :][:global_batch]], CPU) for k in range(SYNC_STEPS)
    ]

    config = dict(lr=1e-3, backbone_lr=2e-4, grad_clip=100.0, warmup=0)
    reference = Trainer(
        tiny_model(100).double(), TrainConfig(batch=global_batch, backward_chunks=global_batch, **config), CPU
    )
    report: dict = {
        "local_counts": gathered(local_counts),
        "global_counts": [s.loss_tokens for s in local],
        "reference_counts": [s.loss_tokens for s in reference_steps],
    }
    paths = {}
    for mode in SYNC_MODES:
        model = tiny_model(100 + ranks.rank).double()  # deliberately rank-divergent
        before = [float(p.double().sum()) for p in model.parameters()]
        sync = RecordingSync(model, mode, CPU, ranks)  # broadcast_module_states, or DDP's constructor broadcast
        after = [float(p.double().sum()) for p in model.parameters()]
        report[mode] = {"before": gathered(before), "after": gathered(after)}
        report["constant_init"] = [bool(p.min() == p.max()) for p in model.parameters()]  # norm gains, zero biases
        paths[mode] = Trainer(model, TrainConfig(batch=PER_RANK, backward_chunks=PER_RANK, **config), CPU, sync=sync)
    report["reference_init"] = [float(p.double().sum()) for p in reference.model.parameters()]
    initial = [p.detach().clone() for p in reference.model.parameters()]

    for k in range(SYNC_STEPS):
        reference_loss, _ = reference.step(reference_steps[k])
        for mode, trainer in paths.items():
            loss, _ = trainer.step(local[k])
            worst = max(
                (p - q).abs().max().item() for p, q in zip(trainer.model.parameters(), reference.model.parameters())
            )
            report[mode].setdefault("param_diff", []).append(worst)
            report[mode].setdefault("loss_diff", []).append(abs(ranks.sum([float(loss)])[0] - float(reference_loss)))
            report[mode].setdefault("moved", []).append(
                max((p - q).abs().max().item() for p, q in zip(trainer.model.parameters(), initial))
            )
    for mode in SYNC_MODES:
        report[mode]["local_norms"] = gathered(paths[mode].sync.local_norms) if mode != "ddp" else None
        report[mode]["vs_allreduce"] = max(
            (p - q).abs().max().item()
            for p, q in zip(paths[mode].model.parameters(), paths["allreduce"].model.parameters())
        )
    return report


@pytest.fixture(scope="module")
def sync_paths(tmp_path_factory) -> list[dict]:
    return two_ranks("sync", tmp_path_factory.mktemp("sync"))


def test_each_rank_draws_its_own_slice_and_normalises_by_the_global_token_count(sync_paths):
    report = sync_paths[0]
    rank0, rank1 = report["local_counts"]
    assert rank0 != rank1  # different slices of the data
    assert report["global_counts"] == [a + b for a, b in zip(rank0, rank1)] == report["reference_counts"]


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_the_initialisation_diverged_and_the_start_broadcast_made_it_rank_zeros(sync_paths, mode):
    report = sync_paths[0]
    before, after = report[mode]["before"], report[mode]["after"]
    random = [not constant for constant in report["constant_init"]]
    assert sum(random) >= len(random) // 3
    equal = [index for index, (a, b, r) in enumerate(zip(*before, random)) if r and a == b]
    assert not equal, f"parameters {equal} were initialised alike on both ranks"
    assert after[0] == after[1] == before[0] == report["reference_init"]


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_sync_path_equals_the_single_process_global_batch_reference_to_1e_12_in_fp64(sync_paths, mode):
    for report in sync_paths:
        path = report[mode]
        assert max(path["param_diff"]) <= 1e-12, path["param_diff"]
        assert max(path["loss_diff"]) <= 1e-12, path["loss_diff"]
        assert min(path["moved"]) > 1e-6  # the steps really moved the weights: the comparison is not vacuous
        assert path["vs_allreduce"] <= 1e-12  # the no-wrapper path == the DDP paths


def test_without_the_allreduce_the_ranks_gradients_differ(sync_paths):
    """What the sync is for: each rank's own accumulated gradient differs from the other's."""
    for mode in ("allreduce", "ddp+allreduce"):
        rank0, rank1 = sync_paths[0][mode]["local_norms"]
        assert all(abs(a - b) > 1e-6 for a, b in zip(rank0, rank1)), (rank0, rank1)


WORKERS = {"zero1": zero1_worker, "sync": sync_worker}
