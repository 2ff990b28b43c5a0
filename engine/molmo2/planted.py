"""The planted-mismatch probe's child process: a batch whose <im_patch> count disagrees with its image
features must abort the forward AT THE PATCH-COUNT GUARD. It runs apart from the gate because a CUDA
device-side assert (P3a) poisons the process's CUDA context. Exit 0: the forward completed; GUARD_ABORTED: the
guard aborted it; anything else: it aborted somewhere else (an index out of range further on aborts a mismatched
batch too, so "it aborted" alone would pass with the guard gone). Only GUARD_ABORTED passes the oracle.

    python -m engine.molmo2.planted --device cuda --switch device_assert_patch_count
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback

import torch

GUARD_ABORTED = 3
# The same fault planted in training: a rung process started with this variable set to SWITCH@STEP (say
# "no_embed_clone@3") crashes at that step of a run with that switch on, at the model's own patch-count guard: the
# step's first chunk carries one <im_patch> fewer than its images have features. A real crash of the real step,
# for what a crash does to a ladder (engine/crash.py); a run without the switch trains as ever.
CRASH_VARIABLE = "PREREG_MOLMO2_PLANT_CRASH"
GUARD_FUNCTION = "_add_image_features"
# The guard's statements in that function: the baseline's host-side raise, P3a's device-side assert.
GUARD_LINES = ("raise ValueError(", "torch._assert_async(")


def raised_at_guard(error: BaseException) -> bool:
    """Whether the innermost frame of the model's code that raised is the patch-count guard."""
    frames = [
        f for f in traceback.extract_tb(error.__traceback__) if f.filename.endswith(os.path.join("model", "model.py"))
    ]
    return bool(frames) and frames[-1].name == GUARD_FUNCTION and (frames[-1].line or "").startswith(GUARD_LINES)


def mismatched(batch, image_patch_id: int, end_id: int):
    """The batch with its first <im_patch> replaced: one fewer than the images have features."""
    ids = batch.prefix.input_ids.clone()
    first_patch = int((ids == image_patch_id).nonzero()[0, 1])
    ids[0, first_patch] = end_id
    return dataclasses.replace(batch, prefix=dataclasses.replace(batch.prefix, input_ids=ids))


def planted_crash(environ: dict[str, str]) -> tuple[str, int] | None:
    """(switch, step) of the crash CRASH_VARIABLE plants, or None when it is unset."""
    value = environ.get(CRASH_VARIABLE)
    if not value:
        return None
    switch, _, step = value.partition("@")
    if not switch or not step.isdigit() or int(step) < 1:
        raise ValueError(f"{CRASH_VARIABLE} = {value!r}: expected SWITCH@STEP with a step >= 1, e.g. no_embed_clone@3")
    return switch, int(step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.molmo2.planted")
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--switch", required=True)
    args = parser.parse_args(argv)

    from engine.molmo2.data.collate import Collator, make_fast_tokenizer
    from engine.molmo2.data.processor import ImageGeometry
    from engine.molmo2.data.prompt import ByteTokenizer, TokenLayout
    from engine.molmo2.data.rig import RigDataset
    from engine.molmo2.model.ar import ar_forward
    from engine.molmo2.model.config import Molmo2Config
    from engine.molmo2.model.model import Molmo2Model, init_weights
    from engine.molmo2.switches import Switches

    if args.device == "cuda":
        # A device-side assert then raises at the op whose kernel failed, so its frame says which guard it was.
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
    device = torch.device(args.device)
    config = Molmo2Config.named("tiny")
    t = config.text
    layout = TokenLayout.for_tiny(t.vocab_size, t.additional_vocab_size, config.fast_vocab_size)
    collator = Collator(
        layout,
        make_fast_tokenizer(0, 200, scale=2.0, vocab_size=config.fast_vocab_size),
        ByteTokenizer.for_layout(layout),
        ImageGeometry.for_tiny(),
        1,
    )
    batch = mismatched(collator([RigDataset(0, 2).sample(i) for i in range(2)]), config.image_patch_id, layout.end_id)
    batch = batch.to(device)
    model = Molmo2Model(config, Switches.from_names([args.switch])).to(device)
    init_weights(model, 0)
    try:
        logits = ar_forward(model, batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as error:
        where = "at the patch-count guard" if raised_at_guard(error) else "elsewhere than the patch-count guard"
        print(f"aborted {where}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
              file=sys.stderr)  # fmt: skip
        if raised_at_guard(error):
            return GUARD_ABORTED
        traceback.print_exc()
        return 1
    print(f"forward completed: logits {tuple(logits.shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
