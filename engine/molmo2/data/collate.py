"""Rig samples -> `ARBatch` (batch.py), and the FAST tokenizer fitted on rig chunks.

The prefix / suffix contract (what `forward_suffix` and greedy decode rely on):

    prompt  = bos, images, user turn with the state slot, `<|im_end|>\\n<|im_start|>assistant\\n`  (prompt.py)
    target  = aux text ids, FAST ids, `<|im_end|>`                                              (the suffix)

    prefix.input_ids = prompt[:-1]                    LEFT-padded
    suffix.input_ids = [prompt[-1]] + target[:-1]     RIGHT-padded
    suffix.labels    = target                         IGNORE_INDEX at padding

The prompt's last token (the `\\n` that opens the assistant turn) moves from the prefix to the suffix's first
position, so every label is predicted from a suffix position: `labels[b, t]` is the next token after
`suffix.input_ids[b, t]`, and the loss needs only the suffix's logits — no prefix logits, no token fed twice.
Concatenated, [prefix row | suffix row] is exactly prompt + target[:-1] with padding only at the two ends
(left padding keeps the prefix's last real token in the last column). Greedy decode runs the same way: encode
the prefix, feed prompt[-1] (`suffix.input_ids[:, :1]`, the same id in every row), then each predicted token,
until `<|im_end|>`; `prompt.parse_suffix` + `FastTokenizer.decode` turn the generated ids back into actions.

`suffix.action_mask[b, t]` is True where `labels[b, t]` is a FAST id (in [layout.fast_base, layout.fast_end)).
`prefix.state_positions[b]` is the column of the state slot in the padded prefix row;
`prefix.mm_token_type_ids` is 1 exactly on the image-block ids. Images are concatenated in sample order, then
camera order, and their `<im_patch>` ids appear in the same order in the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from engine.molmo2.data.fast import FastTokenizer
from engine.molmo2.data.fast_cache import cached_fit
from engine.molmo2.data.processor import ImageGeometry, ProcessedImage, batch_images, image_token_ids, process_image
from engine.molmo2.data.prompt import TextTokenizer, TokenLayout, assemble_prompt, assemble_suffix
from engine.molmo2.data.rig import STATE_DIM, RigDataset, RigSample
from engine.molmo2.model.batch import IGNORE_INDEX, ARBatch, PrefixInputs, SuffixInputs


@dataclass(frozen=True)
class EncodedSample:
    prompt_ids: tuple[int, ...]
    image_block: tuple[bool, ...]
    state_index: int  # in prompt_ids
    target_ids: tuple[int, ...]
    images: tuple[ProcessedImage, ...]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Collator:
    def __init__(
        self,
        layout: TokenLayout,
        fast_tokenizer: FastTokenizer,
        text_tokenizer: TextTokenizer,
        processor_geometry: ImageGeometry,
        max_crops: int,
        pad_multiple: tuple[int, int] = (1, 1),
    ) -> None:
        if fast_tokenizer.vocab_size > layout.fast_vocab_size:
            raise ValueError(
                f"the FAST tokenizer has {fast_tokenizer.vocab_size} ids; the layout's FAST block holds "
                f"{layout.fast_vocab_size}"
            )
        if max_crops < 1:
            raise ValueError(f"max_crops = {max_crops}; allowed: >= 1")
        self.layout = layout
        self.fast = fast_tokenizer
        self.text = text_tokenizer
        self.geometry = processor_geometry
        self.max_crops = max_crops
        # (prefix, suffix): padded widths are rounded up to these multiples. A compiled decoder specialises on
        # shapes, so fewer distinct widths mean fewer compilations; padding is masked and costs only compute.
        if len(pad_multiple) != 2 or min(pad_multiple) < 1:
            raise ValueError(f"pad_multiple = {pad_multiple}; allowed: two integers >= 1 (prefix, suffix)")
        self.pad_multiple = tuple(pad_multiple)

    def encode(self, sample: RigSample) -> EncodedSample:
        images = tuple(process_image(frame, self.geometry, self.max_crops) for frame in sample.frames)
        kinds = sample.camera_kinds if sample.show_camera_kinds else (None,) * sample.n_cameras
        prompt = assemble_prompt(
            self.layout,
            self.text,
            [image_token_ids(image.grid, self.layout.image_token_ids, self.geometry) for image in images],
            kinds,
            sample.instruction,
            sample.condition,
            generate=(*sample.aux, "actions"),
        )
        target = assemble_suffix(self.layout, self.text, sample.aux, self.fast.encode(sample.actions.numpy()))
        return EncodedSample(prompt.ids, prompt.image_block, prompt.state_index, target, images)

    def __call__(self, samples: Sequence[RigSample]) -> ARBatch:
        if not samples:
            raise ValueError("Collator needs at least one sample")
        shapes = {tuple(s.actions.shape) for s in samples}
        if len(shapes) != 1:
            raise ValueError(f"samples disagree on the action chunk shape: {sorted(shapes)}")
        encoded = [self.encode(s) for s in samples]
        batch_size = len(samples)
        pad = self.layout.pad_id

        prefix_len = _round_up(max(len(e.prompt_ids) - 1 for e in encoded), self.pad_multiple[0])
        prefix_ids = torch.full((batch_size, prefix_len), pad, dtype=torch.long)
        prefix_mask = torch.zeros((batch_size, prefix_len), dtype=torch.bool)
        mm_types = torch.zeros((batch_size, prefix_len), dtype=torch.long)
        state_positions = torch.empty(batch_size, dtype=torch.long)
        suffix_len = _round_up(max(len(e.target_ids) for e in encoded), self.pad_multiple[1])
        suffix_ids = torch.full((batch_size, suffix_len), pad, dtype=torch.long)
        suffix_mask = torch.zeros((batch_size, suffix_len), dtype=torch.bool)
        labels = torch.full((batch_size, suffix_len), IGNORE_INDEX, dtype=torch.long)
        for b, e in enumerate(encoded):
            n = len(e.prompt_ids) - 1
            start = prefix_len - n  # LEFT padding
            prefix_ids[b, start:] = torch.tensor(e.prompt_ids[:-1])
            prefix_mask[b, start:] = True
            mm_types[b, start:] = torch.tensor(e.image_block[:-1], dtype=torch.long)
            state_positions[b] = start + e.state_index
            m = len(e.target_ids)  # RIGHT padding
            suffix_ids[b, :m] = torch.tensor((e.prompt_ids[-1], *e.target_ids[:-1]))
            suffix_mask[b, :m] = True
            labels[b, :m] = torch.tensor(e.target_ids)
        action_mask = (labels >= self.layout.fast_base) & (labels < self.layout.fast_end)

        images = batch_images([image for e in encoded for image in e.images], self.geometry)
        prefix = PrefixInputs(
            input_ids=prefix_ids,
            attention_mask=prefix_mask,
            mm_token_type_ids=mm_types,
            pixel_values=images.pixel_values,
            image_token_pooling=images.image_token_pooling,
            image_grids=images.image_grids,
            image_num_crops=images.image_num_crops,
            state=torch.stack([s.state for s in samples]),
            state_positions=state_positions,
        )
        suffix = SuffixInputs(input_ids=suffix_ids, attention_mask=suffix_mask, labels=labels, action_mask=action_mask)
        return ARBatch(
            prefix=prefix,
            suffix=suffix,
            actions=torch.stack([s.actions for s in samples]),
            n_cameras=tuple(s.n_cameras for s in samples),
        )


@dataclass(frozen=True)
class TokenCounts:
    """Token accounting of one batch (for benchmarks: what the padding costs)."""

    prefix_lengths: tuple[int, ...]  # real prefix tokens per sample
    suffix_lengths: tuple[int, ...]
    image_tokens: tuple[int, ...]  # image-block ids per sample
    action_tokens: tuple[int, ...]  # FAST labels per sample
    prefix_padded: int  # P: the padded prefix width
    suffix_padded: int

    @property
    def prefix_padding_fraction(self) -> float:
        return 1.0 - sum(self.prefix_lengths) / (len(self.prefix_lengths) * self.prefix_padded)

    @property
    def suffix_padding_fraction(self) -> float:
        return 1.0 - sum(self.suffix_lengths) / (len(self.suffix_lengths) * self.suffix_padded)

    @property
    def padding_fraction(self) -> float:
        real = sum(self.prefix_lengths) + sum(self.suffix_lengths)
        return 1.0 - real / (len(self.prefix_lengths) * (self.prefix_padded + self.suffix_padded))


def token_counts(batch: ARBatch) -> TokenCounts:
    p, s = batch.prefix, batch.suffix
    return TokenCounts(
        prefix_lengths=tuple(p.attention_mask.sum(1).tolist()),
        suffix_lengths=tuple(s.attention_mask.sum(1).tolist()),
        image_tokens=tuple(p.mm_token_type_ids.sum(1).tolist()),
        action_tokens=tuple(s.action_mask.sum(1).tolist()),
        prefix_padded=int(p.input_ids.shape[1]),
        suffix_padded=int(s.input_ids.shape[1]),
    )


def make_fast_tokenizer(
    seed: int,
    n_chunks: int,
    cache_path: str | Path | None = None,
    *,
    chunk_len: int = 30,
    action_dim: int = STATE_DIM,
    fps: int = 30,
    scale: float = 10.0,
    vocab_size: int = 1024,
) -> FastTokenizer:
    """FAST fitted on the action chunks of `n_chunks` train-split rig episodes of `seed`.

    Two constant chunks at -1 and +1 join the fit: rig actions lie in [-1, 1], and an orthonormal DCT keeps
    every coefficient within sqrt(T) * max|action|, which those two chunks reach — so any rig chunk (train or
    eval split) is inside the fitted range. With `cache_path`, an existing file is loaded (it must record a fit
    with these arguments), else the fit is saved there. With PREREG_FAST_CACHE set, fits are shared through that
    directory under a key of everything they depend on (fast_cache.py)."""
    fitted_on = (f"rig train split: seed={seed} n_chunks={n_chunks} chunk_len={chunk_len} action_dim={action_dim} "
                 f"fps={fps} + constant -1/+1 chunks; scale={scale} vocab_size={vocab_size}")  # fmt: skip
    if cache_path is not None and Path(cache_path).is_file():
        cached = FastTokenizer.load(cache_path)
        if cached.fitted_on != fitted_on:
            raise ValueError(
                f"{cache_path} holds a FAST tokenizer fitted on [{cached.fitted_on}], not on [{fitted_on}]: remove "
                "it or pick another path"
            )
        return cached

    def fit() -> FastTokenizer:
        dataset = RigDataset(seed, n_chunks, chunk_len=chunk_len, action_dim=action_dim, fps=fps)
        chunks = np.stack([dataset.action_chunk(i) for i in range(n_chunks)])
        bounds = np.stack([np.full((chunk_len, action_dim), v) for v in (-1.0, 1.0)])
        return FastTokenizer.fit(np.concatenate([chunks, bounds]), scale=scale, vocab_size=vocab_size,
                                 fitted_on=fitted_on)  # fmt: skip

    arguments = {"seed": seed, "n_chunks": n_chunks, "chunk_len": chunk_len, "action_dim": action_dim, "fps": fps,
                 "scale": scale, "vocab_size": vocab_size}  # fmt: skip
    tokenizer = cached_fit(arguments, fit, FastTokenizer.load)
    if cache_path is not None:
        tokenizer.save(cache_path)
    return tokenizer
