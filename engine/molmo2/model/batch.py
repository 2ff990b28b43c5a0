"""The tensors that cross from the collator (data side) to the model (compute side).

Image fields follow the layout of transformers' Molmo2 (and of the hub processor), so parity tests can feed
the same tensors to both implementations:
- pixel_values: [n_crops_total, n_patches, patch_dim] — every crop of every image of the batch, in order; a patch
  vector is (row-in-patch, col-in-patch, channel) flattened, values normalised to [-1, 1].
- image_token_pooling: [n_image_tokens_total, 4] — for each pooled image token, 4 indices into the flattened
  (n_crops_total * n_patches) patch features of the batch; -1 marks an invalid slot.
- image_grids: [n_images, 4] — (low-res rows, low-res cols, high-res rows, high-res cols) of pooled tokens.
- image_num_crops: [n_images].
The number of `<im_patch>` ids in `input_ids` equals n_image_tokens_total, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.molmo2.attention.packing import Packing


@dataclass(frozen=True)
class PrefixInputs:
    """Images + prompt + state slot, LEFT-padded: every row's last column is its last real token, where the suffix
    and greedy decode continue."""

    input_ids: torch.Tensor  # [B, P] long; pad positions hold the pad id
    attention_mask: torch.Tensor  # [B, P] bool; False at padding
    mm_token_type_ids: torch.Tensor  # [B, P] long; 1 for image tokens (the image-block mask), else 0
    pixel_values: torch.Tensor  # [n_crops_total, n_patches, patch_dim] float
    image_token_pooling: torch.Tensor  # [n_image_tokens_total, 4] long
    image_grids: torch.Tensor  # [n_images, 4] long
    image_num_crops: torch.Tensor  # [n_images] long
    state: torch.Tensor  # [B, state_dim] float: robot state, projected into the state slot
    state_positions: torch.Tensor  # [B] long: index of the state slot token in each row
    state_rows: torch.Tensor | None = None  # [B] long: the row of each state slot; None: sample b's is row b
    # (a packed chunk, packing.py, holds every sample in row 0)
    image_features: torch.Tensor | None = None  # the frozen tower's output for pixel_values when computed ahead
    # of the embedding (X7 runs the tower before the previous step's update lands); None: computed there

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class SuffixInputs:
    """The loss-bearing suffix: aux text then FAST action tokens then the end token, RIGHT-padded."""

    input_ids: torch.Tensor  # [B, T] long; teacher-forced inputs
    attention_mask: torch.Tensor  # [B, T] bool
    labels: torch.Tensor  # [B, T] long; next-token targets, IGNORE_INDEX where no loss
    action_mask: torch.Tensor  # [B, T] bool; True where the label is a FAST action token


IGNORE_INDEX = -100


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions counting real tokens only, so a left-padded row sees the positions of its unpadded self
    (what transformers' generate feeds: cumsum - 1; pads get 0). RoPE is relative, so this equals the hub's plain
    arange up to rounding — and makes the result independent of how much padding a batch happens to need."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass(frozen=True)
class ARBatch:
    prefix: PrefixInputs
    suffix: SuffixInputs
    actions: torch.Tensor  # [B, chunk_len, action_dim] float: the ground-truth action chunk (for decode MAE)
    n_cameras: tuple[int, ...]  # per sample
    packing: "Packing | None" = None  # packing.py: the samples laid end to end in one row (run config `pack`)

    def to(self, device: torch.device | str) -> "ARBatch":
        def move(obj):
            return type(obj)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(obj).items()})

        return ARBatch(
            prefix=move(self.prefix),
            suffix=move(self.suffix),
            actions=self.actions.to(device),
            n_cameras=self.n_cameras,
            packing=None if self.packing is None else self.packing.to(device),
        )
