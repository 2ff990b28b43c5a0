"""Procedural camera frames of a rig scene: flat colours, drawn with numpy masks (no graphics library).

Two projections: camera 0 ("front") looks down on the table (x right, y up the image); camera 1 ("side") looks
along the table (x right, height up, depth y shrinking what is far). Both draw the blocks and the gripper marker
at the robot state's position; the marker is a dark disc whose radius grows with height (front view) and whose
light centre shrinks as the gripper closes, so the state is visible as well as given.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from engine.molmo2.data.rig import RigScene

# Block colours by the name the instruction uses.
COLOURS = {
    "red": (210, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 80, 215),
    "yellow": (225, 200, 40),
    "purple": (140, 60, 185),
    "orange": (235, 130, 30),
}
_TABLE = np.array([150, 120, 90])
_WALL = np.array([175, 182, 192])
_MARKER_DARK = np.array([35, 35, 40])
_MARKER_LIGHT = np.array([215, 215, 215])
_BLOCK_HALF_LENGTH, _BLOCK_HALF_WIDTH, _BLOCK_HEIGHT = 0.12, 0.07, 0.12  # world units
_SIDE_TABLE_ROW, _SIDE_Z_SPAN = 0.8, 0.7  # side view: table line at 80% of the height; z=1 is 70% of it above


def render_frame(
    scene: "RigScene", camera: int, size: tuple[int, int], state: np.ndarray, grasp_z: float
) -> np.ndarray:
    """uint8 [H, W, 3] of `scene` seen by camera `camera` with the gripper at `state` (grasping at `grasp_z`)."""
    height, width = size
    rows = np.arange(height, dtype=np.float64)[:, None]
    cols = np.arange(width, dtype=np.float64)[None, :]
    unit = min(height, width) / 2.0  # pixels per world unit, the same on both axes
    tint = np.array(scene.table_tint)
    image = np.empty((height, width, 3), dtype=np.float64)
    blocks = (scene.target, *scene.distractors)
    if camera == 0:
        image[...] = _TABLE + tint + (rows / height * 20.0)[..., None]  # a little light falloff
        for block in blocks:
            theta = math.pi * block.yaw
            dc = cols - (block.x + 1.0) / 2.0 * (width - 1)
            dr = (1.0 - block.y) / 2.0 * (height - 1) - rows  # "up" in world = towards row 0
            along = dc * math.cos(theta) + dr * math.sin(theta)
            across = -dc * math.sin(theta) + dr * math.cos(theta)
            mask = (np.abs(along) <= _BLOCK_HALF_LENGTH * unit) & (np.abs(across) <= _BLOCK_HALF_WIDTH * unit)
            image[mask] = COLOURS[block.colour]
        centre = ((state[0] + 1.0) / 2.0 * (width - 1), (1.0 - state[1]) / 2.0 * (height - 1))
        radius = (0.05 + 0.06 * state[2]) * unit
    elif camera == 1:
        table_row = _SIDE_TABLE_ROW * (height - 1)
        # A held block rides in the gripper: its bottom is as far above the table as the gripper is above its
        # grasp height.
        held = scene.phase == "lift" and scene.outcome == "success"
        held_height = max(0.0, state[2] - grasp_z) if held else 0.0
        image[...] = np.where((rows >= table_row)[..., None], _TABLE + tint, _WALL + tint)
        for block in sorted(blocks, key=lambda b: -b.y):  # far first, so near blocks occlude far ones
            depth = _depth_scale(block.y)
            theta = math.pi * block.yaw
            half = (_BLOCK_HALF_LENGTH * abs(math.cos(theta)) + _BLOCK_HALF_WIDTH * abs(math.sin(theta))) * depth
            col = (block.x + 1.0) / 2.0 * (width - 1)
            bottom = table_row - (held_height if block is scene.target else 0.0) * _SIDE_Z_SPAN * (height - 1)
            mask = (
                (np.abs(cols - col) <= half * unit) & (rows <= bottom) & (rows >= bottom - _BLOCK_HEIGHT * depth * unit)
            )
            image[mask] = COLOURS[block.colour]
        depth = _depth_scale(state[1])
        centre = ((state[0] + 1.0) / 2.0 * (width - 1), table_row - state[2] * _SIDE_Z_SPAN * (height - 1))
        radius = 0.08 * depth * unit
    else:
        raise ValueError(f"camera {camera}; allowed: 0 (front) or 1 (side)")
    distance = np.hypot(cols - centre[0], rows - centre[1])
    image[distance <= max(radius, 1.0)] = _MARKER_DARK
    opening = 0.25 + 0.45 * (state[5] + 1.0) / 2.0  # fraction of the radius left light: open ring vs closed dot
    image[distance <= radius * opening] = _MARKER_LIGHT
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def _depth_scale(y: float) -> float:
    """Side view perspective: near (y = -1) is drawn 1.25x, far (y = 1) 0.75x."""
    return 1.0 - 0.25 * y
