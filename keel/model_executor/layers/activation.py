"""Activation functions by their config.json name (`hidden_act`).

The common ones are torch's own modules, which compute what transformers' `ACT2FN` entries
of the same name compute (`F.silu`, `F.gelu`, `F.relu`, tanh-approximated `F.gelu`); any other
name is looked up in `ACT2FN` itself. Importing `transformers.activations` costs ~1.3 s of
start-up (it imports torch.compile's Python layers), so it happens only for those names.
"""

from __future__ import annotations

from torch import nn

_TORCH_ACTIVATIONS = {
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "gelu": nn.GELU,
    "relu": nn.ReLU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
}


def get_act_fn(name: str) -> nn.Module:
    if name in _TORCH_ACTIVATIONS:
        return _TORCH_ACTIVATIONS[name]()
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ValueError(f"Unknown hidden_act {name!r} in config.json.")
    return ACT2FN[name]
