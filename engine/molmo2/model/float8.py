"""X5, X6 and X8: decoder linears as float8 matmuls in training, through torchao's float8 training recipes: X5 the
blocks' four linears with one dynamic scale per tensor (e4m3 for inputs and weights, e5m2 for output gradients), X6
the four with one per row (e4m3 throughout, scales rounded to powers of two: torchao's "rowwise"), X8 X5's recipe on
the two that read an RMSNorm's output. Master weights, optimizer and accumulation keep their own precision;
evaluation and decode keep the bf16 linears.

A twin shares its base Linear's weight Parameter, so the optimizer, the state dict and checkpoints see one
parameter, and a rung can flip the switch without a reload. torchao is imported only when the switch is on."""

from __future__ import annotations

import dataclasses

from torch import nn

RECIPES = ("tensorwise", "rowwise")


def float8_twin(linear: nn.Linear, recipe: str = "tensorwise") -> nn.Linear:
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as missing:
        raise RuntimeError("the float8 switches (X5, X6, X8) need torchao: pip install 'prereg[fp8]'") from missing
    assert recipe in RECIPES, recipe
    # pad_inner_dim: the weight gradient's inner dimension is the token count, which packing does not round to the
    # multiple of 16 that float8 matmuls need.
    if recipe == "tensorwise":
        config = Float8LinearConfig(pad_inner_dim=True)
    else:
        config = Float8LinearConfig.from_recipe_name("rowwise")
        config = dataclasses.replace(config, pad_inner_dim=True)
    return Float8Linear.from_float(linear, config)


class Float8Linears:
    """Mixed into a module whose `FLOAT8_LINEARS` name its linears: `linear(name)` is the float8 twin in training
    for a linear the plan converts, the module's own Linear otherwise. Twins live in __dict__, never as submodules
    (no extra state-dict keys)."""

    FLOAT8_LINEARS: tuple[str, ...] = ()
    float8: str | None = None  # the recipe in use, or None for the module's own linears
    float8_names: frozenset[str] = frozenset()  # of FLOAT8_LINEARS, those the recipe converts

    def set_float8(self, plan: tuple[str, frozenset[str]] | None) -> None:
        """plan: (recipe, the linear names it converts; names of other modules are ignored), or None for bf16."""
        recipe, names = plan if plan is not None else (None, frozenset())
        self.float8_names = frozenset(self.FLOAT8_LINEARS) & names
        for name in sorted(self.float8_names):
            base = getattr(self, name)
            twin = self.__dict__.get(f"_float8_{recipe}_{name}")
            if twin is None or twin.weight is not base.weight:
                self.__dict__[f"_float8_{recipe}_{name}"] = float8_twin(base, recipe)
        self.float8 = recipe

    def linear(self, name: str) -> nn.Linear:
        if self.training and name in self.float8_names:
            return self.__dict__[f"_float8_{self.float8}_{name}"]
        return getattr(self, name)
