"""The AR decoder and the S-bundle sites in it.

- keystone oracle: prefill + continue == the monolithic multimodal forward of prefix + suffix as one
  sequence, under LEFT padding of the prefix with rows of different lengths;
- P3b and P4 change nothing, bitwise (outputs and every gradient), with and without extension/FAST ids;
- P3c's sums equal the baseline's up to reduction order and an fp64 reference; no switch touches the mean form;
- P1's backend list per mode, and decode always on the baseline's list;
- the freezing split, and the zero-initialised state projection.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from molmo2_fixtures import SUFFIX_END_ID, Row, joined, make_batch, tiny_config, tiny_model
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

import engine.molmo2.model.ar as ar
import engine.molmo2.model.model as model_module
from engine.molmo2.model.ar import (
    ar_forward,
    ar_greedy_decode,
    ar_loss_sums,
    ar_losses,
    encode_prefix,
    forward_suffix,
    set_ar_trainable,
    suffix_backends,
)
from engine.molmo2.model.batch import IGNORE_INDEX, ARBatch, SuffixInputs
from engine.molmo2.model.text import BASELINE_BACKENDS
from engine.molmo2.switches import BASELINE, Switches

ROWS = [Row(images=2, text=5, aux=2, fast=4), Row(images=1, text=2, aux=0, fast=2, two_crops=True),
        Row(images=1, text=7, aux=3, fast=1)]  # fmt: skip
KEYSTONE_ATOL_FP32 = 1e-5
KEYSTONE_ATOL_FP64 = 1e-12


@pytest.fixture(scope="module")
def batch() -> ARBatch:
    b = make_batch(tiny_config(), ROWS, seed=11)
    lengths = b.prefix.attention_mask.sum(-1)
    assert len(set(lengths.tolist())) == len(ROWS)  # every row padded differently
    assert bool((~b.suffix.attention_mask).any())  # and the suffix right-padded
    return b


def _double(batch: ARBatch) -> ARBatch:
    p = batch.prefix
    prefix = type(p)(**(vars(p) | {"pixel_values": p.pixel_values.double(), "state": p.state.double()}))
    return ARBatch(prefix=prefix, suffix=batch.suffix, actions=batch.actions.double(), n_cameras=batch.n_cameras)


def _suffix_diff(model, batch: ARBatch) -> float:
    with torch.no_grad():
        split = ar_forward(model, batch)
        whole = model(**joined(batch))[:, batch.prefix.input_ids.shape[1] :]
    real = batch.suffix.attention_mask[..., None] & torch.isfinite(split)
    return float((split - whole)[real.expand_as(split)].abs().max())


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, KEYSTONE_ATOL_FP32), (torch.float64, KEYSTONE_ATOL_FP64)])
def test_keystone_prefill_plus_continue_equals_monolithic(batch, dtype, atol):
    model = tiny_model(seed=5).to(dtype).eval()
    b = batch if dtype == torch.float32 else _double(batch)
    assert _suffix_diff(model, b) <= atol


def test_keystone_is_sensitive_to_the_prefix(batch):
    """Negative control: the oracle compares something the prefix shapes — dropping the image block or the
    state slot from the monolithic side is caught."""
    model = tiny_model(seed=5).eval()
    p = batch.prefix
    no_block = ARBatch(type(p)(**(vars(p) | {"mm_token_type_ids": torch.zeros_like(p.mm_token_type_ids)})),
                       batch.suffix, batch.actions, batch.n_cameras)  # fmt: skip
    with torch.no_grad():
        split = ar_forward(model, batch)
        other = model(**joined(no_block))[:, p.input_ids.shape[1] :]
    real = batch.suffix.attention_mask[..., None] & torch.isfinite(split)
    assert float((split - other)[real.expand_as(split)].abs().max()) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# bitwise switches: P3b, P4 (and P1, P3a, P3c, which do not touch this path on CPU)
# ---------------------------------------------------------------------------------------------------------------


def _fwd_bwd(switches: Switches, batch: ARBatch, *, ar_split: bool):
    model = tiny_model(seed=7, switches=switches).train()
    if ar_split:
        set_ar_trainable(model)
    logits = ar_forward(model, batch)
    loss = ar_losses(logits, batch.suffix)["loss"]
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _text_only(batch: ARBatch) -> ARBatch:
    """No image (so no extension id in the prefix) and an aux-only suffix (no FAST id): the no-extension case."""
    p, s = batch.prefix, batch.suffix
    image = p.mm_token_type_ids == 1
    prefix = type(p)(**(vars(p) | {"input_ids": torch.where(image, 20, p.input_ids)}))
    fast = s.input_ids >= tiny_config().text.vocab_size
    suffix = SuffixInputs(input_ids=torch.where(fast, 21, s.input_ids), attention_mask=s.attention_mask,
                          labels=torch.where(s.labels >= tiny_config().text.vocab_size, 22, s.labels),
                          action_mask=torch.zeros_like(s.action_mask))  # fmt: skip
    return ARBatch(prefix, suffix, batch.actions, batch.n_cameras)


def _forward_text_only(switches: Switches, batch: ARBatch):
    model = tiny_model(seed=7, switches=switches).train()
    ids = torch.cat([batch.prefix.input_ids, batch.suffix.input_ids], 1)
    mask = torch.cat([batch.prefix.attention_mask, batch.suffix.attention_mask], 1)
    logits = model(ids, mask, torch.zeros_like(ids))
    logits[..., : tiny_config().text.vocab_size].square().mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


ALL_SWITCHES = [Switches(**dict(zip(("branchless_extension_lookup", "no_embed_clone", "masked_loss_sums",
                                     "device_assert_patch_count", "suffix_cudnn"), bits)))
                for bits in itertools.product([False, True], repeat=5) if any(bits)]  # fmt: skip


@pytest.mark.parametrize("ar_split", [False, True], ids=["all-trainable", "ar-split"])
def test_switches_are_bitwise_on_the_ar_path(batch, ar_split):
    """Extension and FAST ids present (image specials in the prefix, FAST in the suffix). All-trainable also
    runs the in-place add on a lookup that requires grad (P4's aliasing claim): no version-counter error."""
    logits, grads = _fwd_bwd(BASELINE, batch, ar_split=ar_split)
    assert all(g is not None for g in grads.values())
    for switches in [Switches(branchless_extension_lookup=True), Switches(no_embed_clone=True), *ALL_SWITCHES[-1:]]:
        other_logits, other_grads = _fwd_bwd(switches, batch, ar_split=ar_split)
        assert torch.equal(logits, other_logits), switches
        assert grads.keys() == other_grads.keys()
        assert all(torch.equal(grads[n], other_grads[n]) for n in grads), switches


def test_switches_are_bitwise_without_extension_ids(batch):
    """The no-extension case, where the baseline skips the extension lookup. Outputs and every gradient are bitwise
    equal, except that P3b reads the unused extension tables, so their grads are zeros where the baseline's are None.
    No AR step sees that difference: wte is frozen there, and fast_embed is always read by the suffix."""
    text = _text_only(batch)
    assert not bool((torch.cat([text.prefix.input_ids, text.suffix.input_ids], 1) >= 320).any())
    logits, grads = _forward_text_only(BASELINE, text)
    for switches in [Switches(branchless_extension_lookup=True), Switches(no_embed_clone=True)]:
        other_logits, other_grads = _forward_text_only(switches, text)
        assert torch.equal(logits, other_logits)
        for name, g in grads.items():
            other = other_grads[name]
            if g is None and other is not None:
                assert switches.branchless_extension_lookup, name
                assert name in ("model.transformer.wte.new_embedding", "model.transformer.wte.fast_embed")
                assert not bool(other.any())
            else:
                assert (g is None and other is None) or torch.equal(g, other), name


def test_prefix_embeddings_bitwise_under_p3b_and_p4(batch):
    """The embed_outputs probe's claim at its site: prefix embeddings (features injected, state added)."""
    outputs = []
    for switches in [BASELINE, Switches(branchless_extension_lookup=True, no_embed_clone=True)]:
        model = tiny_model(seed=3, switches=switches)
        p = batch.prefix
        with torch.no_grad():
            outputs.append(model.embed_multimodal(p.input_ids, pixel_values=p.pixel_values,
                                                  image_token_pooling=p.image_token_pooling, state=p.state,
                                                  state_positions=p.state_positions))  # fmt: skip
    assert torch.equal(*outputs)


# ---------------------------------------------------------------------------------------------------------------
# losses: mean form (anchor) and sum form (P3c)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def logits(batch) -> torch.Tensor:
    with torch.no_grad():
        return ar_forward(tiny_model(seed=9).eval(), batch)


def test_mean_losses_are_the_group_means(logits, batch):
    s = batch.suffix
    losses = ar_losses(logits, s)
    W = logits.shape[-1]
    for group, mask in [("loss", s.labels != IGNORE_INDEX), ("action_loss", s.action_mask),
                        ("aux_loss", (s.labels != IGNORE_INDEX) & ~s.action_mask)]:  # fmt: skip
        expected = F.cross_entropy(logits[mask].reshape(-1, W), s.labels[mask])
        torch.testing.assert_close(losses[group], expected, rtol=1e-6, atol=0)
    # A suffix token is a label only from the second position on (the first is predicted inside the prefix).
    assert int(losses["n_action"]) == sum(r.fast - (r.aux == 0) for r in ROWS)
    assert int(losses["n_aux"]) == int(((s.labels != IGNORE_INDEX) & ~s.action_mask).sum())


def test_mean_losses_unchanged_by_every_switch(logits, batch):
    reference = ar_losses(logits, batch.suffix)
    for switches in ALL_SWITCHES:
        model = tiny_model(seed=9, switches=switches).eval()
        with torch.no_grad():
            got = ar_losses(ar_forward(model, batch), batch.suffix)
        assert all(torch.equal(reference[k], got[k]) for k in reference), switches


def test_sum_form_baseline_vs_masked_vs_fp64(logits, batch):
    baseline = ar_loss_sums(logits, batch.suffix, BASELINE)
    masked = ar_loss_sums(logits, batch.suffix, Switches(masked_loss_sums=True))
    exact = ar_loss_sums(logits.double(), batch.suffix, BASELINE)
    means = ar_losses(logits, batch.suffix)
    for key in ("loss_sum", "action_sum", "aux_sum"):
        assert baseline[key].dtype == torch.float32
        torch.testing.assert_close(masked[key], baseline[key], rtol=1e-6, atol=1e-6)  # reduction order only
        torch.testing.assert_close(baseline[key].double(), exact[key], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(masked[key].double(), exact[key], rtol=1e-6, atol=1e-6)
    for key in ("n_valid", "n_action", "n_aux"):
        assert torch.equal(baseline[key], masked[key])
    torch.testing.assert_close(baseline["action_sum"] / baseline["n_action"], means["action_loss"], rtol=1e-6, atol=0)


def test_sum_form_accumulates_over_chunks_to_the_mean(logits, batch):
    """Two backward chunks' sums over the step's total count == the whole batch's mean (the P2-era chunking)."""
    s = batch.suffix
    chunks = [slice(0, 2), slice(2, 3)]
    parts = [ar_loss_sums(logits[c], SuffixInputs(**{k: v[c] for k, v in vars(s).items()}),
                          Switches(masked_loss_sums=True)) for c in chunks]  # fmt: skip
    total = sum(p["loss_sum"] for p in parts) / sum(p["n_valid"] for p in parts)
    torch.testing.assert_close(total, ar_losses(logits, s)["loss"], rtol=1e-6, atol=0)


def test_empty_loss_group_is_zero_not_nan(logits, batch):
    s = batch.suffix
    no_aux = SuffixInputs(s.input_ids, s.attention_mask, torch.where(s.action_mask, s.labels, IGNORE_INDEX),
                          s.action_mask)  # fmt: skip
    losses = ar_losses(logits, no_aux)
    assert int(losses["n_aux"]) == 0 and float(losses["aux_loss"]) == 0.0
    torch.testing.assert_close(losses["loss"], losses["action_loss"], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# P1: backends
# ---------------------------------------------------------------------------------------------------------------


def test_suffix_backends_per_mode():
    cudnn = Switches(suffix_cudnn=True)
    assert BASELINE_BACKENDS == (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    assert suffix_backends(True, BASELINE) == BASELINE_BACKENDS
    assert suffix_backends(False, BASELINE) == BASELINE_BACKENDS
    assert suffix_backends(False, cudnn) == BASELINE_BACKENDS
    assert suffix_backends(True, cudnn) == (SDPBackend.CUDNN_ATTENTION, *BASELINE_BACKENDS)


def test_p1_reaches_the_training_suffix_only_and_decode_keeps_the_baseline(batch, monkeypatch):
    seen: list[tuple[str, tuple]] = []
    real = ar.backends_context

    def spy(where):
        def record(backends):
            seen.append((where, tuple(backends)))
            return real(backends)

        return record

    monkeypatch.setattr(ar, "backends_context", spy("ar"))
    monkeypatch.setattr(model_module, "backends_context", spy("model"))
    model = tiny_model(switches=Switches(suffix_cudnn=True)).train()

    cache = encode_prefix(model, batch.prefix)
    forward_suffix(model, batch.suffix, cache)
    assert seen == [("model", BASELINE_BACKENDS), ("ar", (SDPBackend.CUDNN_ATTENTION, *BASELINE_BACKENDS))]

    seen.clear()
    start = batch.suffix.input_ids[:, :1]
    ar_greedy_decode(model, batch.prefix, start, max_new_tokens=3)  # still in training mode: decode is pinned
    assert seen and all(backends == BASELINE_BACKENDS for _, backends in seen)

    seen.clear()
    model.eval()
    forward_suffix(model, batch.suffix, encode_prefix(model, batch.prefix))
    assert seen[-1] == ("ar", BASELINE_BACKENDS)


def test_p1_on_cpu_trains_and_matches_the_baseline(batch):
    """No cuDNN on a CPU: the prepended backend is skipped and the rest of the baseline's list serves."""
    logits, grads = _fwd_bwd(BASELINE, batch, ar_split=True)
    other_logits, other_grads = _fwd_bwd(Switches(suffix_cudnn=True), batch, ar_split=True)
    assert torch.equal(logits, other_logits) and all(torch.equal(grads[n], other_grads[n]) for n in grads)


# ---------------------------------------------------------------------------------------------------------------
# AR decode, freezing split, state slot
# ---------------------------------------------------------------------------------------------------------------


def test_ar_greedy_decode_equals_argmax_of_monolithic_forwards(batch):
    model = tiny_model(seed=4).double().eval()
    b = _double(batch)
    start = torch.full((len(ROWS), 1), SUFFIX_END_ID)
    got = ar_greedy_decode(model, b.prefix, start, max_new_tokens=5)
    suffix_ids = start
    for step in range(5):
        ones = torch.ones_like(suffix_ids, dtype=torch.bool)
        s = SuffixInputs(suffix_ids, ones, torch.full_like(suffix_ids, IGNORE_INDEX), ~ones)
        with torch.no_grad():
            token = model(**joined(ARBatch(b.prefix, s, b.actions, b.n_cameras)))[:, -1].argmax(-1)
        assert torch.equal(got[:, step], token)
        suffix_ids = torch.cat([suffix_ids, token[:, None]], 1)


def test_frozen_split(batch):
    model = tiny_model(seed=1).train()
    trainable = set(set_ar_trainable(model))
    loss = ar_losses(ar_forward(model, batch), batch.suffix)["loss"]
    loss.backward()
    frozen_prefixes = ("model.vision_backbone.", "model.transformer.wte.embedding",
                       "model.transformer.wte.new_embedding", "lm_head.")  # fmt: skip
    for name, p in model.named_parameters():
        if name.startswith(frozen_prefixes):
            assert name not in trainable and p.grad is None, name
        else:
            assert name in trainable and p.grad is not None and bool(p.grad.any()), name
    assert any(n.startswith("model.vision_backbone.") for n, _ in model.named_parameters())


def test_state_projection_starts_at_zero_and_then_reaches_only_the_slot(batch):
    model = tiny_model(seed=1)
    model_module.init_weights(model, 0, only=("state_proj.weight", "state_proj.bias"))
    p = batch.prefix
    with torch.no_grad():
        features = model.image_features(p.pixel_values, p.image_token_pooling)
        without = model.embed(p.input_ids, features)
        with_state = model.embed(p.input_ids, features, p.state, p.state_positions)
        assert torch.equal(with_state, without)  # zero init: the prompt starts undisturbed, bitwise
        model.state_proj.bias.fill_(0.5)
        moved = model.embed(p.input_ids, features, p.state, p.state_positions)
    changed = (moved != without).any(-1)
    expected = torch.zeros_like(changed)
    expected[torch.arange(len(ROWS)), p.state_positions] = True
    assert torch.equal(changed, expected)


# ---------------------------------------------------------------------------------------------------------------
# on CUDA (skipped without it): the sites' host syncs, bitwise under bf16 autocast, P1 really reaching cuDNN
# ---------------------------------------------------------------------------------------------------------------

ALL_ON = Switches(suffix_cudnn=True, device_assert_patch_count=True, branchless_extension_lookup=True,
                  masked_loss_sums=True, no_embed_clone=True)  # fmt: skip


def _cuda_step(model, batch: ARBatch, switches: Switches):
    model.switches = switches
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = ar_forward(model, batch)
        sums = ar_loss_sums(logits, batch.suffix, switches)
    (sums["loss_sum"] / sums["n_valid"]).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def cuda_setup(batch):
    model = tiny_model(seed=1).cuda().train()
    set_ar_trainable(model)
    return model, batch.to("cuda")


def _sync_sites(model, batch: ARBatch, switches: Switches) -> set[str]:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _cuda_step(model, batch, switches)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return {w.filename.rsplit("/", 1)[-1] for w in caught if "ynchroniz" in str(w.message)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_syncs_are_the_seeds_sites_and_all_switches_remove_them(cuda_setup):
    model, batch = cuda_setup
    assert {"model.py", "text.py", "ar.py"} <= _sync_sites(model, batch, BASELINE)  # P3a, P3b, P3c sites
    assert _sync_sites(model, batch, ALL_ON) == set()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_p3b_p4_bitwise_under_bf16_autocast(cuda_setup):
    model, batch = cuda_setup
    logits, grads = _cuda_step(model, batch, BASELINE)
    both = Switches(branchless_extension_lookup=True, no_embed_clone=True)
    other_logits, other_grads = _cuda_step(model, batch, both)
    assert torch.equal(logits, other_logits)
    assert grads.keys() == other_grads.keys() and all(torch.equal(grads[n], other_grads[n]) for n in grads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_p1_runs_cudnn_in_training_only(cuda_setup):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("cuDNN attention needs sm80+")
    model, batch = cuda_setup

    def kernels(train: bool) -> set[str]:
        model.train(train)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if train:
                _cuda_step(model, batch, Switches(suffix_cudnn=True))
            else:
                model.switches = Switches(suffix_cudnn=True)
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    ar_forward(model, batch)
            torch.cuda.synchronize()
        return {e.key for e in prof.key_averages()}

    assert any("cudnn" in k and "sdpa" in k for k in kernels(True))
    assert not any("cudnn" in k and "sdpa" in k for k in kernels(False))


# ---------------------------------------------------------------------------------------------------------------
# X2 (vit_fp16_attention): the frozen ViT's attention on fp16 inputs, training mode only, on any device
# ---------------------------------------------------------------------------------------------------------------


def _vit_fp16_flags(model, batch: ARBatch, monkeypatch, pooling: bool = False) -> list:
    """The `fp16` flag each ViT block's attention call receives; with `pooling`, each pooling attention call's
    instead (the pooling passes its mask, the ViT blocks' self-attention none)."""
    from engine.molmo2.model.vision import DotProductAttention

    seen = []
    real = DotProductAttention.forward

    def spy(self, x_q, x_kv=None, mask=None, fp16=False):
        if (mask is not None) == pooling:
            seen.append(fp16)
        return real(self, x_q, x_kv, mask, fp16)

    monkeypatch.setattr(DotProductAttention, "forward", spy)
    encode_prefix(model, batch.prefix)
    return seen


def test_x2_reaches_the_vit_in_training_only(batch, monkeypatch):
    model = tiny_model(switches=Switches(vit_fp16_attention=True)).train()
    flags = _vit_fp16_flags(model, batch, monkeypatch)
    assert flags and set(flags) == {True}
    assert set(_vit_fp16_flags(model.eval(), batch, monkeypatch)) == {False}  # eval and decode: the hub's fp32
    assert set(_vit_fp16_flags(tiny_model().train(), batch, monkeypatch)) == {False}  # the baseline
    assert set(_vit_fp16_flags(model.train(), batch, monkeypatch, pooling=True)) == {False}  # the pooling keeps fp32


def _trains_like_baseline_within(switches: Switches, batch: ARBatch, relative: float, floor: float) -> bool:
    """Asserts logits and every gradient within `relative` of their largest entry (plus `floor`) of the baseline's;
    returns whether the logits are bitwise the baseline's."""
    logits, grads = _fwd_bwd(BASELINE, batch, ar_split=True)
    other_logits, other_grads = _fwd_bwd(switches, batch, ar_split=True)
    torch.testing.assert_close(other_logits, logits, rtol=0, atol=relative * float(logits.abs().max()))
    for name in grads:
        torch.testing.assert_close(
            other_grads[name], grads[name], rtol=0, atol=relative * float(grads[name].abs().max()) + floor
        )
    return torch.equal(logits, other_logits)


def test_x2_on_cpu_changes_training_by_fp16_rounding_only(batch):
    """X2 casts whatever the autocast state, so it is a real numerics change on a CPU too: not bitwise the
    baseline, and within fp16's rounding (2^-11 relative on q, k, v) of it."""
    assert not _trains_like_baseline_within(Switches(vit_fp16_attention=True), batch, 5e-3, floor=1e-9)  # not bitwise


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_x2_changes_image_features_within_fp16_noise(cuda_setup):
    """Under bf16 autocast X2 really changes the ViT's numerics (not bitwise the hub's fp32), by rounding only: the
    features leave autocast in bf16, so within a few bf16 steps of the largest."""
    model, batch = cuda_setup
    p = batch.prefix
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model.switches = BASELINE
        fp32 = model.image_features(p.pixel_values, p.image_token_pooling).float()
        model.switches = Switches(vit_fp16_attention=True)
        fp16 = model.image_features(p.pixel_values, p.image_token_pooling).float()
    model.switches = BASELINE
    assert not torch.equal(fp32, fp16)
    assert float((fp32 - fp16).abs().max()) <= 2e-2 * float(fp32.abs().max())
