"""Token layout, text tokenizers, prompt/suffix assembly and the collator's ARBatch contract."""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models

from engine.molmo2.data.collate import Collator, make_fast_tokenizer, token_counts
from engine.molmo2.data.fast import FastDecodeError
from engine.molmo2.data.fast_cache import CACHE_VARIABLE, fit_dependencies, fit_key, imported_modules
from engine.molmo2.data.processor import ImageGeometry
from engine.molmo2.data.prompt import (
    IMAGE_SPECIAL_OFFSETS,
    ByteTokenizer,
    CheckpointTokenizer,
    TokenLayout,
    parse_suffix,
    text_tokenizer_for,
)
from engine.molmo2.data.rig import NO_AUGMENT, RigDataset
from engine.molmo2.model.batch import IGNORE_INDEX, ARBatch

TINY_LAYOUT = TokenLayout.for_tiny(320)
FOUR_B = TokenLayout.for_4b()


@pytest.fixture(scope="module")
def tiny_fast():
    return make_fast_tokenizer(0, 300, scale=2.0, vocab_size=48)


@pytest.fixture(scope="module")
def tiny_collator(tiny_fast):
    return Collator(TINY_LAYOUT, tiny_fast, ByteTokenizer.for_layout(TINY_LAYOUT), ImageGeometry.for_tiny(), 1)


@pytest.fixture(scope="module")
def tiny_samples():
    ds = RigDataset(0, 40, image_size=42)
    return [ds.sample(i) for i in range(8)]


def render(ids, layout: TokenLayout, tokenizer: ByteTokenizer) -> str:
    """Ids as text, specials by name (for asserting on prompt bytes)."""
    names = {layout.special_id(n): f"<{n}>" for n in IMAGE_SPECIAL_OFFSETS}
    names |= {layout.im_start_text_id: "<|im_start|>", layout.im_end_text_id: "<|im_end|>", layout.state_id: "<state>"}
    return "".join(names.get(i) or ("<fast>" if layout.is_fast(i) else tokenizer.decode([i])) for i in ids)


# ---------------------------------------------------------------------------------------------- token layout
def test_4b_layout():
    assert FOUR_B.fast_base == 152_064 and FOUR_B.fast_end == 153_088
    assert [FOUR_B.special_id(n) for n in IMAGE_SPECIAL_OFFSETS] == list(range(151_936, 151_946))
    assert FOUR_B.state_id == 151_946
    assert FOUR_B.bos_id == FOUR_B.end_id == 151_645
    fast_ids = {FOUR_B.fast_id(i) for i in range(1024)}
    assert min(fast_ids) == 152_064 and max(fast_ids) == 153_087
    specials = {FOUR_B.special_id(n) for n in IMAGE_SPECIAL_OFFSETS} | {FOUR_B.state_id}
    assert not fast_ids & specials and not fast_ids & FOUR_B.chat_special_ids
    assert FOUR_B.image_block_ids == {151_936, 151_937, 151_938, 151_939, 151_940, 151_942, 151_943, 151_944}
    with pytest.raises(ValueError, match=r"FAST BPE id 1024; allowed: \[0, 1024\)"):
        FOUR_B.fast_id(1024)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"additional_vocab_size": 10}, "additional_vocab_size = 10"),
        ({"pad_id": 320}, r"pad_id = 320; allowed: \[0, 320\)"),
        ({"im_start_text_id": 2}, "distinct"),
    ],
)
def test_layout_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY_LAYOUT, **kwargs)


# -------------------------------------------------------------------------------------------- text tokenizers
@settings(max_examples=80, deadline=None)
@given(text=st.text(max_size=40))
@pytest.mark.parametrize("layout, offset", [(TINY_LAYOUT, 3), (FOUR_B, 0)])
def test_byte_tokenizer_stays_in_text_ids(layout, offset, text):
    tokenizer = ByteTokenizer.for_layout(layout)
    assert tokenizer.offset == offset
    ids = tokenizer.encode(text)
    assert all(0 <= i < layout.vocab_size and i not in layout.chat_special_ids for i in ids)
    assert tokenizer.decode(ids) == text


def test_byte_tokenizer_refuses_clashes_and_non_byte_ids():
    with pytest.raises(ValueError, match=r"chat special id\(s\) \[0, 1, 2\]"):
        ByteTokenizer(0, TINY_LAYOUT)
    with pytest.raises(ValueError, match="leave"):
        ByteTokenizer(100, TINY_LAYOUT)
    with pytest.raises(ValueError, match="not byte ids"):
        ByteTokenizer.for_layout(TINY_LAYOUT).decode([2])


def write_checkpoint_tokenizer(path, specials: dict[str, int]) -> None:
    vocab = {chr(c): c - 32 for c in range(32, 127)}  # printable ASCII at ids 0..94
    tokenizer = Tokenizer(models.BPE(vocab=vocab | {"[UNK]": 95}, merges=[], unk_token="[UNK]"))  # characters
    body = json.loads(tokenizer.to_str())
    body["added_tokens"] = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }  # fmt: skip
        for t, i in specials.items()
    ]
    body["model"]["vocab"].update({t: i for t, i in specials.items()})
    path.write_text(json.dumps(body))


def test_checkpoint_tokenizer(tmp_path):
    layout = TokenLayout(vocab_size=200, pad_id=100, im_start_text_id=101, im_end_text_id=102)
    write_checkpoint_tokenizer(tmp_path / "tokenizer.json",
                               {"<|endoftext|>": 100, "<|im_start|>": 101, "<|im_end|>": 102})  # fmt: skip
    tokenizer = text_tokenizer_for(layout, tmp_path)
    assert isinstance(tokenizer, CheckpointTokenizer)
    ids = tokenizer.encode("pick")
    assert ids and all(i < 95 for i in ids)
    with pytest.raises(ValueError, match="special id"):
        tokenizer.encode("a<|im_start|>b")
    mismatched = dataclasses.replace(layout, im_end_text_id=103)
    with pytest.raises(ValueError, match=r"maps <\|im_end\|> to 102; the layout's im_end_text_id is 103"):
        text_tokenizer_for(mismatched, tmp_path)
    with pytest.raises(FileNotFoundError, match="carries its tokenizer"):
        text_tokenizer_for(layout, tmp_path / "nowhere")
    assert isinstance(text_tokenizer_for(TINY_LAYOUT, None), ByteTokenizer)


# -------------------------------------------------------------------------------------------------- prompts
def test_prompt_text_and_labels(tiny_collator):
    ds = RigDataset(4, 60, image_size=42, augment=NO_AUGMENT)
    tokenizer = tiny_collator.text
    two = next(ds.sample(i) for i in range(60) if ds.scene(i).n_cameras == 2)
    one = next(ds.sample(i) for i in range(60) if ds.scene(i).n_cameras == 1)
    text = render(tiny_collator.encode(two).prompt_ids, TINY_LAYOUT, tokenizer)
    # 3x3 patches pool to 2x2 tokens in both views; the low-res view has no <im_col> (the hub's setting).
    image = "<low_res_im_start>" + "<im_patch>" * 4 + "<im_end><im_start>" + "<im_patch>" * 2 + "<im_col>"
    image = image + "<im_patch>" * 2 + "<im_col><im_end>"
    c = two.condition
    assert text == (
        f"<|im_end|>[front camera| Image 1]{image}[side camera| Image 2]{image}<|im_start|>user\n{two.instruction} "
        f"[subgoal: {c['subgoal']}] [outcome: {c['outcome']}] [smoothness: {c['smoothness']}] "
        "[generate|subgoal holding progress event visible actions]<state><|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(tiny_collator.encode(one).prompt_ids, TINY_LAYOUT, tokenizer).startswith(
        f"<|im_end|>[front camera]{image}<|im_start|>user\n"
    )
    hidden = dataclasses.replace(two, show_camera_kinds=False, condition=MappingProxyType({}),
                                 aux=MappingProxyType({"holding": two.aux["holding"]}))  # fmt: skip
    text = render(tiny_collator.encode(hidden).prompt_ids, TINY_LAYOUT, tokenizer)
    assert text.startswith(f"<|im_end|>Image 1{image}Image 2{image}<|im_start|>user\n{two.instruction} [generate|")
    assert "[generate|holding actions]<state>" in text
    target = tiny_collator.encode(hidden).target_ids
    assert render(target, TINY_LAYOUT, tokenizer).startswith(f"holding: {two.aux['holding']}\n")


# ------------------------------------------------------------------------------------------------- collator
def test_collated_batch_contract(tiny_collator, tiny_samples, tiny_fast):
    batch = tiny_collator(tiny_samples)
    assert isinstance(batch, ARBatch)
    p, s = batch.prefix, batch.suffix
    B = len(tiny_samples)
    assert p.input_ids.shape[0] == s.input_ids.shape[0] == B
    assert batch.n_cameras == tuple(x.n_cameras for x in tiny_samples)
    assert len(set(batch.n_cameras)) == 2  # the fixture mixes 1 and 2 cameras
    # LEFT-padded prefix: padding only at the start, the last column real in every row.
    assert bool(p.attention_mask[:, -1].all()) and bool((p.attention_mask.int().diff(dim=1) >= 0).all())
    assert bool((p.input_ids[~p.attention_mask] == TINY_LAYOUT.pad_id).all())
    # RIGHT-padded suffix: padding only at the end, the first column real in every row.
    assert bool(s.attention_mask[:, 0].all()) and bool((s.attention_mask.int().diff(dim=1) <= 0).all())
    assert bool((s.labels[~s.attention_mask] == IGNORE_INDEX).all())
    assert bool((s.labels[s.attention_mask] != IGNORE_INDEX).all())
    # The state slot.
    assert bool((p.input_ids[torch.arange(B), p.state_positions] == TINY_LAYOUT.state_id).all())
    assert int((p.input_ids == TINY_LAYOUT.state_id).sum()) == B
    assert torch.equal(p.state, torch.stack([x.state for x in tiny_samples]))
    # Image tokens.
    block = torch.tensor(sorted(TINY_LAYOUT.image_block_ids))
    assert torch.equal(p.mm_token_type_ids.bool(), torch.isin(p.input_ids, block))
    n_patch = int((p.input_ids == TINY_LAYOUT.special_id("im_patch")).sum())
    assert n_patch == p.image_token_pooling.shape[0]
    assert p.pixel_values.shape == (int(p.image_num_crops.sum()), 9, 588)
    assert p.image_grids.shape == (sum(batch.n_cameras), 4)
    assert int(p.image_token_pooling.max()) < p.pixel_values.shape[0] * 9
    # Teacher forcing: a label is the next input; the first input is the prompt's last token ("\n").
    both = s.attention_mask[:, 1:]
    assert torch.equal(s.labels[:, :-1][both], s.input_ids[:, 1:][both])
    newline = tiny_collator.text.encode("\n")[0]
    assert bool((s.input_ids[:, 0] == newline).all())
    ends = s.labels[torch.arange(B), s.attention_mask.sum(1) - 1]
    assert bool((ends == TINY_LAYOUT.end_id).all())
    # action_mask marks exactly the FAST labels, and they decode back to the ground-truth chunk.
    fast = (s.labels >= TINY_LAYOUT.fast_base) & (s.labels < TINY_LAYOUT.fast_end)
    assert torch.equal(s.action_mask, fast) and bool(s.action_mask.any(dim=1).all())
    for b in range(B):
        parsed = parse_suffix(s.labels[b][s.attention_mask[b]].tolist(), TINY_LAYOUT, tiny_collator.text)
        aux = tiny_samples[b].aux
        assert parsed.ended and parsed.aux_text == (" ".join(f"{k}: {v}" for k, v in aux.items()) + "\n" if aux else "")
        decoded = tiny_fast.decode(parsed.fast_ids)
        error = np.sqrt(np.mean((decoded - batch.actions[b].double().numpy()) ** 2))
        assert error <= 0.5 / tiny_fast.scale * (1 + 1e-6)  # float32 ground truth: a little float slack


def test_prefix_and_suffix_rows_spell_prompt_and_target(tiny_collator, tiny_samples):
    batch = tiny_collator(tiny_samples)
    for b, sample in enumerate(tiny_samples):
        encoded = tiny_collator.encode(sample)
        prefix = batch.prefix.input_ids[b][batch.prefix.attention_mask[b]].tolist()
        suffix = batch.suffix.input_ids[b][batch.suffix.attention_mask[b]].tolist()
        assert prefix + suffix == list(encoded.prompt_ids) + list(encoded.target_ids[:-1])


def test_collation_is_deterministic(tiny_collator, tiny_samples):
    first, second = tiny_collator(tiny_samples), tiny_collator(list(tiny_samples))
    for part in ("prefix", "suffix"):
        for name, value in vars(getattr(first, part)).items():
            other = vars(getattr(second, part))[name]
            assert (value is None and other is None) or torch.equal(value, other), name  # state_rows: None unpacked
    assert torch.equal(first.actions, second.actions) and first.n_cameras == second.n_cameras


def test_parse_suffix_refuses_text_after_actions(tiny_collator):
    fast = TINY_LAYOUT.fast_id(3)
    with pytest.raises(ValueError, match="after its first FAST id"):
        parse_suffix([fast, 40, fast], TINY_LAYOUT, tiny_collator.text)
    parsed = parse_suffix([fast, fast], TINY_LAYOUT, tiny_collator.text)
    assert not parsed.ended and parsed.fast_ids == (3, 3)
    with pytest.raises(FastDecodeError):
        tiny_collator.fast.decode(parsed.fast_ids)


def test_collator_refuses_a_fast_vocabulary_larger_than_the_block():
    big = make_fast_tokenizer(0, 200, scale=2.0, vocab_size=64)
    with pytest.raises(ValueError, match="FAST block holds 48"):
        Collator(TINY_LAYOUT, big, ByteTokenizer.for_layout(TINY_LAYOUT), ImageGeometry.for_tiny(), 1)


def test_fast_cache(tmp_path):
    path = tmp_path / "fast.json"
    fitted = make_fast_tokenizer(1, 200, path, scale=2.0, vocab_size=48)
    assert path.is_file()
    assert make_fast_tokenizer(1, 200, path, scale=2.0, vocab_size=48) == fitted
    with pytest.raises(ValueError, match="fitted on"):
        make_fast_tokenizer(2, 200, path, scale=2.0, vocab_size=48)


# --- the cache of fits shared between processes (engine/molmo2/data/fast_cache.py) ------------------------------

FIT_ARGUMENTS = dict(seed=0, n_chunks=2000, chunk_len=30, action_dim=6, fps=30, scale=2.0, vocab_size=48)


def test_the_fit_key_covers_the_code_the_fit_runs():
    sources, versions = fit_dependencies()
    data = "engine.molmo2.data."
    assert {f"{data}collate", f"{data}rig", f"{data}rig_render", f"{data}fast", "engine.molmo2.data"} <= set(sources)
    assert "engine.molmo2.attention.cudnn" in sources  # imported inside a function (segments.py): followed too
    assert {"python", "numpy", "tokenizers", "torch"} <= set(versions)


def test_a_change_to_anything_a_fit_depends_on_gives_a_new_key():
    sources, versions = fit_dependencies()
    key = fit_key(FIT_ARGUMENTS, sources, versions)
    assert fit_key(dict(FIT_ARGUMENTS), dict(sources), dict(versions)) == key
    keys = [fit_key({**FIT_ARGUMENTS, name: value + 1}, sources, versions) for name, value in FIT_ARGUMENTS.items()]
    keys += [fit_key(FIT_ARGUMENTS, {**sources, name: code + b"\n#"}, versions) for name, code in sources.items()]
    keys += [fit_key(FIT_ARGUMENTS, sources, {**versions, name: f"{v}.post1"}) for name, v in versions.items()]
    keys.append(fit_key(FIT_ARGUMENTS, {**sources, "engine.molmo2.data.new": b"x = 1"}, versions))  # a new import
    assert len(set(keys)) == len(keys) and key not in keys


def test_the_imports_followed_are_every_import_statement_absolute():
    source = """import numpy as np, json
from . import rig
from ..model.batch import IGNORE_INDEX  # a comment
from engine.molmo2.data.prompt import (
    ByteTokenizer,  # fmt: skip
    TokenLayout as Layout,
)
def f():
    from engine.molmo2.attention import cudnn
"""
    assert imported_modules(source, "engine.molmo2.data.collate", is_package=False) == {
        *("numpy", "json", "engine.molmo2.data", "engine.molmo2.data.rig"),
        *("engine.molmo2.model.batch", "engine.molmo2.model.batch.IGNORE_INDEX"),
        *("engine.molmo2.data.prompt", "engine.molmo2.data.prompt.ByteTokenizer"),
        *("engine.molmo2.data.prompt.TokenLayout", "engine.molmo2.attention", "engine.molmo2.attention.cudnn"),
    }
    assert imported_modules("from .attention import packing", "engine.molmo2", is_package=True) == {
        "engine.molmo2.attention",
        "engine.molmo2.attention.packing",
    }


def test_the_cache_serves_the_fit_it_would_compute(tmp_path, monkeypatch):
    from engine.molmo2.data.fast import FastTokenizer

    fits = tmp_path / "fits"
    monkeypatch.setenv(CACHE_VARIABLE, str(fits))
    first = make_fast_tokenizer(3, 200, scale=2.0, vocab_size=48)
    [saved] = fits.iterdir()
    with monkeypatch.context() as patched:  # the second call loads: it could not fit
        patched.setattr(FastTokenizer, "fit", lambda *a, **k: pytest.fail("fitted again"))
        assert make_fast_tokenizer(3, 200, scale=2.0, vocab_size=48) == first
    make_fast_tokenizer(4, 200, scale=2.0, vocab_size=48)
    assert len(list(fits.iterdir())) == 2  # other arguments, another key
    monkeypatch.delenv(CACHE_VARIABLE)
    assert make_fast_tokenizer(3, 200, scale=2.0, vocab_size=48) == first  # what a fresh fit gives
    assert FastTokenizer.load(saved) == first


def test_4b_batch_of_12_prefix_size(capsys):
    """Seed 000's bench batch: 12 samples, 1-2 cameras, max-crops 1, 4B geometry; a prefix of ~1.1k tokens."""
    fast = make_fast_tokenizer(0, 500)
    collator = Collator(FOUR_B, fast, ByteTokenizer.for_layout(FOUR_B), ImageGeometry.for_4b(), max_crops=1)
    ds = RigDataset(0, 12, image_size=(480, 640))
    batch = collator([ds.sample(i) for i in range(12)])
    counts = token_counts(batch)
    assert set(batch.n_cameras) == {1, 2}
    assert counts.image_tokens == tuple(410 * n for n in batch.n_cameras)
    assert 900 <= counts.prefix_padded <= 1300
    assert max(counts.prefix_lengths) == counts.prefix_padded
    assert batch.prefix.pixel_values.shape == (2 * sum(batch.n_cameras), 729, 588)
    assert bool((batch.suffix.labels[batch.suffix.action_mask] >= 152_064).all())
    assert bool((batch.suffix.labels[batch.suffix.action_mask] < 153_088).all())
    with capsys.disabled():
        print(f"\n4B batch of 12: cameras {batch.n_cameras}; prefix padded {counts.prefix_padded}, lengths "
              f"{counts.prefix_lengths}, padding {counts.prefix_padding_fraction:.1%}; suffix padded "
              f"{counts.suffix_padded}, FAST tokens {counts.action_tokens}, padding "
              f"{counts.suffix_padding_fraction:.1%}")  # fmt: skip
