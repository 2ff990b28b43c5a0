"""Molmo2's image processing for rig frames (transformers' `Molmo2ImageProcessor` and
`Molmo2Processor.replace_image_token` are the behaviour reproduced — facts carried over, code written here).

One image becomes:
- crops: a global view (the whole image resized to crop_size x crop_size, aspect not kept) followed by
  tiling_h x tiling_w high-res crops cut with stride `window` from the image resized to
  (tiling * window + margins) per side; pixels bilinear-resized (antialias off, rounded back to uint8 as the
  reference does) and normalised to [-1, 1] (mean = std = 0.5);
- patches: each crop as (crop_size / patch)^2 patch vectors, row-major, each (row-in-patch, col-in-patch,
  channel) flattened;
- pooling indices: for each pooled token, pool_h * pool_w indices into the image's flattened (crops x patches)
  features, -1 where invalid. The patch-index grid is padded to a multiple of the pool size with -1 (split
  padding: floor half before, ceil half after, so a single pad row/column goes at the bottom/right) and grouped
  row-major. Low-res tokens first, then high-res, whose grid omits the overlap margins between crops;
- the token ids: `<low_res_im_start>` + rows x (cols x `<im_patch>` [+ `<im_col>`]) + `<im_end>`, then
  `<im_start>` + rows x (cols x `<im_patch>` + `<im_col>`) + `<im_end>`.

Token count at the 4B operating point (max_crops = 1): the tiling is 1x1 and the canvas 1 * 266 + 112 = 378 px,
so both views are 27x27 patches -> 14x14 = 196 pooled tokens each (392 features). The token string is
2 + 14 * 15 = 212 (low-res) + 212 (high-res) = 424 ids with transformers' defaults (the hub processor's
`get_image_tokens`), but the hub checkpoint's processor_config.json sets `use_single_crop_col_tokens: false`
(noted in transformers' tests/models/molmo2/test_processing_molmo2.py), which drops the 14 low-res `<im_col>`
ids: 2 + 196 = 198 + 212 = 410, the "410 image tokens/camera" of the AR recipe
(registrations/molmo2-ar-40k.toml). `ImageGeometry.for_4b()` follows the hub (low_res_col_tokens=False).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class ImageGeometry:
    crop_size: int  # side of a square crop in pixels: the ViT's input
    patch_size: int
    pooling: tuple[int, int] = (2, 2)  # (rows, cols) of patches pooled into one token
    overlap_margins: tuple[int, int] = (4, 4)  # patches dropped at interior crop edges: (left/top, right/bottom)
    high_res_col_tokens: bool = True  # transformers' `image_use_col_tokens`
    low_res_col_tokens: bool = True  # `use_single_crop_col_tokens` (None there means "as high-res")
    low_res_start_token: bool = True  # `use_single_crop_start_token`: open the low-res view with <low_res_im_start>

    def __post_init__(self) -> None:
        if self.patch_size < 1 or self.crop_size < self.patch_size or self.crop_size % self.patch_size:
            raise ValueError(
                f"ImageGeometry crop_size={self.crop_size}, patch_size={self.patch_size}; allowed: crop_size a "
                "positive multiple of patch_size"
            )
        if len(self.pooling) != 2 or min(self.pooling) < 1:
            raise ValueError(f"ImageGeometry.pooling = {self.pooling!r}; allowed: (rows, cols), each >= 1")
        if len(self.overlap_margins) != 2 or min(self.overlap_margins) < 0:
            raise ValueError(f"ImageGeometry.overlap_margins = {self.overlap_margins!r}; allowed: (left, right) >= 0")
        if self.window_patches < 1:
            raise ValueError(
                f"ImageGeometry.overlap_margins = {self.overlap_margins} leave no window in a {self.crop_patches}-"
                f"patch crop; allowed: left + right < {self.crop_patches}"
            )

    @classmethod
    def for_4b(cls) -> "ImageGeometry":
        """allenai/Molmo2-4B: preprocessor_config.json + the hub processor_config's token options."""
        return cls(crop_size=378, patch_size=14, pooling=(2, 2), overlap_margins=(4, 4), low_res_col_tokens=False)

    @classmethod
    def for_tiny(cls) -> "ImageGeometry":
        """42 px crops: 3x3 patches, so 2x2 pooling has partial groups; 1-patch margins keep a 1-patch window."""
        return cls(crop_size=42, patch_size=14, pooling=(2, 2), overlap_margins=(1, 1), low_res_col_tokens=False)

    @property
    def crop_patches(self) -> int:
        return self.crop_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.crop_patches**2

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * 3

    @property
    def window_patches(self) -> int:
        return self.crop_patches - sum(self.overlap_margins)

    @property
    def window_px(self) -> int:
        return self.window_patches * self.patch_size

    @property
    def margin_px(self) -> int:
        return sum(self.overlap_margins) * self.patch_size


@dataclass(frozen=True)
class ImageTokenIds:
    """The special ids an image's token string is made of."""

    im_start: int
    im_end: int
    im_patch: int
    im_col: int
    low_res_im_start: int


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # float32 [n_crops, n_patches, patch_dim]; the global view first
    pooling: torch.Tensor  # long [n_tokens, pool_h * pool_w]: indices into this image's (crops x patches), -1 invalid
    grid: tuple[int, int, int, int]  # pooled (low-res rows, cols, high-res rows, cols)
    tiling: tuple[int, int]  # high-res crops (rows, cols)

    @property
    def n_crops(self) -> int:
        return int(self.pixel_values.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.pooling.shape[0])


def select_tiling(height: int, width: int, window_px: int, max_crops: int) -> tuple[int, int]:
    """The (rows, cols) tiling of <= max_crops windows for an image of (height, width) usable pixels.

    Candidates are ordered by crop count, then rows. If every candidate must shrink the image, take the one that
    shrinks it least; otherwise the one that upscales it least. Scales are float32 quotients, as in the
    reference, so near-ties resolve identically."""
    if max_crops < 1:
        raise ValueError(f"max_crops = {max_crops}; allowed: >= 1")
    candidates = sorted(
        ((h, w) for h, w in itertools.product(range(1, max_crops + 1), repeat=2) if h * w <= max_crops),
        key=lambda t: (t[0] * t[1], t[0]),
    )
    resolutions = (np.array(candidates, dtype=np.int64) * window_px).astype(np.float32)
    scales = (resolutions / np.array([height, width], dtype=np.float32)).min(axis=1)
    if (scales < 1).all():
        return candidates[int(np.argmax(scales))]
    return candidates[int(np.argmin(np.where(scales < 1, np.float32(1e10), scales)))]


def pool_windows(index_grid: torch.Tensor, pooling: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """[h, w] patch indices -> ([rows * cols, ph * pw] row-major windows, rows, cols), padded with -1."""
    ph, pw = pooling
    pad_h = -index_grid.shape[0] % ph
    pad_w = -index_grid.shape[1] % pw
    grid = F.pad(index_grid, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2), value=-1)
    rows, cols = grid.shape[0] // ph, grid.shape[1] // pw
    windows = grid.reshape(rows, ph, cols, pw).permute(0, 2, 1, 3).reshape(rows * cols, ph * pw)
    return windows, rows, cols


def high_res_index_grid(tiling: tuple[int, int], geometry: ImageGeometry) -> torch.Tensor:
    """[canvas rows, canvas cols] (in patches) of indices into the high-res crops' flattened patches, the
    overlap margins between neighbouring crops left out (each canvas patch is taken from one crop only)."""
    th, tw = tiling
    cp = geometry.crop_patches
    left, right = geometry.overlap_margins
    grid = torch.arange(th * tw * cp * cp, dtype=torch.long).reshape(th, tw, cp, cp)
    if left:
        grid[1:, :, :left, :] = -1  # top rows of every crop below the first row of crops
        grid[:, 1:, :, :left] = -1  # left columns of every crop right of the first column
    if right:
        grid[:-1, :, cp - right :, :] = -1
        grid[:, :-1, :, cp - right :] = -1
    grid = grid.permute(0, 2, 1, 3).reshape(-1)
    rows = th * geometry.window_patches + left + right
    cols = tw * geometry.window_patches + left + right
    return grid[grid >= 0].reshape(rows, cols)


def _resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 [3, H, W] -> normalised float32 [3, h, w]: bilinear (antialias off) in float, rounded and clamped
    back to uint8 bytes (as the reference does), then (x - 127.5) / 127.5 (its fused /255, -0.5, /0.5)."""
    if tuple(image.shape[1:]) != size:  # at the same size bilinear is the identity (the reference skips it too)
        resized = F.interpolate(image[None].float(), size=size, mode="bilinear", align_corners=False, antialias=False)
        image = resized[0].round().clamp(0, 255).to(torch.uint8)
    return (image.float() - 127.5) / 127.5


def _to_patches(crops: torch.Tensor, patch: int) -> torch.Tensor:
    """[n, S, S, 3] -> [n, (S/patch)^2, patch * patch * 3], patch vectors (row, col, channel)."""
    n, s, _, c = crops.shape
    k = s // patch
    return crops.reshape(n, k, patch, k, patch, c).transpose(2, 3).reshape(n, k * k, patch * patch * c)


def process_image(frame: torch.Tensor, geometry: ImageGeometry, max_crops: int) -> ProcessedImage:
    """A uint8 [H, W, 3] frame -> its crops, pooling indices and grid."""
    if frame.dtype != torch.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
        raise ValueError(f"process_image expects a uint8 [H, W, 3] frame; got {frame.dtype} {tuple(frame.shape)}")
    height, width = int(frame.shape[0]), int(frame.shape[1])
    chw = frame.permute(2, 0, 1)
    tiling = select_tiling(height - geometry.margin_px, width - geometry.margin_px, geometry.window_px, max_crops)
    canvas_size = (tiling[0] * geometry.window_px + geometry.margin_px,
                   tiling[1] * geometry.window_px + geometry.margin_px)  # fmt: skip
    crop, window = geometry.crop_size, geometry.window_px
    canvas = _resize(chw, canvas_size)
    high_res = canvas.unfold(1, crop, window).unfold(2, crop, window)  # [3, th, tw, crop, crop]
    high_res = high_res.permute(1, 2, 3, 4, 0).reshape(tiling[0] * tiling[1], crop, crop, 3)
    global_view = canvas if canvas_size == (crop, crop) else _resize(chw, (crop, crop))
    crops = torch.cat([global_view.permute(1, 2, 0)[None], high_res])
    pixel_values = _to_patches(crops, geometry.patch_size).contiguous()

    cp = geometry.crop_patches
    low_pool, low_rows, low_cols = pool_windows(torch.arange(cp * cp, dtype=torch.long).reshape(cp, cp),
                                                geometry.pooling)  # fmt: skip
    high_pool, high_rows, high_cols = pool_windows(high_res_index_grid(tiling, geometry), geometry.pooling)
    high_pool = torch.where(high_pool >= 0, high_pool + geometry.n_patches, -1)  # after the global crop
    return ProcessedImage(
        pixel_values=pixel_values,
        pooling=torch.cat([low_pool, high_pool]),
        grid=(low_rows, low_cols, high_rows, high_cols),
        tiling=tiling,
    )


def image_token_ids(grid: tuple[int, int, int, int], ids: ImageTokenIds, geometry: ImageGeometry) -> list[int]:
    """The id string that stands for one image in the prompt; its `<im_patch>` ids match the pooled tokens,
    low-res first, row-major."""
    low_rows, low_cols, high_rows, high_cols = grid
    low_row = [ids.im_patch] * low_cols + ([ids.im_col] if geometry.low_res_col_tokens else [])
    high_row = [ids.im_patch] * high_cols + ([ids.im_col] if geometry.high_res_col_tokens else [])
    low_start = ids.low_res_im_start if geometry.low_res_start_token else ids.im_start
    return ([low_start] + low_row * low_rows + [ids.im_end]
            + [ids.im_start] + high_row * high_rows + [ids.im_end])  # fmt: skip


@dataclass(frozen=True)
class ImageBatch:
    """Every image of a batch, in order, in the layout of `PrefixInputs` (see batch.py)."""

    pixel_values: torch.Tensor  # [n_crops_total, n_patches, patch_dim]
    image_token_pooling: torch.Tensor  # [n_tokens_total, pool_h * pool_w], indices into the batch's patches
    image_grids: torch.Tensor  # [n_images, 4]
    image_num_crops: torch.Tensor  # [n_images]


def batch_images(images: list[ProcessedImage], geometry: ImageGeometry) -> ImageBatch:
    """Concatenate images, shifting each image's pooling indices by the patches of the images before it."""
    if not images:
        raise ValueError("batch_images needs at least one image")
    pooled, offset = [], 0
    for image in images:
        pooled.append(torch.where(image.pooling >= 0, image.pooling + offset, -1))
        offset += image.n_crops * geometry.n_patches
    return ImageBatch(
        pixel_values=torch.cat([image.pixel_values for image in images]),
        image_token_pooling=torch.cat(pooled),
        image_grids=torch.tensor([image.grid for image in images], dtype=torch.long),
        image_num_crops=torch.tensor([image.n_crops for image in images], dtype=torch.long),
    )
