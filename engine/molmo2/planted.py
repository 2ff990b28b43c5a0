"""The planted-mismatch probe's child process: a batch whose <im_patch> count disagrees with its image
features must abort the forward. It runs apart from the gate because a CUDA device-side assert (P3a) poisons
the process's CUDA context. Exit 0 means the forward completed (the oracle fails); non-zero means it aborted.

    python -m engine.molmo2.planted --device cuda --switch device_assert_patch_count
"""

from __future__ import annotations

import argparse
import sys

import torch


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
    batch = collator([RigDataset(0, 2).sample(i) for i in range(2)])
    ids = batch.prefix.input_ids.clone()
    first_patch = int((ids == config.image_patch_id).nonzero()[0, 1])
    ids[0, first_patch] = layout.end_id  # one <im_patch> fewer than the images have features
    planted = type(batch.prefix)(**{**vars(batch.prefix), "input_ids": ids})
    batch = type(batch)(prefix=planted, suffix=batch.suffix, actions=batch.actions, n_cameras=batch.n_cameras).to(
        device
    )
    model = Molmo2Model(config, Switches.from_names([args.switch])).to(device)
    init_weights(model, 0)
    logits = ar_forward(model, batch)
    if device.type == "cuda":
        torch.cuda.synchronize()  # a device-side assert surfaces here
    print(f"forward completed: logits {tuple(logits.shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
