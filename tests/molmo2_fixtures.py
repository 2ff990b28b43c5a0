"""Hand-built tiny Molmo2 inputs and models for the model tests (no collator, no tokenizer).

An image is one or two crops (a low-res view, optionally a high-res one) of the config's patch grid. Each crop
pools 2x2 windows of its grid padded (bottom/right) to even size — for the tiny 3x3 grid, three of its four
tokens have invalid (-1) slots — and its tokens are laid out as the hub processor lays out a crop: a start
token, rows of <im_patch> each closed by <im_col>, an end token. Works for any geometry (4B: 27x27 -> 14x14).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from engine.molmo2.declaration import PROFILES
from engine.molmo2.model.batch import IGNORE_INDEX, ARBatch, PrefixInputs, SuffixInputs
from engine.molmo2.model.config import Molmo2Config
from engine.molmo2.model.model import Molmo2Model, init_weights
from engine.molmo2.run_config import Molmo2RunConfig, resolve
from engine.molmo2.runner import Molmo2Runner
from engine.molmo2.switches import BASELINE, Switches
from engine.molmo2.train.step import TrainConfig

PAD_ID = 1  # any base-vocabulary id: padding is masked, never read
STATE_SLOT_ID = 7  # the token whose embedding receives the projected robot state
SUFFIX_END_ID = 9


def tiny_config() -> Molmo2Config:
    return Molmo2Config.named("tiny")


def tiny_model(seed: int = 0, switches: Switches = BASELINE, config: Molmo2Config | None = None) -> Molmo2Model:
    """A tiny model with EVERY parameter random (norm weights around 1, non-zero biases, non-zero state_proj),
    so that a swapped or skipped weight shows up in any comparison."""
    model = Molmo2Model(config or tiny_config(), switches)
    init_weights(model, seed, std=0.1)  # wide enough that image features and every layer move the logits
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.startswith("state_proj"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # norm weights
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return model


def crop_pooling(crop_index: int, grid: tuple[int, int]) -> torch.Tensor:
    """[tokens, 4] indices of one crop's 2x2 windows over its grid padded (bottom/right) to even size."""
    rows, cols = grid
    base = crop_index * rows * cols
    out = []
    for r in range(0, rows + rows % 2, 2):
        for c in range(0, cols + cols % 2, 2):
            window = []
            for i in (0, 1):
                for j in (0, 1):
                    y, x = r + i, c + j
                    window.append(base + y * cols + x if y < rows and x < cols else -1)
            out.append(window)
    return torch.tensor(out, dtype=torch.long)


def crop_tokens(config: Molmo2Config, start: str, pooled: tuple[int, int]) -> list[int]:
    rows, cols = pooled
    ids = [config.token_id(start)]
    for _ in range(rows):
        ids += [config.image_patch_id] * cols + [config.token_id("image_col")]
    return ids + [config.token_id("image_end")]


@dataclass(frozen=True)
class Row:
    """One sample: `images` images (each a low-res crop, plus a high-res crop if `two_crops`), `text` prompt
    tokens with the state slot among them, then a suffix of `aux` text tokens and `fast` FAST tokens."""

    images: int = 1
    text: int = 4
    aux: int = 2
    fast: int = 3
    two_crops: bool = False


def make_batch(config: Molmo2Config, rows: list[Row], seed: int = 0) -> ARBatch:
    """Prefix LEFT-padded, suffix RIGHT-padded, labels = next suffix token (IGNORE at the end and at pads)."""
    g = torch.Generator().manual_seed(seed)
    V = config.text.vocab_size
    grid = config.vision.grid
    pooled = ((grid[0] + 1) // 2, (grid[1] + 1) // 2)

    def text_ids(n: int) -> list[int]:
        return torch.randint(10, V, (n,), generator=g).tolist()

    prefixes: list[list[int]] = []
    types, state_positions, pooling, grids, n_crops_per_image, suffixes, actions = [], [], [], [], [], [], []
    crop = 0
    for row in rows:
        ids: list[int] = []
        for _ in range(row.images):
            ids += text_ids(2)  # the template's "Image i" label: text between two images of a row
            ids += crop_tokens(config, "low_res_image_start", pooled)
            pooling.append(crop_pooling(crop, grid))
            crop += 1
            if row.two_crops:
                ids += crop_tokens(config, "image_start", pooled)
                pooling.append(crop_pooling(crop, grid))
                crop += 1
            grids.append([*pooled, *pooled] if row.two_crops else [*pooled, 0, 0])
            n_crops_per_image.append(2 if row.two_crops else 1)
        prompt = text_ids(row.text)
        state_at = len(ids) + row.text // 2
        prompt[row.text // 2] = STATE_SLOT_ID
        ids += prompt
        prefixes.append(ids)
        types.append([1 if t in config.image_token_ids else 0 for t in ids])
        state_positions.append(state_at)
        fast = (config.fast_block_base + torch.randint(0, config.fast_vocab_size, (row.fast,), generator=g)).tolist()
        suffixes.append((text_ids(row.aux), fast))
        actions.append(torch.randn(4, 2, generator=g))

    P = max(len(p) for p in prefixes)
    pad = [P - len(p) for p in prefixes]
    prefix = PrefixInputs(
        input_ids=torch.tensor([[PAD_ID] * k + p for k, p in zip(pad, prefixes)]),
        attention_mask=torch.tensor([[False] * k + [True] * len(p) for k, p in zip(pad, prefixes)]),
        mm_token_type_ids=torch.tensor([[0] * k + t for k, t in zip(pad, types)]),
        pixel_values=torch.rand(crop, config.vision.num_patches, config.vision.patch_dim, generator=g) * 2 - 1,
        image_token_pooling=torch.cat(pooling) if pooling else torch.zeros(0, 4, dtype=torch.long),
        image_grids=torch.tensor(grids, dtype=torch.long).reshape(-1, 4),
        image_num_crops=torch.tensor(n_crops_per_image, dtype=torch.long),
        state=torch.randn(len(rows), config.state_dim, generator=g),
        state_positions=torch.tensor([k + s for k, s in zip(pad, state_positions)]),
    )

    T = max(len(a) + len(f) + 1 for a, f in suffixes)
    ids, mask, labels, action_mask = [], [], [], []
    for aux, fast in suffixes:
        seq = aux + fast + [SUFFIX_END_ID]
        n = len(seq)
        ids.append(seq + [PAD_ID] * (T - n))
        mask.append([True] * n + [False] * (T - n))
        targets = seq[1:] + [IGNORE_INDEX] * (T - n + 1)
        labels.append(targets)
        action_mask.append([t >= config.fast_block_base for t in targets])
    suffix = SuffixInputs(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        labels=torch.tensor(labels),
        action_mask=torch.tensor(action_mask),
    )
    return ARBatch(prefix=prefix, suffix=suffix, actions=torch.stack(actions), n_cameras=tuple(r.images for r in rows))


def joined(batch: ARBatch) -> dict[str, torch.Tensor]:
    """Prefix + suffix as ONE sequence per row (the keystone oracle's monolithic input): forward() kwargs."""
    p, s = batch.prefix, batch.suffix
    return {
        "input_ids": torch.cat([p.input_ids, s.input_ids], 1),
        "attention_mask": torch.cat([p.attention_mask, s.attention_mask], 1),
        "mm_token_type_ids": torch.cat([p.mm_token_type_ids, torch.zeros_like(s.input_ids)], 1),
        "pixel_values": p.pixel_values,
        "image_token_pooling": p.image_token_pooling,
        "state": p.state,
        "state_positions": p.state_positions,
    }


def prefix_kwargs(prefix: PrefixInputs) -> dict[str, torch.Tensor]:
    return {
        "input_ids": prefix.input_ids,
        "attention_mask": prefix.attention_mask,
        "mm_token_type_ids": prefix.mm_token_type_ids,
        "pixel_values": prefix.pixel_values,
        "image_token_pooling": prefix.image_token_pooling,
        "state": prefix.state,
        "state_positions": prefix.state_positions,
    }


def run_config(profile: str = "cpu-tiny", **raw: Any) -> Molmo2RunConfig:
    """The effective config of `raw` on a profile under its current defaults (the CPU's: padded chunks, eager)."""
    return resolve(PROFILES[profile], raw)


def make_runner(profile: str = "cpu-tiny", seed: int = 0, **raw: Any) -> Molmo2Runner:
    return Molmo2Runner(PROFILES[profile], run_config(profile, **raw), seed=seed)


def data_pool(**raw: Any) -> list:
    """The training steps a cpu-tiny runner with this run config draws (no model loaded)."""
    runner = make_runner(**raw)
    runner.load_data()
    return runner.pool


def train_config(**fields: Any) -> TrainConfig:
    """The step's settings of cpu-tiny's default run config, with `fields` replaced."""
    return dataclasses.replace(TrainConfig.of(run_config()), **fields)
