"""X5: the decoder blocks' four linears as float8 matmuls in training, through torchao's float8 training recipe
(dynamic tensorwise scales; e4m3 for inputs and weights, e5m2 for output gradients; master weights, optimizer and
accumulation keep their own precision). Evaluation and decode keep the bf16 linears.

A twin shares its base Linear's weight Parameter, so the optimizer, the state dict and checkpoints see one
parameter, and a rung can flip the switch without a reload. torchao is imported only when the switch is on."""

from __future__ import annotations

from torch import nn


def float8_twin(linear: nn.Linear) -> nn.Linear:
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as missing:
        raise RuntimeError("the fp8_decoder_linears switch (X5) needs torchao: pip install 'prereg[fp8]'") from missing
    # pad_inner_dim: the weight gradient's inner dimension is the token count, which packing does not round to the
    # multiple of 16 that float8 matmuls need.
    return Float8Linear.from_float(linear, Float8LinearConfig(pad_inner_dim=True))


class Float8Linears:
    """Mixed into a module whose `FLOAT8_LINEARS` name its linears: `linear(name)` is the float8 twin in training
    with the switch on, the module's own Linear otherwise. Twins live in __dict__, never as submodules (no extra
    state-dict keys)."""

    FLOAT8_LINEARS: tuple[str, ...] = ()
    float8 = False

    def set_float8(self, on: bool) -> None:
        if on:
            for name in self.FLOAT8_LINEARS:
                base = getattr(self, name)
                twin = self.__dict__.get(f"_float8_{name}")
                if twin is None or twin.weight is not base.weight:
                    self.__dict__[f"_float8_{name}"] = float8_twin(base)
        self.float8 = on

    def linear(self, name: str) -> nn.Linear:
        if self.float8 and self.training:
            return self.__dict__[f"_float8_{name}"]
        return getattr(self, name)
