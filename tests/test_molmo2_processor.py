"""The Molmo2 image processor: parity with transformers' implementation, and its layout invariants.

Parity. transformers' `Molmo2ImageProcessor` is a `TorchvisionBackend`: torchvision is not installed here (and
no build of it matches this torch), so the processor as shipped cannot run — its first call fails in
`convert_to_rgb` (`tvF` undefined). Everything Molmo2-specific in it (tiling choice, canvas, unfold into crops,
margin-dropping patch-index grid, pooling windows, offsets, grids) is plain torch, so the parity test runs
transformers' own `_preprocess` with the two torchvision primitives it calls supplied by torch: `resize`
(torchvision's bilinear resize of a float tensor with antialias off is `F.interpolate(mode="bilinear",
align_corners=False)`) and `normalize` ((x - mean) / std). Token strings come from transformers'
`Molmo2Processor.replace_image_token`, which is pure string building.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO
from torch.nn import functional as F

from engine.molmo2.data.processor import (
    ImageGeometry,
    ImageTokenIds,
    batch_images,
    high_res_index_grid,
    image_token_ids,
    pool_windows,
    process_image,
    select_tiling,
)

sys.path.insert(0, str(REPO / "bench"))
from molmo2_peer import peer_image_token_pooling  # noqa: E402

IDS = ImageTokenIds(im_start=151936, im_end=151937, im_patch=151938, im_col=151939, low_res_im_start=151940)
TOKEN_STRINGS = {"<im_start>": IDS.im_start, "<im_end>": IDS.im_end, "<im_patch>": IDS.im_patch,
                 "<im_col>": IDS.im_col, "<low_res_im_start>": IDS.low_res_im_start}  # fmt: skip
TINY, FOUR_B = ImageGeometry.for_tiny(), ImageGeometry.for_4b()


def random_frame(height: int, width: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


# ---------------------------------------------------------------------------------------------------- parity
@pytest.fixture(scope="module")
def reference():
    image_module = pytest.importorskip("transformers.models.molmo2.image_processing_molmo2")
    text_module = importlib.import_module("transformers.models.molmo2.processing_molmo2")
    from transformers.image_utils import PILImageResampling, SizeDict

    class TorchPrimitives(image_module.Molmo2ImageProcessor):
        def resize(self, image, size, resample=None, antialias=True, **kwargs):
            return F.interpolate(image, size=(size.height, size.width), mode="bilinear", align_corners=False,
                                 antialias=antialias)  # fmt: skip

        def normalize(self, image, mean, std, inplace=False, **kwargs):
            mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
            return (image - mean) / std

    processor = TorchPrimitives()

    def images(frames, geometry, max_crops):
        return processor._preprocess(
            images=[f.permute(2, 0, 1).contiguous() for f in frames],
            do_resize=True,
            size=SizeDict(height=geometry.crop_size, width=geometry.crop_size),
            resample=PILImageResampling.BILINEAR,
            do_rescale=True,
            rescale_factor=1 / 255,
            do_normalize=True,
            image_mean=(0.5, 0.5, 0.5),
            image_std=(0.5, 0.5, 0.5),
            do_convert_rgb=False,
            max_crops=max_crops,
            overlap_margins=list(geometry.overlap_margins),
            patch_size=geometry.patch_size,
            pooling_size=list(geometry.pooling),
            disable_grouping=False,
            return_tensors=None,
        )

    def tokens(grid, geometry):
        flags = SimpleNamespace(image_use_col_tokens=geometry.high_res_col_tokens,
                                use_single_crop_col_tokens=geometry.low_res_col_tokens,
                                use_single_crop_start_token=geometry.low_res_start_token)  # fmt: skip
        text = text_module.Molmo2Processor.replace_image_token(flags, {"image_grids": [list(grid)]}, 0)
        return [TOKEN_STRINGS[t + ">"] for t in text.split(">")[:-1]]

    return SimpleNamespace(images=images, tokens=tokens)


@pytest.mark.parametrize(
    "geometry, sizes, max_crops",
    [
        (FOUR_B, [(480, 640), (378, 378)], 1),  # the operating point: a rig frame and a crop-sized one, 2 cameras
        (FOUR_B, [(480, 640), (300, 900), (150, 200)], 8),  # multi-crop tilings with overlap margins
        (TINY, [(42, 42), (60, 30), (100, 70), (20, 90)], 4),
    ],
)
def test_parity_with_transformers(reference, geometry, sizes, max_crops):
    frames = [random_frame(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    expected = reference.images(frames, geometry, max_crops)
    processed = [process_image(f, geometry, max_crops) for f in frames]
    ours = batch_images(processed, geometry)
    assert torch.equal(ours.pixel_values, expected["pixel_values"])
    assert torch.equal(peer_image_token_pooling(ours), expected["image_token_pooling"].long())
    assert torch.equal(ours.image_grids, expected["image_grids"].long())
    assert torch.equal(ours.image_num_crops, expected["image_num_crops"].long())
    for image in processed:
        for flags in ({}, {"low_res_col_tokens": not geometry.low_res_col_tokens}, {"low_res_start_token": False}):
            g = dataclasses.replace(geometry, **flags)
            assert image_token_ids(image.grid, IDS, g) == reference.tokens(image.grid, g)


# ------------------------------------------------------------------------------------------------ invariants
def expected_high_res_indices(tiling, geometry) -> set[int]:
    """Every high-res patch except the overlap margins between neighbouring crops, derived from the rule."""
    th, tw = tiling
    cp = geometry.crop_patches
    left, right = geometry.overlap_margins
    kept = set()
    for i, j, r, c in itertools.product(range(th), range(tw), range(cp), range(cp)):
        dropped = (
            (i > 0 and r < left)
            or (j > 0 and c < left)
            or (i < th - 1 and r >= cp - right)
            or (j < tw - 1 and c >= cp - right)
        )
        if not dropped:
            kept.add(((i * tw + j) * cp + r) * cp + c)
    return kept


@pytest.mark.parametrize("geometry", [TINY, FOUR_B, ImageGeometry(crop_size=70, patch_size=14, pooling=(3, 2),
                                                                   overlap_margins=(2, 1))])  # fmt: skip
def test_high_res_pooling_covers_every_kept_patch_once(geometry):
    for th, tw in itertools.product(range(1, 5), repeat=2):
        grid = high_res_index_grid((th, tw), geometry)
        assert grid.shape == (th * geometry.window_patches + sum(geometry.overlap_margins),
                              tw * geometry.window_patches + sum(geometry.overlap_margins))  # fmt: skip
        windows, rows, cols = pool_windows(grid, geometry.pooling)
        assert windows.shape == (rows * cols, geometry.pooling[0] * geometry.pooling[1])
        assert (rows, cols) == (-(-grid.shape[0] // geometry.pooling[0]), -(-grid.shape[1] // geometry.pooling[1]))
        valid = windows[windows >= 0].tolist()
        assert len(valid) == len(set(valid))  # each patch pooled once
        assert set(valid) == expected_high_res_indices((th, tw), geometry)
        assert bool((windows >= 0).any(dim=1).all())  # no token is all padding (the model would drop it)


def test_pooling_pads_bottom_right_and_groups_row_major():
    windows, rows, cols = pool_windows(torch.arange(9).reshape(3, 3), (2, 2))
    assert (rows, cols) == (2, 2)
    assert windows.tolist() == [[0, 1, 3, 4], [2, -1, 5, -1], [6, 7, -1, -1], [8, -1, -1, -1]]


def test_4b_one_crop_counts():
    """424 ids / 392 features per image with transformers' defaults; the hub's processor config drops the
    low-res <im_col> ids, giving 410."""
    image = process_image(random_frame(480, 640, 0), FOUR_B, max_crops=1)
    assert image.tiling == (1, 1) and image.n_crops == 2
    assert image.grid == (14, 14, 14, 14)
    assert image.n_tokens == 392
    ids = image_token_ids(image.grid, IDS, FOUR_B)
    assert len(ids) == 410 and ids.count(IDS.im_patch) == 392
    defaults = ImageGeometry(crop_size=378, patch_size=14)
    assert len(image_token_ids(image.grid, IDS, defaults)) == 424


@pytest.mark.parametrize("geometry, max_crops", [(TINY, 1), (TINY, 6), (FOUR_B, 1), (FOUR_B, 3)])
def test_token_string_matches_pooling(geometry, max_crops):
    for seed, (h, w) in enumerate([(geometry.crop_size, geometry.crop_size), (90, 50), (240, 320)]):
        image = process_image(random_frame(h, w, seed), geometry, max_crops)
        low_rows, low_cols, high_rows, high_cols = image.grid
        ids = image_token_ids(image.grid, IDS, geometry)
        assert ids.count(IDS.im_patch) == image.n_tokens == low_rows * low_cols + high_rows * high_cols
        assert ids[0] == IDS.low_res_im_start and ids[-1] == IDS.im_end
        assert ids.count(IDS.im_start) == 1 and ids.count(IDS.im_end) == 2
        assert ids.count(IDS.im_col) == high_rows + (low_rows if geometry.low_res_col_tokens else 0)
        assert image.n_crops == 1 + image.tiling[0] * image.tiling[1] <= 1 + max_crops
        assert image.pixel_values.shape == (image.n_crops, geometry.n_patches, geometry.patch_dim)
        low = image.pooling[: low_rows * low_cols]
        assert sorted(low[low >= 0].tolist()) == list(range(geometry.n_patches))  # the global crop, all of it
        assert int(image.pooling.max()) < image.n_crops * geometry.n_patches


def test_patch_vectors_are_row_col_channel():
    """A frame at crop size is not resized: patch k of the global crop holds pixels of patch-row k // n,
    patch-col k % n, flattened (row-in-patch, col-in-patch, channel), normalised (x - 127.5) / 127.5."""
    frame = random_frame(42, 42, 3)
    image = process_image(frame, TINY, max_crops=1)
    normalised = (frame.float() - 127.5) / 127.5
    for k in range(TINY.n_patches):
        r, c = divmod(k, TINY.crop_patches)
        block = normalised[r * 14 : (r + 1) * 14, c * 14 : (c + 1) * 14, :]
        assert torch.equal(image.pixel_values[0, k], block.reshape(-1))
    assert image.pixel_values.min() >= -1 and image.pixel_values.max() <= 1
    assert torch.equal(image.pixel_values[1], image.pixel_values[0])  # 1x1 tiling of a crop-sized frame


def test_batch_offsets_pooling_by_the_patches_before():
    first = process_image(random_frame(42, 42, 0), TINY, 4)
    second = process_image(random_frame(80, 40, 1), TINY, 4)
    batch = batch_images([first, second], TINY)
    offset = first.n_crops * TINY.n_patches
    tail = batch.image_token_pooling[first.n_tokens :]
    assert torch.equal(tail, torch.where(second.pooling >= 0, second.pooling + offset, -1))
    assert batch.pixel_values.shape[0] == int(batch.image_num_crops.sum())


def test_select_tiling_rules():
    assert select_tiling(266, 266, 266, 1) == (1, 1)
    assert select_tiling(5000, 5000, 266, 8) == (2, 2)  # all candidates shrink: the least-shrinking one
    assert select_tiling(200, 600, 266, 8) == (1, 3)  # smallest upscale that fits
    assert select_tiling(600, 200, 266, 8) == (3, 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"crop_size": 40, "patch_size": 14}, "multiple of patch_size"),
        ({"crop_size": 42, "patch_size": 14, "overlap_margins": (2, 1)}, "leave no window"),
        ({"crop_size": 42, "patch_size": 14, "pooling": (0, 2)}, "pooling"),
    ],
)
def test_invalid_geometry(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ImageGeometry(**kwargs)


def test_process_image_refuses_non_uint8():
    with pytest.raises(ValueError, match="uint8"):
        process_image(torch.zeros(42, 42, 3), TINY, 1)
