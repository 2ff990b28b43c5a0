"""Molmo2 checkpoints in the Hugging Face hub layout: `config.json` (the hub's legacy keys),
`model.safetensors.index.json` (`metadata.total_size`, `weight_map`) and its shards, fp32 on disk, cast on load.
Loading is strict: the key set must be exactly the hub's for the config (plus, in our own AR checkpoints, all of
the AR extras); nothing is ever downloaded."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from engine.molmo2.model.config import Molmo2Config
from engine.molmo2.model.model import AR_EXTRA_KEYS, Molmo2Model, init_weights
from engine.molmo2.switches import BASELINE, Switches

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_NAME = "tokenizer.json"

Shape = tuple[int, ...]


class CheckpointKeyError(ValueError):
    """The checkpoint's tensors are not the ones this config needs."""


def hub_key_shapes(config: Molmo2Config) -> dict[str, Shape]:
    """Every tensor of the hub layout for `config`, in module order, derived from the config alone. Only the
    stored ViT blocks appear (4B: 25 of 27 declared)."""
    t, v, a = config.text, config.vision, config.adapter
    H = t.hidden_size
    shapes: dict[str, Shape] = {
        "model.transformer.wte.embedding": (t.vocab_size, H),
        "model.transformer.wte.new_embedding": (t.additional_vocab_size, H),
    }
    for i in range(t.num_layers):
        p = f"model.transformer.blocks.{i}."
        shapes |= {
            p + "attn_norm.weight": (H,),
            p + "self_attn.att_proj.weight": (t.q_width + 2 * t.kv_width, H),
            p + "self_attn.q_norm.weight": (t.head_dim,),
            p + "self_attn.k_norm.weight": (t.head_dim,),
            p + "self_attn.attn_out.weight": (H, t.q_width),
            p + "ff_norm.weight": (H,),
            p + "mlp.ff_proj.weight": (2 * t.intermediate_size, H),
            p + "mlp.ff_out.weight": (H, t.intermediate_size),
        }
    shapes["model.transformer.ln_f.weight"] = (H,)
    vit = "model.vision_backbone.image_vit."
    shapes |= {
        vit + "patch_embedding.weight": (v.hidden_size, v.patch_dim),
        vit + "patch_embedding.bias": (v.hidden_size,),
        vit + "positional_embedding": (v.num_positions, v.hidden_size),
    }
    width = v.num_heads * v.head_dim
    for j in range(config.vit_stored_layers):
        p = f"{vit}transformer.resblocks.{j}."
        for w in ("wq", "wk", "wv"):
            shapes |= {f"{p}attention.{w}.weight": (width, v.hidden_size), f"{p}attention.{w}.bias": (width,)}
        shapes |= {f"{p}attention.wo.weight": (v.hidden_size, width), f"{p}attention.wo.bias": (v.hidden_size,)}
        for norm in ("attention_norm", "ffn_norm"):
            shapes |= {f"{p}{norm}.weight": (v.hidden_size,), f"{p}{norm}.bias": (v.hidden_size,)}
        shapes |= {
            p + "feed_forward.w1.weight": (v.intermediate_size, v.hidden_size),
            p + "feed_forward.w1.bias": (v.intermediate_size,),
            p + "feed_forward.w2.weight": (v.hidden_size, v.intermediate_size),
            p + "feed_forward.w2.bias": (v.hidden_size,),
        }
    pool = "model.vision_backbone.image_pooling_2d."
    width = a.num_heads * a.head_dim
    for w in ("wq", "wk", "wv"):
        shapes |= {f"{pool}{w}.weight": (width, config.pooling_input_dim), f"{pool}{w}.bias": (width,)}
    shapes |= {pool + "wo.weight": (a.hidden_size, width), pool + "wo.bias": (a.hidden_size,)}
    proj = "model.vision_backbone.image_projector."
    shapes |= {
        proj + "w1.weight": (a.intermediate_size, a.hidden_size),
        proj + "w2.weight": (H, a.intermediate_size),
        proj + "w3.weight": (a.intermediate_size, a.hidden_size),
    }
    shapes["lm_head.weight"] = (t.vocab_size, H)
    return shapes


def ar_extra_shapes(config: Molmo2Config) -> dict[str, Shape]:
    H = config.text.hidden_size
    shapes = {
        "model.transformer.wte.fast_embed": (config.fast_vocab_size, H),
        "fast_head.weight": (config.fast_vocab_size, H),
        "state_proj.weight": (H, config.state_dim),
        "state_proj.bias": (H,),
    }
    assert tuple(shapes) == AR_EXTRA_KEYS
    return shapes


def parameter_count(config: Molmo2Config, *, ar_extras: bool = False) -> int:
    """Parameters of the hub layout (4,850,869,200 at 4B), optionally with the AR extras; nothing allocated."""
    shapes = hub_key_shapes(config) | (ar_extra_shapes(config) if ar_extras else {})
    return sum(math.prod(s) for s in shapes.values())


def _listing(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return f"{len(keys)} key(s): {shown}" + (", ..." if len(keys) > limit else "")


def _check_keys(found: dict[str, Shape], config: Molmo2Config, where: str) -> bool:
    """Strict key/shape check; returns whether the AR extras are present (all of them) or absent (all)."""
    expected = hub_key_shapes(config)
    extras = ar_extra_shapes(config)
    present_extras = [k for k in extras if k in found]
    has_extras = len(present_extras) == len(extras)
    if present_extras and not has_extras:
        missing = [k for k in extras if k not in found]
        raise CheckpointKeyError(f"{where}: partial AR extras; missing {_listing(missing)}")
    if has_extras:
        expected = expected | extras
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    problems = []
    if missing:
        problems.append(f"missing {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected {_listing(unexpected)}")
    if problems:
        raise CheckpointKeyError(f"{where}: not the hub layout for this config: " + "; ".join(problems))
    wrong = [f"{k} {found[k]} != {expected[k]}" for k in expected if tuple(found[k]) != expected[k]]
    if wrong:
        raise CheckpointKeyError(f"{where}: wrong shapes for {_listing(wrong)}")
    return has_extras


def _truncated(config: Molmo2Config, truncate_layers: int | None) -> Molmo2Config:
    if truncate_layers is None:
        return config
    if not 1 <= truncate_layers <= config.text.num_layers:
        raise ValueError(f"truncate_layers = {truncate_layers} is invalid; allowed: 1..{config.text.num_layers} "
                         f"(the checkpoint's decoder depth)")  # fmt: skip
    return dataclasses.replace(config, text=dataclasses.replace(config.text, num_layers=truncate_layers))


def _is_kept(key: str, mounted: Molmo2Config) -> bool:
    prefix = "model.transformer.blocks."
    return not key.startswith(prefix) or int(key[len(prefix) :].split(".", 1)[0]) < mounted.text.num_layers


def load_checkpoint(
    directory: str | Path,
    config: Molmo2Config | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    truncate_layers: int | None = None,
    switches: Switches = BASELINE,
    seed: int = 0,
) -> Molmo2Model:
    """Builds the model from a hub-layout directory. `config` defaults to the directory's config.json. With
    `truncate_layers=N` only decoder layers 0..N-1 are mounted. AR extras absent from the checkpoint (any hub
    checkpoint) are freshly initialised from `seed`."""
    directory = Path(directory)
    if config is None:
        config = Molmo2Config.from_hf_dict(json.loads((directory / CONFIG_NAME).read_text()))
    index = json.loads((directory / INDEX_NAME).read_text())
    weight_map: dict[str, str] = index["weight_map"]

    shapes: dict[str, Shape] = {}
    by_shard: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(key)
    for shard, keys in by_shard.items():
        with safe_open(directory / shard, framework="pt") as f:
            stored = set(f.keys())
            absent = [k for k in keys if k not in stored]
            if absent:
                raise CheckpointKeyError(f"{directory / shard}: the index maps {_listing(absent)} here, but the "
                                         f"shard does not hold them")  # fmt: skip
            shapes |= {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    has_extras = _check_keys(shapes, config, str(directory))

    mounted = _truncated(config, truncate_layers)
    state: dict[str, torch.Tensor] = {}
    for shard, keys in by_shard.items():
        with safe_open(directory / shard, framework="pt") as f:
            for key in keys:
                if _is_kept(key, mounted):
                    state[key] = f.get_tensor(key).to(device=device, dtype=dtype)
    if not has_extras:
        state |= {k: torch.empty(s, device=device, dtype=dtype) for k, s in ar_extra_shapes(mounted).items()}

    with torch.device("meta"):
        model = Molmo2Model(mounted, switches)
    model.load_state_dict(state, strict=True, assign=True)
    if not has_extras:
        init_weights(model, seed, only=AR_EXTRA_KEYS)
    return model


def write_checkpoint(
    model_or_state: Molmo2Model | dict[str, torch.Tensor],
    config: Molmo2Config,
    directory: str | Path,
    *,
    shard_max_bytes: int = 5 * 2**30,
    ar_extras: bool = True,
) -> None:
    """Writes exactly the hub layout (fp32), with the AR extras unless `ar_extras=False` (a pure hub checkpoint).
    Shards are filled in module order up to `shard_max_bytes` each (a single larger tensor gets its own)."""
    state = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else dict(model_or_state)
    order = list(hub_key_shapes(config)) + (list(AR_EXTRA_KEYS) if ar_extras else [])
    if not ar_extras:
        state = {k: v for k, v in state.items() if k not in AR_EXTRA_KEYS}
    _check_keys({k: tuple(v.shape) for k, v in state.items()}, config, "write_checkpoint")

    shards: list[list[str]] = [[]]
    size = 0
    for key in order:
        nbytes = state[key].numel() * 4
        if shards[-1] and size + nbytes > shard_max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for number, keys in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: state[k].detach().to(device="cpu", dtype=torch.float32).contiguous() for k in keys}
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map |= {k: name for k in keys}
    total = sum(state[k].numel() for k in order)
    index = {"metadata": {"total_parameters": total, "total_size": total * 4}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (directory / CONFIG_NAME).write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The checkpoint's own tokenizer.json: a checkpoint carries its tokenizer, so ids never depend on a download."""
    path = Path(directory) / TOKENIZER_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json in the checkpoint directory (nothing is downloaded)")
    return Tokenizer.from_file(str(path))
