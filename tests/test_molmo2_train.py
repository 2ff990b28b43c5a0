"""The training step and the runner on the tiny geometry: chunked gradients, the frozen vision tower, window
metrics, the probes the S-bundle's oracles use, and a model that learns."""

from __future__ import annotations

import pytest
from molmo2_fixtures import make_runner, train_config

from engine.molmo2.runner import Molmo2Runner
from engine.molmo2.switches import BASELINE
from engine.molmo2.train.step import Trainer, prepare_step
from oracles.judge import judge


def runner(**config) -> Molmo2Runner:
    r = make_runner(**{"batch": 4, "backward_chunks": 1, **config})
    r.load()
    return r


@pytest.fixture(scope="module")
def tiny() -> Molmo2Runner:
    return runner()


def test_chunked_gradient_equals_unchunked_in_fp64(tiny):
    samples = [tiny.eval_data.sample(i) for i in range(4)]
    model = tiny.model.double()
    try:
        grads = {}
        for chunks in (1, 2, 4):
            size = 4 // chunks
            batches = [tiny.collator(samples[k : k + size]) for k in range(0, 4, size)]
            batches = [
                type(b)(
                    prefix=type(b.prefix)(
                        **{
                            **vars(b.prefix),
                            "pixel_values": b.prefix.pixel_values.double(),
                            "state": b.prefix.state.double(),
                        }
                    ),
                    suffix=b.suffix,
                    actions=b.actions,
                    n_cameras=b.n_cameras,
                )
                for b in batches
            ]
            trainer = Trainer(model, train_config(batch=4, backward_chunks=chunks), tiny.device)
            trainer.accumulate_gradients(prepare_step(batches, tiny.device))
            grads[chunks] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert grads[1].keys() == grads[2].keys() == grads[4].keys()
        worst = max((grads[1][n] - grads[c][n]).abs().max().item() for c in (2, 4) for n in grads[1])
        assert worst <= 1e-12, worst  # equal up to fp64 reduction order
    finally:
        model.float()


def test_vision_tower_is_frozen_and_has_no_optimizer_state(tiny):
    trainer = tiny.fresh(BASELINE)
    trainer.step(tiny.probe_step)
    with_state = {id(p) for p in trainer.optimizer.state}
    for name, p in tiny.model.named_parameters():
        frozen = name.startswith(
            (
                "model.vision_backbone.",
                "lm_head.",
                "model.transformer.wte.embedding",
                "model.transformer.wte.new_embedding",
            )
        )
        assert (p.grad is None) == frozen, name
        assert (id(p) in with_state) == (not frozen), name


def test_window_reports_every_metric_and_the_windowed_peak_only_under_p2(tiny):
    trainer = tiny.fresh(BASELINE)
    window = trainer.window(tiny.steps_for(2), windowed_memory=False)
    for key in ("steps", "s_per_step", "tokens_per_s", "loss", "finite", "vram_peak_gib", "vram_reserved_peak_gib"):
        assert key in window, key
    assert window["steps"] == 2 and window["finite"] is True and window["s_per_step"] > 0
    assert "vram_window_peak_gib" not in window
    windows = [trainer.window(tiny.steps_for(1), windowed_memory=True) for _ in range(3)]
    assert all(w["vram_peak_gib"] >= w["vram_window_peak_gib"] > 0 for w in windows)
    assert [w["vram_peak_gib"] for w in windows] == sorted(w["vram_peak_gib"] for w in windows)


@pytest.mark.parametrize(
    ("switch", "probe", "kind", "bounds"),
    [
        ("branchless_extension_lookup", "embed_outputs", "bitwise", {}),
        ("branchless_extension_lookup", "fwd_bwd_outputs", "bitwise", {}),
        ("no_embed_clone", "fwd_bwd_outputs", "bitwise", {}),
        ("masked_loss_sums", "loss_sums_fp64", "tolerance", {"sum_rel": 1e-12}),
        ("masked_loss_sums", "loss_sums_fp64", "bitwise", {}),
        ("device_assert_patch_count", "planted_mismatch", "raises", {}),
        ("windowed_vram_peak", "window_schema", "schema", {}),
        ("no_embed_clone", "decode_bytes", "byte_match", {}),
        ("no_embed_clone", "loss_curve", "curve_overlay", {}),
        ("no_embed_clone", "one_step", "tolerance", {"loss_abs": 0.0, "grad_norm_rel": 0.0}),
        # X2 casts on a CPU too, so its probes run here (at this init the tiny ViT's features are ~1e-8, too small
        # for fp16's rounding to reach the loss: the plumbing is what this checks; test_molmo2_ar.py the numerics)
        ("vit_fp16_attention", "one_step", "tolerance", {"loss_abs": 1e-3, "grad_norm_rel": 1e-2}),
        ("vit_fp16_attention", "loss_curve", "curve_overlay", {"max_abs_diff": 0.04}),
        ("vit_fp16_attention", "decode_bytes", "byte_match", {}),
    ],
)
def test_probes_pass_for_the_items_that_hold(tiny, switch, probe, kind, bounds):
    observed = tiny.probe(probe, switch, {"steps": 4})
    judgement = judge(kind, observed, bounds)
    assert judgement.passed, (judgement.reason, observed)


def test_probes_fail_where_they_must(tiny):
    # The baseline's window has no windowed field: the P2 schema oracle judged on it fails, naming it.
    assert judge("schema", tiny.probe("window_schema", "no_embed_clone", {}), {}).reason.startswith(
        "missing ['vram_window_peak_gib']"
    )
    # cuDNN attention cannot run on a CPU: the P1 probes fail with that reason instead of being skipped.
    observed = tiny.probe("one_step", "suffix_cudnn", {})
    assert "CUDA backend" in observed["error"]
    assert not judge("tolerance", observed, {"loss_abs": 1e-3}).passed
    # A retired switch's code has left the workload: its probes refuse to run rather than compare the baseline
    # with itself.
    with pytest.raises(ValueError, match=r"\['vit_bf16_attention'\] are retired"):
        tiny.probe("one_step", "vit_bf16_attention", {})


def test_tiny_model_learns_the_rig():
    """Loss and greedy-decoded action error fall within 600 CPU steps at batch 8 (lr 3e-3): the training loss by
    >= 50%, and the chunk MAE of greedy decodes of 16 training episodes to <= 80% of the untrained model's (which
    decodes no chunk at all: the zero chunk). The claim is that the AR decoder learns to emit FAST chunks that carry
    the actions; held-out generalisation is not claimed at this size and step count (the runner's evaluate()
    measures it on held-out episodes, for runs).

    The decoded MAE is chaotic in the training trajectory: the CPU's thread count changes the reduction order and
    with it which tokens the greedy decode picks. At 400 steps and lr 5e-3 one thread gave 0.46 of a 0.38 bar while
    two gave 0.27. At this setting, measured: seed 0, loss 5.47 -> 2.15, MAE 0.477 -> 0.157 at one thread and 0.134
    at two; over seeds 0-3 and one or two threads the after-MAE is at most 0.66 of the untrained (0.29 of 0.44), and
    at most 0.63 at 500 steps and 0.71 at 700, so the bar holds with margin around this step count too."""
    r = runner(batch=8, lr=3e-3, backbone_text_lr=3e-3)
    seen = [r.train_data.sample(i) for i in range(16)]
    before = r.decode_error(seen)
    first = r.train_window(10, lambda: False)
    r.train_window(580, lambda: False)
    last = r.train_window(10, lambda: False)
    after = r.decode_error(seen)
    assert last["loss"] <= 0.5 * first["loss"], (first["loss"], last["loss"])
    assert after["probe_chunk_mae"] <= 0.8 * before["probe_chunk_mae"], (before, after)
    assert after["probe_decode_failures"] < before["probe_decode_failures"]
