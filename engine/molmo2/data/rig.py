"""Synthetic robot-rig episodes with learnable structure (the AR recipe's, scaled down to something we generate).

A scene is a table with a target block (its colour named in the instruction) and one or two distractors, and a
gripper at some point of a pick: `reach` (above the target), `grasp` (down onto it, closing) or `lift`. The
sample is one moment of that pick: 1 or 2 camera frames, the robot state, and the next 30 steps of actions
(1 s at 30 fps) — a minimum-jerk move from the state toward the current subgoal's pose. The chunk is a pure
function of what the sample shows: the target's pose (visible in the frames, picked out by the instruction's
colour), the state, and the subgoal / outcome / smoothness (conditioning fields, also inferable from the
frames and state). So a model can learn it, and its action error can fall.

Poses and actions are 6-d, all in [-1, 1]: x, y (table plane), z (height, [0, 1]), yaw (x pi rad), pitch,
grip (+1 open, -1 closed). `action_dim < 6` keeps the first dimensions.

Determinism: episode i of (seed, split) draws from `np.random.SeedSequence([seed, split_code, i])` — no global
RNG — spawned into one stream for the scene and one for the augmentations, so changing a dropout rate never
changes a scene. The train and eval splits use different split codes, hence disjoint streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Mapping

import numpy as np
import torch

from engine.molmo2.data.rig_render import COLOURS, render_frame

PHASES = ("reach", "grasp", "lift")
OUTCOMES = ("success", "failure")
# Movement duration of one subgoal move, in seconds: the `smoothness` condition. "brisk" is shorter than a
# chunk, so a brisk chunk arrives and holds.
SMOOTHNESS_SECONDS = {"smooth": 1.6, "normal": 1.2, "brisk": 0.9}
CAMERA_KINDS = ("front", "side")  # camera i of an episode has kind CAMERA_KINDS[i]
STATE_DIM = 6
AUX_FIELDS = ("subgoal", "holding", "progress", "event", "visible")
CONDITION_FIELDS = ("subgoal", "outcome", "smoothness")
SPLITS = {"train": 0, "eval": 1}  # the split code mixed into every episode's seed

INSTRUCTION = "pick up the {colour} block"
PARAPHRASES = (
    "grab the {colour} block",
    "lift the {colour} block",
    "pick the {colour} cube up",
    "get the {colour} block off the table",
)

# Subgoal poses relative to the target block (grip: +1 open, -1 closed).
_HOVER_Z, _GRASP_Z, _LIFT_Z = 0.35, 0.05, 0.7
_PITCH = {"reach": -0.6, "grasp": -0.9, "lift": -0.5}
_MISS_OFFSET = 0.12  # a failed grasp closes this far off the block, along its long axis
_ARRIVE_TOL = 0.02  # a chunk "arrives" when its last pose is this close (max-norm) to the subgoal
_OCCLUDE_RADIUS = 0.08  # the gripper marker hides the block centre in the front view within this xy distance
_SUCCESS_RATE = 0.8
_MIN_BLOCK_GAP = 0.3


@dataclass(frozen=True)
class Block:
    colour: str
    x: float
    y: float
    yaw: float  # long-axis angle / pi, in [-0.5, 0.5]


@dataclass(frozen=True)
class RigScene:
    """Everything an episode's frames, state, actions and text follow from."""

    target: Block
    distractors: tuple[Block, ...]
    start: tuple[float, ...]  # the gripper pose before the reach (6-d)
    phase: str  # the subgoal being executed
    phase_fraction: float  # how far into that subgoal's move the state is, [0, 1)
    outcome: str
    smoothness: str
    n_cameras: int
    table_tint: tuple[int, int, int]

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase {self.phase!r}; allowed: {PHASES}")
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome {self.outcome!r}; allowed: {OUTCOMES}")
        if self.smoothness not in SMOOTHNESS_SECONDS:
            raise ValueError(f"smoothness {self.smoothness!r}; allowed: {tuple(SMOOTHNESS_SECONDS)}")
        if not 1 <= self.n_cameras <= len(CAMERA_KINDS):
            raise ValueError(f"n_cameras {self.n_cameras}; allowed: 1..{len(CAMERA_KINDS)}")

    @property
    def camera_kinds(self) -> tuple[str, ...]:
        return CAMERA_KINDS[: self.n_cameras]


def subgoal_pose(scene: RigScene, phase: str) -> np.ndarray:
    t = scene.target
    grip = 1.0 if phase == "reach" else -1.0
    x, y = t.x, t.y
    if phase != "reach" and scene.outcome == "failure":
        x += _MISS_OFFSET * math.cos(math.pi * t.yaw)
        y += _MISS_OFFSET * math.sin(math.pi * t.yaw)
    z = {"reach": _HOVER_Z, "grasp": _GRASP_Z, "lift": _LIFT_Z}[phase]
    return np.array([x, y, z, t.yaw, _PITCH[phase], grip])


def robot_state(scene: RigScene) -> np.ndarray:
    """The pose part-way through the current subgoal's move (linear along its segment)."""
    k = PHASES.index(scene.phase)
    segment_start = np.array(scene.start) if k == 0 else subgoal_pose(scene, PHASES[k - 1])
    goal = subgoal_pose(scene, scene.phase)
    return segment_start + (goal - segment_start) * scene.phase_fraction


def min_jerk(tau: np.ndarray) -> np.ndarray:
    """The minimum-jerk profile 10t^3 - 15t^4 + 6t^5 on [0, 1], held at 0 before and 1 after: C2 everywhere,
    |f''| <= 10 / sqrt(3)."""
    tau = np.clip(tau, 0.0, 1.0)
    return tau**3 * (10.0 - 15.0 * tau + 6.0 * tau**2)


MIN_JERK_MAX_ACCEL = 10.0 / math.sqrt(3.0)


def action_chunk(scene: RigScene, chunk_len: int, fps: int = 30) -> np.ndarray:
    """[chunk_len, 6] absolute poses at 1/fps spacing: a fresh minimum-jerk move from the state to the subgoal."""
    state = robot_state(scene)
    goal = subgoal_pose(scene, scene.phase)
    duration_steps = SMOOTHNESS_SECONDS[scene.smoothness] * fps
    tau = np.arange(1, chunk_len + 1, dtype=np.float64) / duration_steps
    return state[None, :] + (goal - state)[None, :] * min_jerk(tau)[:, None]


def aux_fields(scene: RigScene, chunk: np.ndarray) -> dict[str, str]:
    """The aux text's fields, in AUX_FIELDS order, all determined by the scene and its chunk."""
    k = PHASES.index(scene.phase)
    state = robot_state(scene)
    arrived = bool(np.abs(chunk[-1] - subgoal_pose(scene, scene.phase)).max() < _ARRIVE_TOL)
    events = {"reach": "arrive", "grasp": "grasp" if scene.outcome == "success" else "miss", "lift": "lift-off"}
    occluded = math.hypot(state[0] - scene.target.x, state[1] - scene.target.y) < _OCCLUDE_RADIUS
    return {
        "subgoal": scene.phase,
        "holding": "yes" if scene.phase == "lift" and scene.outcome == "success" else "no",
        "progress": f"{int(round((k + scene.phase_fraction) / len(PHASES) * 10)) * 10}%",
        "event": events[scene.phase] if arrived else "none",
        "visible": "partly" if occluded else "yes",
    }


@dataclass(frozen=True)
class RigAugment:
    """The dropouts of the AR recipe (registrations/molmo2-ar-40k.toml quotes them). Our reading of its
    "conditioning ... (0.1/0.5 dropouts)": each condition field is left out with probability 0.1, and the whole
    conditioning block with probability 0.5."""

    field_dropout: float = 0.1  # each aux field independently left out of the suffix
    aux_dropout: float = 0.0  # the whole aux text left out
    condition_field_dropout: float = 0.1
    condition_dropout: float = 0.5
    instruction_augment: float = 0.5  # a paraphrase instead of the canonical instruction
    camera_kind_dropout: float = 0.1  # the camera-kind labels left out of the prompt

    def __post_init__(self) -> None:
        for f in fields(self):
            p = getattr(self, f.name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"RigAugment.{f.name} = {p!r} is invalid; allowed: a probability in [0, 1]")


SEED003_AUGMENT = RigAugment()
NO_AUGMENT = RigAugment(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class RigSample:
    episode: int
    split: str
    frames: tuple[torch.Tensor, ...]  # per camera: uint8 [H, W, 3]
    camera_kinds: tuple[str, ...]  # per camera
    show_camera_kinds: bool  # False: camera-kind dropout hid the labels for this sample
    state: torch.Tensor  # float32 [6]
    actions: torch.Tensor  # float32 [chunk_len, action_dim]
    instruction: str
    aux: Mapping[str, str]  # AUX_FIELDS order; dropped fields absent
    condition: Mapping[str, str]  # CONDITION_FIELDS order; dropped fields absent

    @property
    def n_cameras(self) -> int:
        return len(self.frames)


class RigDataset:
    """Episodes of one (seed, split); `sample(i)` is a pure function of (seed, split, i) and the parameters."""

    def __init__(
        self,
        seed: int,
        n_episodes: int,
        camera_counts: tuple[int, ...] = (1, 2),
        image_size: int | tuple[int, int] = 42,
        chunk_len: int = 30,
        action_dim: int = STATE_DIM,
        *,
        split: str = "train",
        fps: int = 30,
        augment: RigAugment = SEED003_AUGMENT,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split {split!r}; allowed: {tuple(SPLITS)}")
        if n_episodes < 1:
            raise ValueError(f"n_episodes = {n_episodes}; allowed: >= 1")
        if not camera_counts or any(not 1 <= c <= len(CAMERA_KINDS) for c in camera_counts):
            raise ValueError(f"camera_counts = {camera_counts}; allowed: a non-empty subset of 1..{len(CAMERA_KINDS)}")
        size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        if len(size) != 2 or min(size) < 8:
            raise ValueError(f"image_size = {image_size!r}; allowed: an int or (height, width), each >= 8 px")
        if chunk_len < 2:
            raise ValueError(f"chunk_len = {chunk_len}; allowed: >= 2")
        if not 1 <= action_dim <= STATE_DIM:
            raise ValueError(f"action_dim = {action_dim}; allowed: 1..{STATE_DIM} (the first dims of the pose)")
        if fps < 1:
            raise ValueError(f"fps = {fps}; allowed: >= 1")
        self.seed = seed
        self.n_episodes = n_episodes
        self.camera_counts = tuple(camera_counts)
        self.image_size: tuple[int, int] = size  # type: ignore[assignment]
        self.chunk_len = chunk_len
        self.action_dim = action_dim
        self.split = split
        self.fps = fps
        self.augment = augment

    def __len__(self) -> int:
        return self.n_episodes

    def _streams(self, i: int) -> tuple[np.random.Generator, np.random.Generator]:
        if not 0 <= i < self.n_episodes:
            raise IndexError(f"episode {i} outside [0, {self.n_episodes})")
        scene_seq, augment_seq = np.random.SeedSequence([self.seed, SPLITS[self.split], i]).spawn(2)
        return np.random.default_rng(scene_seq), np.random.default_rng(augment_seq)

    def scene(self, i: int) -> RigScene:
        return _sample_scene(self._streams(i)[0], self.camera_counts)

    def action_chunk(self, i: int) -> np.ndarray:
        """Episode i's action chunk [chunk_len, action_dim] without rendering (for fitting FAST)."""
        return action_chunk(self.scene(i), self.chunk_len, self.fps)[:, : self.action_dim]

    def sample(self, i: int) -> RigSample:
        scene_rng, augment_rng = self._streams(i)
        return self._annotate(_sample_scene(scene_rng, self.camera_counts), augment_rng, episode=i)

    __getitem__ = sample

    def _annotate(self, scene: RigScene, augment_rng: np.random.Generator, *, episode: int) -> RigSample:
        """Render the scene, compute its chunk and text, and apply the augmentations."""
        chunk = action_chunk(scene, self.chunk_len, self.fps)
        a = self.augment
        aux = aux_fields(scene, chunk)
        keep_aux = augment_rng.random(len(AUX_FIELDS)) >= a.field_dropout
        aux_kept = {k: v for (k, v), keep in zip(aux.items(), keep_aux) if keep}
        if augment_rng.random() < a.aux_dropout:
            aux_kept = {}
        condition = {"subgoal": scene.phase, "outcome": scene.outcome, "smoothness": scene.smoothness}
        keep_condition = augment_rng.random(len(CONDITION_FIELDS)) >= a.condition_field_dropout
        condition_kept = {k: v for (k, v), keep in zip(condition.items(), keep_condition) if keep}
        if augment_rng.random() < a.condition_dropout:
            condition_kept = {}
        paraphrase = int(augment_rng.integers(len(PARAPHRASES)))
        template = PARAPHRASES[paraphrase] if augment_rng.random() < a.instruction_augment else INSTRUCTION
        show_kinds = bool(augment_rng.random() >= a.camera_kind_dropout)
        frames = tuple(
            torch.from_numpy(render_frame(scene, camera, self.image_size, robot_state(scene), _GRASP_Z))
            for camera in range(scene.n_cameras)
        )
        return RigSample(
            episode=episode,
            split=self.split,
            frames=frames,
            camera_kinds=scene.camera_kinds,
            show_camera_kinds=show_kinds,
            state=torch.from_numpy(robot_state(scene).astype(np.float32)),
            actions=torch.from_numpy(chunk[:, : self.action_dim].astype(np.float32)),
            instruction=template.format(colour=scene.target.colour),
            aux=MappingProxyType(aux_kept),
            condition=MappingProxyType(condition_kept),
        )


def _sample_scene(rng: np.random.Generator, camera_counts: tuple[int, ...]) -> RigScene:
    n_distractors = int(rng.integers(1, 3))
    colours = [list(COLOURS)[c] for c in rng.permutation(len(COLOURS))[: 1 + n_distractors]]
    positions: list[tuple[float, float]] = []
    while len(positions) < 1 + n_distractors:  # rejection sampling; terminates fast at this density
        x, y = rng.uniform(-0.7, 0.7, size=2)
        if all(math.hypot(x - px, y - py) >= _MIN_BLOCK_GAP for px, py in positions):
            positions.append((float(x), float(y)))
    yaws = rng.uniform(-0.5, 0.5, size=1 + n_distractors)
    blocks = [Block(c, p[0], p[1], float(w)) for c, p, w in zip(colours, positions, yaws)]
    start = (*rng.uniform(-0.8, 0.8, size=2), rng.uniform(0.45, 0.9), rng.uniform(-0.5, 0.5),
             rng.uniform(-0.4, 0.0), 1.0)  # fmt: skip
    return RigScene(
        target=blocks[0],
        distractors=tuple(blocks[1:]),
        start=tuple(float(v) for v in start),
        phase=PHASES[int(rng.integers(len(PHASES)))],
        phase_fraction=float(rng.uniform(0.0, 0.9)),
        outcome="success" if rng.random() < _SUCCESS_RATE else "failure",
        smoothness=tuple(SMOOTHNESS_SECONDS)[int(rng.integers(len(SMOOTHNESS_SECONDS)))],
        n_cameras=int(camera_counts[int(rng.integers(len(camera_counts)))]),
        table_tint=tuple(int(v) for v in rng.integers(-20, 21, size=3)),  # type: ignore[arg-type]
    )
