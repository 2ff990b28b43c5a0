"""The text side: the token-id layout, text tokenizers, and prompt / suffix assembly.

Id layout (allenai/Molmo2-4B's config.json and added_tokens.json, plus the rows this workload adds):
    [0, vocab_size)                                  base vocabulary (text; lm_head rows)
    vocab_size + {0..9}                              image/video specials in the extension table
    vocab_size + 10                                  the state slot (ours; see STATE_SLOT_OFFSET)
    [vocab_size + additional, ... + fast_vocab_size) the FAST block (4B: [152,064, 153,088))

Prompt (ChatML, the shipped chat template's bytes with our content; bos = `<|im_end|>`, as the hub processor
prepends it):
    <|im_end|> {label_i image_i}... <|im_start|>user\\n{instruction} [k: v]... [generate|fields] <state>
    <|im_end|>\\n<|im_start|>assistant\\n
Images come first, as the template hoists them. Labels: the template writes nothing before a single image and
`Image i` before each of several; we bind a camera kind to that label in a bracket group — `[front camera]`
for one image, `[front camera| Image 1]` for several — and fall back to the template's own labels when the
sample's camera kinds are dropped. The state slot is the last token inside the user turn, right before its
`<|im_end|>\\n` close.

Suffix: `subgoal: reach holding: no ...\\n` (the aux fields present) + FAST ids + `<|im_end|>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Protocol, Sequence

from tokenizers import Tokenizer

from engine.molmo2.data.processor import ImageTokenIds

# Offsets above vocab_size of the extension table's rows (the hub checkpoint's added_tokens.json).
IMAGE_SPECIAL_OFFSETS = {
    "im_start": 0,
    "im_end": 1,
    "im_patch": 2,
    "im_col": 3,
    "low_res_im_start": 4,
    "image_placeholder": 5,  # <|image|>: the template's placeholder; the processor replaces it, never in our ids
    "im_low": 6,
    "frame_start": 7,
    "frame_end": 8,
    "video": 9,
}
# The image-block tokens (mm_token_type_ids = 1): the hub processor's `image_token_ids` set.
_IMAGE_BLOCK = ("im_patch", "im_col", "im_start", "low_res_im_start", "frame_start", "im_end", "frame_end", "im_low")
# The state slot takes the first unused row of the extension table: it already has an embedding row (no new
# table), lm_head cannot produce it (ids >= vocab_size have no head row), and it is not an image-block id, so
# it stays a causal text position that the model's state projection writes into.
STATE_SLOT_OFFSET = 10


@dataclass(frozen=True)
class TokenLayout:
    vocab_size: int  # base vocabulary: lm_head rows
    pad_id: int
    im_start_text_id: int  # <|im_start|>
    im_end_text_id: int  # <|im_end|>: also bos and eos, and the suffix's end token
    additional_vocab_size: int = 128  # the extension table (image specials + the state slot)
    fast_vocab_size: int = 1024  # the FAST block

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.fast_vocab_size < 1:
            raise ValueError(f"TokenLayout sizes vocab={self.vocab_size}, fast={self.fast_vocab_size}; allowed: >= 1")
        if self.additional_vocab_size <= STATE_SLOT_OFFSET:
            raise ValueError(
                f"TokenLayout.additional_vocab_size = {self.additional_vocab_size}; allowed: > {STATE_SLOT_OFFSET} "
                "(the image specials and the state slot live there)"
            )
        text = {"pad_id": self.pad_id, "im_start_text_id": self.im_start_text_id,
                "im_end_text_id": self.im_end_text_id}  # fmt: skip
        for name, value in text.items():
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"TokenLayout.{name} = {value}; allowed: [0, {self.vocab_size})")
        if len(set(text.values())) != len(text):
            raise ValueError(f"TokenLayout text specials must be distinct; got {text}")

    @classmethod
    def for_4b(cls, fast_vocab_size: int = 1024) -> "TokenLayout":
        """allenai/Molmo2-4B (its special_tokens_map.json): pad <|endoftext|> 151643, <|im_start|> 151644,
        <|im_end|> 151645; the FAST block [152,064, 152,064 + fast_vocab_size)."""
        return cls(vocab_size=151_936, pad_id=151_643, im_start_text_id=151_644, im_end_text_id=151_645,
                   fast_vocab_size=fast_vocab_size)  # fmt: skip

    @classmethod
    def for_tiny(cls, vocab_size: int, additional_vocab_size: int = 16, fast_vocab_size: int = 48) -> "TokenLayout":
        """Random-init profiles: pad, <|im_start|>, <|im_end|> at ids 0, 1, 2; ByteTokenizer bytes from id 3."""
        return cls(vocab_size=vocab_size, pad_id=0, im_start_text_id=1, im_end_text_id=2,
                   additional_vocab_size=additional_vocab_size, fast_vocab_size=fast_vocab_size)  # fmt: skip

    # ---- ids ----
    def special_id(self, name: str) -> int:
        if name not in IMAGE_SPECIAL_OFFSETS:
            raise ValueError(f"unknown special {name!r}; allowed: {sorted(IMAGE_SPECIAL_OFFSETS)}")
        return self.vocab_size + IMAGE_SPECIAL_OFFSETS[name]

    @property
    def bos_id(self) -> int:
        return self.im_end_text_id

    @property
    def end_id(self) -> int:
        return self.im_end_text_id

    @property
    def state_id(self) -> int:
        return self.vocab_size + STATE_SLOT_OFFSET

    @property
    def image_token_ids(self) -> ImageTokenIds:
        return ImageTokenIds(*(self.special_id(n) for n in ("im_start", "im_end", "im_patch", "im_col",
                                                            "low_res_im_start")))  # fmt: skip

    @property
    def image_block_ids(self) -> frozenset[int]:
        return frozenset(self.special_id(n) for n in _IMAGE_BLOCK)

    @property
    def fast_base(self) -> int:
        return self.vocab_size + self.additional_vocab_size

    @property
    def fast_end(self) -> int:
        """One past the last FAST id; also the number of distinct ids the model embeds."""
        return self.fast_base + self.fast_vocab_size

    def is_fast(self, token_id: int) -> bool:
        return self.fast_base <= token_id < self.fast_end

    def fast_id(self, bpe_id: int) -> int:
        if not 0 <= bpe_id < self.fast_vocab_size:
            raise ValueError(f"FAST BPE id {bpe_id}; allowed: [0, {self.fast_vocab_size})")
        return self.fast_base + bpe_id

    @property
    def chat_special_ids(self) -> frozenset[int]:
        return frozenset({self.pad_id, self.im_start_text_id, self.im_end_text_id})


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 byte b -> id b + offset: the text tokenizer of random-init profiles, where no tokenizer ships."""

    def __init__(self, offset: int, layout: TokenLayout) -> None:
        ids = range(offset, offset + 256)
        if offset < 0 or ids[-1] >= layout.vocab_size:
            raise ValueError(f"ByteTokenizer offset {offset}: ids {ids[0]}..{ids[-1]} leave [0, {layout.vocab_size})")
        clash = sorted(layout.chat_special_ids.intersection(ids))
        if clash:
            raise ValueError(f"ByteTokenizer offset {offset} would emit the chat special id(s) {clash}")
        self.offset = offset

    @classmethod
    def for_layout(cls, layout: TokenLayout) -> "ByteTokenizer":
        """The lowest offset whose 256 ids avoid the chat specials (4B: 0; tiny: 3)."""
        offset = 0
        while clash := layout.chat_special_ids.intersection(range(offset, offset + 256)):
            offset = max(clash) + 1
        return cls(offset, layout)

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        bad = [i for i in ids if not self.offset <= i < self.offset + 256]
        if bad:
            byte_ids = f"[{self.offset}, {self.offset + 256})"
            raise ValueError(f"ByteTokenizer.decode: ids {bad[:5]} are not byte ids {byte_ids}")
        # Generated text can split a UTF-8 character; show it as U+FFFD rather than refuse to print it.
        return bytes(i - self.offset for i in ids).decode("utf-8", errors="replace")


class CheckpointTokenizer:
    """The checkpoint's own tokenizer.json (Qwen2-family BPE at 4B), checked against the layout."""

    _CHAT_TOKENS = {"<|endoftext|>": "pad_id", "<|im_start|>": "im_start_text_id", "<|im_end|>": "im_end_text_id"}

    def __init__(self, tokenizer: Tokenizer, layout: TokenLayout) -> None:
        for token, field in self._CHAT_TOKENS.items():
            found, expected = tokenizer.token_to_id(token), getattr(layout, field)
            if found != expected:
                raise ValueError(f"tokenizer maps {token} to {found}; the layout's {field} is {expected}")
        self._tokenizer = tokenizer
        self._layout = layout

    @classmethod
    def from_file(cls, path: str | Path, layout: TokenLayout) -> "CheckpointTokenizer":
        return cls(Tokenizer.from_file(str(path)), layout)

    def encode(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        special = [i for i in ids if i >= self._layout.vocab_size or i in self._layout.chat_special_ids]
        if special:
            raise ValueError(f"text {text!r} encodes to special id(s) {special}; prompt text must be plain text")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def text_tokenizer_for(layout: TokenLayout, checkpoint_dir: str | Path | None) -> TextTokenizer:
    """The checkpoint's tokenizer.json when a checkpoint is given (it must ship one), bytes otherwise."""
    if checkpoint_dir is None:
        return ByteTokenizer.for_layout(layout)
    path = Path(checkpoint_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a checkpoint carries its tokenizer")
    return CheckpointTokenizer.from_file(path, layout)


# ---- assembly ----
@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    image_block: tuple[bool, ...]  # per id: an image-block token (mm_token_type_ids = 1)
    state_index: int


def camera_label(index: int, n_images: int, kind: str | None) -> str:
    if kind is None:
        return f"Image {index + 1}" if n_images > 1 else ""
    return f"[{kind} camera| Image {index + 1}]" if n_images > 1 else f"[{kind} camera]"


def user_text(instruction: str, condition: Mapping[str, str], generate: Sequence[str]) -> str:
    parts = [instruction, *(f"[{k}: {v}]" for k, v in condition.items()), f"[generate|{' '.join(generate)}]"]
    return " ".join(parts)


def aux_text(aux: Mapping[str, str]) -> str:
    return " ".join(f"{k}: {v}" for k, v in aux.items()) + "\n" if aux else ""


def assemble_prompt(
    layout: TokenLayout,
    tokenizer: TextTokenizer,
    images: Sequence[Sequence[int]],
    camera_kinds: Sequence[str | None],
    instruction: str,
    condition: Mapping[str, str],
    generate: Sequence[str],
) -> Prompt:
    """`images`: each image's token ids (processor.image_token_ids), in camera order."""
    if len(images) != len(camera_kinds) or not images:
        raise ValueError(f"{len(images)} images with {len(camera_kinds)} camera kinds; need one kind per image, >= 1")
    block = layout.image_block_ids
    ids: list[int] = [layout.bos_id]
    for i, (image, kind) in enumerate(zip(images, camera_kinds)):
        ids += tokenizer.encode(camera_label(i, len(images), kind)) + list(image)
    ids += [layout.im_start_text_id] + tokenizer.encode("user\n" + user_text(instruction, condition, generate))
    state_index = len(ids)
    ids += [layout.state_id, layout.im_end_text_id] + tokenizer.encode("\n")
    ids += [layout.im_start_text_id] + tokenizer.encode("assistant\n")
    return Prompt(ids=tuple(ids), image_block=tuple(i in block for i in ids), state_index=state_index)


def assemble_suffix(
    layout: TokenLayout, tokenizer: TextTokenizer, aux: Mapping[str, str], fast_ids: Sequence[int]
) -> tuple[int, ...]:
    """Aux text, the FAST BPE ids moved into the FAST block, the end token."""
    return tuple(tokenizer.encode(aux_text(aux)) + [layout.fast_id(i) for i in fast_ids] + [layout.end_id])


@dataclass(frozen=True)
class ParsedSuffix:
    aux_text: str
    fast_ids: tuple[int, ...]  # BPE ids (block base removed), for FastTokenizer.decode
    ended: bool  # the end token was reached


def parse_suffix(ids: Sequence[int], layout: TokenLayout, tokenizer: TextTokenizer) -> ParsedSuffix:
    """Split generated suffix ids (up to the first end token) into aux text and FAST ids. Text after the
    first FAST id is malformed output: ValueError naming it."""
    ids = list(ids)
    ended = layout.end_id in ids
    if ended:
        ids = ids[: ids.index(layout.end_id)]
    first_fast = next((k for k, i in enumerate(ids) if layout.is_fast(i)), len(ids))
    tail = ids[first_fast:]
    stray = [i for i in tail if not layout.is_fast(i)]
    if stray:
        raise ValueError(f"suffix has non-FAST id(s) {stray[:5]} after its first FAST id")
    return ParsedSuffix(tokenizer.decode(ids[:first_fast]), tuple(i - layout.fast_base for i in tail), ended)
