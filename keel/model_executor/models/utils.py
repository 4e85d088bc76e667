"""Loading HF-named checkpoint tensors into keel's modules (merged layers included)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from keel.model_executor.layers.linear import default_weight_loader
from keel.model_executor.weight_errors import WeightLoadError


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    stacked_params_mapping: list[tuple[str, str, str | int]],
                    skip: Callable[[str], bool] = lambda name: False) -> set[str]:
    """Copy each (HF name, tensor) into the parameter it belongs to: a merged one (`qkv_proj`
    from q/k/v, `gate_up_proj` from gate/up) through its shard's loader, else the parameter
    of the same name. Returns the HF names loaded; an unknown name is an error."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    for name, tensor in weights:
        if skip(name):
            continue
        for merged_name, hf_name, shard_id in stacked_params_mapping:
            if f".{hf_name}." not in name:
                continue
            target = name.replace(hf_name, merged_name)
            if target not in params:
                break
            _load(params[target], tensor, name, shard_id)
            break
        else:
            if name not in params:
                raise WeightLoadError(
                    f"Unexpected tensor {name!r} in the checkpoint: {type(model).__name__} "
                    f"with this config.json has no such parameter.")
            _load(params[name], tensor, name, None)
        loaded.add(name)
    return loaded


def _load(param: nn.Parameter, tensor: torch.Tensor, name: str, shard_id) -> None:
    loader = getattr(param, "weight_loader", None)
    try:
        if loader is None:
            default_weight_loader(param, tensor, name)
        elif shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
    except ValueError as e:
        raise WeightLoadError(f"Tensor {name!r}: {e}") from e
