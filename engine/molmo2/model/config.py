"""Molmo2 geometry: frozen, validated dataclasses, the hub's config.json reader, and the named geometries.

Field values for "4b" are those of allenai/Molmo2-4B's config.json. The AR fields (FAST block, state slot) are
ours: they are not in the hub's config.json and travel in our own checkpoints under the top-level key
`AR_CONFIG_KEY`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The special tokens sit at fixed offsets above the base vocabulary, in the 128-row extension table
# (`wte.new_embedding`): at 4B their ids are 151936 + offset.
SPECIAL_TOKEN_OFFSETS = {
    "image_start": 0,  # <im_start>
    "image_end": 1,  # <im_end>
    "image_patch": 2,  # <im_patch> (also image_high_res_id): the positions that receive image features
    "image_col": 3,  # <im_col>
    "low_res_image_start": 4,  # <low_res_im_start>
    "image_prompt": 5,  # <|image|>: the chat template's placeholder, replaced by the processor
    "image_low_res": 6,  # <im_low>
    "frame_start": 7,
    "frame_end": 8,
    "video": 9,  # <|video|>
}

# Keys of the hub's config.json top level that name a special token, and the offset each must have.
_HUB_TOKEN_KEYS = {
    "image_start_token_id": "image_start",
    "image_end_token_id": "image_end",
    "image_patch_id": "image_patch",
    "image_high_res_id": "image_patch",
    "image_col_id": "image_col",
    "low_res_image_start_token_id": "low_res_image_start",
    "image_low_res_id": "image_low_res",
    "frame_start_token_id": "frame_start",
    "frame_end_token_id": "frame_end",
}

# Top-level key of our own config.json holding the AR fields (absent from the hub's file).
AR_CONFIG_KEY = "prereg_ar_config"


def _bad(owner: str, name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{owner}.{name} = {value!r} is invalid; allowed: {allowed}")


def _positive(owner: str, **values: int | float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise _bad(owner, name, value, "> 0")


@dataclass(frozen=True)
class TextConfig:
    """The Qwen3-style decoder."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # base vocabulary: rows of wte.embedding and of lm_head
    additional_vocab_size: int  # rows of wte.new_embedding (the image/video specials)
    rope_theta: float
    norm_eps: float
    max_position_embeddings: int

    def __post_init__(self) -> None:
        _positive(
            "TextConfig",
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
            max_position_embeddings=self.max_position_embeddings,
        )
        if self.num_heads % self.num_kv_heads:
            raise _bad("TextConfig", "num_kv_heads", self.num_kv_heads, f"a divisor of num_heads={self.num_heads}")
        if self.head_dim % 2:
            # rotate_half pairs dimension i with i + head_dim/2.
            raise _bad("TextConfig", "head_dim", self.head_dim, "an even number (RoPE rotates halves)")
        need = max(SPECIAL_TOKEN_OFFSETS.values()) + 1
        if self.additional_vocab_size < need:
            raise _bad(
                "TextConfig", "additional_vocab_size", self.additional_vocab_size, f">= {need} (the special tokens)"
            )

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class VisionConfig:
    """The ViT tower. `num_layers` is the DECLARED depth; only the blocks up to the deepest
    tap are built and stored (Molmo2Config.vit_stored_layers)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    image_size: tuple[int, int]  # (height, width) of one crop in pixels
    patch_size: int
    num_positions: int  # rows of the learned positional embedding
    norm_eps: float
    float32_attention: bool = True  # the hub computes q.k in fp32

    def __post_init__(self) -> None:
        _positive(
            "VisionConfig",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            patch_size=self.patch_size,
            num_positions=self.num_positions,
            norm_eps=self.norm_eps,
        )
        object.__setattr__(self, "image_size", tuple(self.image_size))
        if len(self.image_size) != 2 or any(s % self.patch_size for s in self.image_size):
            raise _bad("VisionConfig", "image_size", self.image_size, f"(h, w), both multiples of {self.patch_size}")
        if self.num_patches != self.num_positions:
            # The positional table is never interpolated (the hub only does so when the grid differs).
            raise _bad("VisionConfig", "num_positions", self.num_positions, f"{self.num_patches} (the patch grid)")

    @property
    def grid(self) -> tuple[int, int]:
        return (self.image_size[0] // self.patch_size, self.image_size[1] // self.patch_size)

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * 3


@dataclass(frozen=True)
class AdapterConfig:
    """2x2 attention pooling over the concatenated ViT taps, then the gated projector."""

    vit_layers: tuple[int, ...]  # as declared: negative indices count from the DECLARED ViT depth
    hidden_size: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    float32_attention: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "vit_layers", tuple(int(i) for i in self.vit_layers))
        if not self.vit_layers:
            raise _bad("AdapterConfig", "vit_layers", self.vit_layers, "at least one ViT layer index")
        _positive(
            "AdapterConfig",
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
        )


@dataclass(frozen=True)
class Molmo2Config:
    text: TextConfig
    vision: VisionConfig
    adapter: AdapterConfig
    # AR decoder: the FAST block is a second trainable extension table right after the specials.
    fast_vocab_size: int = 1024
    state_dim: int = 6  # the rig's robot state: the gripper's 6-d pose (data/rig.py STATE_DIM)
    vit_taps: tuple[int, ...] = field(init=False)  # vit_layers resolved to block indices, in concat order

    def __post_init__(self) -> None:
        _positive("Molmo2Config", fast_vocab_size=self.fast_vocab_size, state_dim=self.state_dim)
        depth = self.vision.num_layers
        for index in self.adapter.vit_layers:
            if not -depth <= index < depth:
                raise _bad("AdapterConfig", "vit_layers", self.adapter.vit_layers, f"indices in [-{depth}, {depth})")
        object.__setattr__(self, "vit_taps", tuple(i % depth for i in self.adapter.vit_layers))

    # ---- derived geometry ----
    @property
    def vit_stored_layers(self) -> int:
        """Blocks built and stored: up to the deepest tap (4B: 27 declared, taps 24 and 18, 25 stored)."""
        return max(self.vit_taps) + 1

    @property
    def pooling_input_dim(self) -> int:
        return self.vision.hidden_size * len(self.vit_taps)

    @property
    def fast_block_base(self) -> int:
        """First FAST token id: right after the extension rows (152,064 at 4B)."""
        return self.text.vocab_size + self.text.additional_vocab_size

    @property
    def logits_width(self) -> int:
        """Logit column == token id over [0, fast_block_base + fast_vocab_size); the extension columns are -inf."""
        return self.fast_block_base + self.fast_vocab_size

    def token_id(self, name: str) -> int:
        return self.text.vocab_size + SPECIAL_TOKEN_OFFSETS[name]

    @property
    def image_patch_id(self) -> int:
        return self.token_id("image_patch")

    @property
    def image_token_ids(self) -> tuple[int, ...]:
        """The tokens whose mm_token_type is 1 (the hub processor's image-block set)."""
        names = ("image_patch", "image_col", "image_start", "low_res_image_start", "frame_start", "image_end",
                 "frame_end", "image_low_res")  # fmt: skip
        return tuple(self.token_id(n) for n in names)

    # ---- constructors ----
    @classmethod
    def named(cls, name: str, **overrides: Any) -> "Molmo2Config":
        if name not in _NAMED:
            raise ValueError(f"unknown Molmo2 geometry {name!r}; allowed: {sorted(_NAMED)}")
        return _NAMED[name](**overrides)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, fast_vocab_size: int = 1024, state_dim: int = 6) -> "Molmo2Config":
        """Read a config.json: the hub's legacy layout (`vit_config`, `text_config.layer_norm_eps`, ...) or
        transformers' native one (`vision_config`, `rms_norm_eps`, `rope_parameters`, ...). Settings this port
        does not implement are refused, never ignored. The AR fields come from `AR_CONFIG_KEY` when present,
        else from the keyword arguments."""
        return _read_hf_config(d, fast_vocab_size=fast_vocab_size, state_dim=state_dim)

    def to_hf_dict(self) -> dict[str, Any]:
        """The hub's legacy config.json layout (what allenai/Molmo2-4B ships), plus our AR fields."""
        return _write_hf_config(self)


def _tiny(**overrides: Any) -> Molmo2Config:
    """Milliseconds per step on two CPU cores, with every mechanism of the 4B: GQA 4:2, per-head q/k norm, two
    ViT taps resolved against a deeper declared tower (declared 4, taps [-2, -4] -> blocks 2 and 0, 3 stored),
    a 3x3 patch grid (42 px / 14) so 2x2 pooling has partial groups, the extension rows and the FAST block."""
    text = TextConfig(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=320,
        additional_vocab_size=16,
        rope_theta=10_000.0,  # short sequences: a small theta makes every RoPE dimension turn
        norm_eps=1e-6,
        max_position_embeddings=4096,
    )
    vision = VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=2,
        head_dim=16,
        image_size=(42, 42),
        patch_size=14,
        num_positions=9,
        norm_eps=1e-6,
    )
    adapter = AdapterConfig(vit_layers=(-2, -4), hidden_size=32, num_heads=2, head_dim=16, intermediate_size=96)
    return Molmo2Config(**{"text": text, "vision": vision, "adapter": adapter, "fast_vocab_size": 48, **overrides})


def _4b(**overrides: Any) -> Molmo2Config:
    """allenai/Molmo2-4B, as its config.json gives it."""
    text = TextConfig(
        hidden_size=2560,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=9728,
        vocab_size=151_936,
        additional_vocab_size=128,
        rope_theta=5_000_000.0,
        norm_eps=1e-6,
        max_position_embeddings=36_864,
    )
    vision = VisionConfig(
        hidden_size=1152,
        intermediate_size=4304,
        num_layers=27,
        num_heads=16,
        head_dim=72,
        image_size=(378, 378),
        patch_size=14,
        num_positions=729,
        norm_eps=1e-6,
    )
    adapter = AdapterConfig(vit_layers=(-3, -9), hidden_size=1152, num_heads=16, head_dim=72, intermediate_size=9728)
    return Molmo2Config(**{"text": text, "vision": vision, "adapter": adapter, **overrides})


_NAMED = {"tiny": _tiny, "4b": _4b}


# ---------------------------------------------------------------------------------------------------------------
# config.json dialects
# ---------------------------------------------------------------------------------------------------------------

_MISSING = object()


class _Section:
    """One sub-dict of a config.json, read by name with the dialects' aliases; refuses what this port lacks."""

    def __init__(self, where: str, d: Any) -> None:
        if not isinstance(d, dict):
            raise ValueError(f"config.json: {where} must be an object, got {type(d).__name__}")
        self.where, self.d = where, d

    def get(self, *names: str, default: Any = _MISSING) -> Any:
        for name in names:
            if name in self.d:
                return self.d[name]
        if default is _MISSING:
            raise ValueError(f"config.json: {self.where}.{names[0]} is missing")
        return default

    def require(self, name: str, allowed: tuple[Any, ...], default: Any = _MISSING) -> Any:
        value = self.get(name, default=default)
        if value not in allowed:
            raise ValueError(
                f"config.json: {self.where}.{name} = {value!r} is not supported by this port; allowed: {allowed}"
            )
        return value

    def no_dropout(self, *names: str) -> None:
        for name in names:
            self.require(name, (0, 0.0), default=0.0)


def _read_hf_config(d: dict[str, Any], *, fast_vocab_size: int, state_dim: int) -> Molmo2Config:
    top = _Section("(top level)", d)
    legacy = "vit_config" in d
    if legacy == ("vision_config" in d):
        raise ValueError("config.json: expected exactly one of 'vit_config' (hub layout) or 'vision_config' "
                         "(transformers layout)")  # fmt: skip
    t = _Section("text_config", top.get("text_config"))
    v = _Section("vit_config" if legacy else "vision_config", top.get("vit_config" if legacy else "vision_config"))
    a = _Section("adapter_config", top.get("adapter_config"))

    # ---- decoder ----
    t.require("norm_after", (False,), default=False)  # post-norm blocks (a 7B-family option) are not built here
    t.require("use_qk_norm", (True,), default=True)
    t.require("qk_norm_type", ("qwen3",))  # "olmo" normalises the whole projection: not built here
    t.require("qkv_bias" if legacy else "attention_bias", (False,), default=False)
    t.require("hidden_act", ("silu",), default="silu")
    t.no_dropout("attention_dropout", "residual_dropout", "embedding_dropout")
    for section in (t, top):
        section.require("tie_word_embeddings", (False,), default=False)
    if legacy:
        t.require("rope_scaling", (None,), default=None)
        t.require("rope_scaling_layers", (None,), default=None)
        theta = t.get("rope_theta")
    else:
        rope = _Section("text_config.rope_parameters", t.get("rope_parameters"))
        # With the default type TFM's "scaled" and "unscaled" tables are equal, so rope_scaling_layers is moot.
        rope.require("rope_type", ("default",), default="default")
        theta = rope.get("rope_theta")
    hidden = t.get("hidden_size")
    heads = t.get("num_attention_heads")
    text = TextConfig(
        hidden_size=hidden,
        num_layers=t.get("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=t.get("num_key_value_heads", default=heads),
        head_dim=t.get("head_dim", default=hidden // heads),
        intermediate_size=t.get("intermediate_size"),
        vocab_size=t.get("vocab_size"),
        additional_vocab_size=t.get("additional_vocab_size"),
        rope_theta=float(theta),
        norm_eps=float(t.get("layer_norm_eps" if legacy else "rms_norm_eps", "layer_norm_eps")),
        max_position_embeddings=t.get("max_position_embeddings"),
    )

    # ---- vision tower ----
    v_heads = v.get("num_attention_heads")
    v.require("num_key_value_heads", (v_heads,), default=v_heads)
    v.require("hidden_act", ("gelu_pytorch_tanh",))
    v.require("num_channels", (3,), default=3)
    v.require("attention_bias", (True,), default=True)
    v.no_dropout("attention_dropout", "residual_dropout")
    vision = VisionConfig(
        hidden_size=v.get("hidden_size"),
        intermediate_size=v.get("intermediate_size"),
        num_layers=v.get("num_hidden_layers"),
        num_heads=v_heads,
        head_dim=v.get("head_dim"),
        image_size=tuple(v.get("image_default_input_size" if legacy else "image_size")),
        patch_size=v.get("image_patch_size" if legacy else "patch_size"),
        num_positions=v.get("image_num_pos" if legacy else "num_position_embeddings"),
        norm_eps=float(v.get("layer_norm_eps")),
        float32_attention=bool(v.get("float32_attention", default=True)),
    )

    # ---- adapter ----
    p_heads = a.get("num_attention_heads")
    a.require("num_key_value_heads", (p_heads,), default=p_heads)
    a.require("hidden_act", ("silu",))
    a.require("text_hidden_size", (hidden,))
    a.require("pooling_attention_mask", (True,), default=True)  # TFM always masks the invalid slots
    a.require("attention_bias", (True,), default=True)
    a.require("mlp_bias", (False,), default=False)
    a.no_dropout("attention_dropout", "residual_dropout", "image_feature_dropout")
    adapter = AdapterConfig(
        vit_layers=tuple(a.get("vit_layers" if legacy else "vision_feature_layer")),
        hidden_size=a.get("hidden_size"),
        num_heads=p_heads,
        head_dim=a.get("head_dim"),
        intermediate_size=a.get("intermediate_size"),
        float32_attention=bool(a.get("float32_attention", default=True)),
    )

    ar = _Section(AR_CONFIG_KEY, top.get(AR_CONFIG_KEY, default={}))
    config = Molmo2Config(
        text=text,
        vision=vision,
        adapter=adapter,
        fast_vocab_size=ar.get("fast_vocab_size", default=fast_vocab_size),
        state_dim=ar.get("state_dim", default=state_dim),
    )
    for key, name in _HUB_TOKEN_KEYS.items():
        top.require(key, (config.token_id(name),), default=config.token_id(name))
    return config


def _write_hf_config(config: Molmo2Config) -> dict[str, Any]:
    t, v, a = config.text, config.vision, config.adapter
    return {
        "architectures": ["Molmo2ForConditionalGeneration"],
        "model_type": "molmo2",
        "dtype": "float32",
        "tie_word_embeddings": False,
        "use_frame_special_tokens": False,
        **{key: config.token_id(name) for key, name in _HUB_TOKEN_KEYS.items()},
        "text_config": {
            "model_type": "molmo2_text",
            "hidden_size": t.hidden_size,
            "num_hidden_layers": t.num_layers,
            "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads,
            "head_dim": t.head_dim,
            "intermediate_size": t.intermediate_size,
            "hidden_act": "silu",
            "vocab_size": t.vocab_size,
            "additional_vocab_size": t.additional_vocab_size,
            "qkv_bias": False,
            "use_qk_norm": True,
            "qk_norm_type": "qwen3",
            "norm_after": False,
            "layer_norm_eps": t.norm_eps,
            "rope_theta": t.rope_theta,
            "rope_scaling": None,
            "rope_scaling_layers": None,
            "max_position_embeddings": t.max_position_embeddings,
            "attention_dropout": 0.0,
            "residual_dropout": 0.0,
            "embedding_dropout": 0.0,
        },
        "vit_config": {
            "model_type": "molmo2",
            "hidden_size": v.hidden_size,
            "intermediate_size": v.intermediate_size,
            "num_hidden_layers": v.num_layers,
            "num_attention_heads": v.num_heads,
            "num_key_value_heads": v.num_heads,
            "head_dim": v.head_dim,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": v.norm_eps,
            "image_default_input_size": list(v.image_size),
            "image_patch_size": v.patch_size,
            "image_num_pos": v.num_positions,
            "float32_attention": v.float32_attention,
            "attention_dropout": 0.0,
            "residual_dropout": 0.0,
        },
        "adapter_config": {
            "model_type": "molmo2",
            "vit_layers": list(a.vit_layers),
            "hidden_size": a.hidden_size,
            "num_attention_heads": a.num_heads,
            "num_key_value_heads": a.num_heads,
            "head_dim": a.head_dim,
            "intermediate_size": a.intermediate_size,
            "text_hidden_size": t.hidden_size,
            "hidden_act": "silu",
            "pooling_attention_mask": True,
            "float32_attention": a.float32_attention,
            "attention_dropout": 0.0,
            "residual_dropout": 0.0,
            "image_feature_dropout": 0.0,
        },
        AR_CONFIG_KEY: {"fast_vocab_size": config.fast_vocab_size, "state_dim": config.state_dim},
    }
