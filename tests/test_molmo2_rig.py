"""Synthetic rig episodes: determinism, splits, learnable structure, augmentation rates, frames."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.molmo2.data.rig import (
    AUX_FIELDS,
    CONDITION_FIELDS,
    INSTRUCTION,
    MIN_JERK_MAX_ACCEL,
    NO_AUGMENT,
    PARAPHRASES,
    SMOOTHNESS_SECONDS,
    RigAugment,
    RigDataset,
    RigSample,
    action_chunk,
    robot_state,
    subgoal_pose,
)
from engine.molmo2.data.rig_render import COLOURS


def same(a: RigSample, b: RigSample) -> bool:
    return (
        len(a.frames) == len(b.frames)
        and all(torch.equal(x, y) for x, y in zip(a.frames, b.frames))
        and torch.equal(a.state, b.state)
        and torch.equal(a.actions, b.actions)
        and (a.instruction, dict(a.aux), dict(a.condition), a.camera_kinds, a.show_camera_kinds)
        == (b.instruction, dict(b.aux), dict(b.condition), b.camera_kinds, b.show_camera_kinds)
    )


def test_same_seed_same_samples():
    first, second = RigDataset(3, 20, image_size=32), RigDataset(3, 20, image_size=32)
    for i in (0, 7, 19):
        assert same(first.sample(i), second.sample(i))
        assert same(first.sample(i), first.sample(i))


def test_different_seed_or_episode_differs():
    a, b = RigDataset(3, 20, image_size=32), RigDataset(4, 20, image_size=32)
    for i in range(5):
        assert not torch.equal(a.sample(i).actions, b.sample(i).actions)
        assert not torch.equal(a.sample(i).frames[0], b.sample(i).frames[0])
    assert not torch.equal(a.sample(0).actions, a.sample(1).actions)


def test_eval_split_is_disjoint_from_train():
    train = RigDataset(0, 300, split="train")
    held_out = RigDataset(0, 300, split="eval")
    train_scenes = {train.scene(i) for i in range(300)}
    assert not train_scenes & {held_out.scene(i) for i in range(300)}
    assert len(train_scenes) == 300


def test_actions_are_smooth():
    """Each chunk is s + (g - s) f(t / duration) with f the minimum-jerk profile, C2 with |f''| <= 10/sqrt(3);
    a second difference at unit step is f'' at some point, over duration^2 steps^2. |g - s| <= 2 per dimension
    (poses in [-1, 1]), and the shortest duration is the brisk one. The state is the chunk's step -1."""
    ds = RigDataset(1, 400, action_dim=6)
    shortest = min(SMOOTHNESS_SECONDS.values()) * ds.fps
    bound = 2.0 * MIN_JERK_MAX_ACCEL / shortest**2
    worst = 0.0
    for i in range(len(ds)):
        scene = ds.scene(i)
        path = np.concatenate([robot_state(scene)[None], ds.action_chunk(i)])
        assert np.abs(path).max() <= 1.0
        worst = max(worst, np.abs(np.diff(path, n=2, axis=0)).max())
    assert worst <= bound
    assert worst > bound / 2  # tight: brisk moves of the gripper (+1 -> -1) come close to it


def test_actions_follow_the_target_not_the_distractors():
    ds = RigDataset(2, 50)
    reaches = [ds.scene(i) for i in range(50) if ds.scene(i).phase == "reach"]
    scene = reaches[0]
    moved = dataclasses.replace(scene, target=dataclasses.replace(scene.target, x=scene.target.x + 0.2))
    base, shifted = action_chunk(scene, 30), action_chunk(moved, 30)
    assert not np.array_equal(base, shifted)
    assert shifted[-1, 0] > base[-1, 0]  # the chunk heads for the new target
    np.testing.assert_array_equal(base[:, 1:], shifted[:, 1:])  # and only x changed
    far = tuple(dataclasses.replace(d, x=-d.x, y=-d.y) for d in scene.distractors)
    np.testing.assert_array_equal(base, action_chunk(dataclasses.replace(scene, distractors=far), 30))


def test_chunk_moves_from_the_state_to_the_subgoal():
    ds = RigDataset(5, 200)
    for i in range(40):
        scene = ds.scene(i)
        chunk = action_chunk(scene, 30)
        state, goal = robot_state(scene), subgoal_pose(scene, scene.phase)
        assert np.abs(chunk[0] - state).max() <= np.abs(goal - state).max() * 0.01  # starts at rest
        if scene.smoothness == "brisk":  # 0.9 s < 1 s chunk: arrives and holds
            np.testing.assert_allclose(chunk[-3:], np.broadcast_to(goal, (3, 6)), atol=1e-12)
        progress = np.abs(chunk - goal).max(axis=1)
        assert np.all(np.diff(progress) <= 1e-12)  # never moves away from the subgoal


def test_action_dim_keeps_the_first_pose_dims():
    full, xyz = RigDataset(6, 5), RigDataset(6, 5, action_dim=3)
    np.testing.assert_array_equal(full.action_chunk(2)[:, :3], xyz.action_chunk(2))
    assert xyz.sample(2).actions.shape == (30, 3)
    assert xyz.sample(2).state.shape == (6,)


def test_sample_fields_without_augmentation():
    ds = RigDataset(7, 30, image_size=(24, 40), augment=NO_AUGMENT)
    for i in range(30):
        s = ds.sample(i)
        assert tuple(s.aux) == AUX_FIELDS and tuple(s.condition) == CONDITION_FIELDS
        assert s.show_camera_kinds
        assert s.instruction == INSTRUCTION.format(colour=ds.scene(i).target.colour)
        assert s.camera_kinds == ("front", "side")[: s.n_cameras]
        assert all(f.shape == (24, 40, 3) and f.dtype == torch.uint8 for f in s.frames)
        assert s.actions.dtype == torch.float32 and s.actions.shape == (30, 6)
        assert s.aux["subgoal"] == s.condition["subgoal"] == ds.scene(i).phase
    with pytest.raises(TypeError):
        s.aux["subgoal"] = "lift"  # read-only


def test_augmentation_rates_match_their_parameters():
    augment = RigAugment(field_dropout=0.1, aux_dropout=0.0, condition_field_dropout=0.1, condition_dropout=0.5,
                         instruction_augment=0.5, camera_kind_dropout=0.1)  # fmt: skip
    ds = RigDataset(8, 600, image_size=8, augment=augment)
    samples = [ds.sample(i) for i in range(600)]
    aux_kept = np.mean([len(s.aux) / len(AUX_FIELDS) for s in samples])
    no_condition = np.mean([not s.condition for s in samples])
    paraphrased = np.mean([s.instruction != INSTRUCTION.format(colour=ds.scene(s.episode).target.colour)
                           for s in samples])  # fmt: skip
    kinds_hidden = np.mean([not s.show_camera_kinds for s in samples])
    assert abs(aux_kept - 0.9) < 0.03
    # No conditioning: the block dropout (0.5) or all three fields dropped (0.1^3) — 0.5 + 0.5 * 0.001.
    assert abs(no_condition - 0.5) < 0.07
    assert abs(paraphrased - 0.5) < 0.07
    assert abs(kinds_hidden - 0.1) < 0.04
    paraphrases = {p.format(colour=c) for p in PARAPHRASES for c in COLOURS}
    assert all(s.instruction in paraphrases or s.instruction.startswith("pick up the") for s in samples)


def test_augmentation_never_changes_the_scene():
    plain, augmented = RigDataset(9, 10, image_size=16, augment=NO_AUGMENT), RigDataset(9, 10, image_size=16)
    for i in range(10):
        a, b = plain.sample(i), augmented.sample(i)
        assert torch.equal(a.actions, b.actions) and torch.equal(a.frames[0], b.frames[0])


def test_frames_show_the_target_and_the_gripper():
    ds = RigDataset(10, 40, image_size=64, augment=NO_AUGMENT)
    for i in range(40):
        scene, s = ds.scene(i), ds.sample(i)
        front = s.frames[0].numpy()
        target_pixels = (front == COLOURS[scene.target.colour]).all(-1)
        assert target_pixels.any()
        state = s.state.numpy()
        col = round((state[0] + 1) / 2 * 63)
        row = round((1 - state[1]) / 2 * 63)
        assert tuple(front[row, col]) in {(35, 35, 40), (215, 215, 215)}  # the marker sits at the state
        if s.n_cameras == 2:
            assert not torch.equal(s.frames[0], s.frames[1])  # a different projection


def test_camera_counts_are_respected():
    assert {RigDataset(11, 60, camera_counts=(1, 2)).scene(i).n_cameras for i in range(60)} == {1, 2}
    assert {RigDataset(11, 20, camera_counts=(2,)).scene(i).n_cameras for i in range(20)} == {2}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"split": "test"}, "split 'test'"),
        ({"action_dim": 7}, "action_dim = 7"),
        ({"camera_counts": (3,)}, "camera_counts"),
        ({"image_size": 4}, "image_size"),
        ({"chunk_len": 1}, "chunk_len"),
    ],
)
def test_invalid_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RigDataset(0, 10, **kwargs)


def test_invalid_augment_and_index():
    with pytest.raises(ValueError, match=r"RigAugment.field_dropout = 1.5"):
        RigAugment(field_dropout=1.5)
    with pytest.raises(IndexError):
        RigDataset(0, 10).sample(10)
