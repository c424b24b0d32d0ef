"""Sharded training state: torch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Under DDP every process holds all trainable weights, their gradients and the optimizer state (16 bytes a
parameter with fp32 AdamW). ``zero_stage`` spreads them over the processes, with the names DeepSpeed made
familiar (its ZeRO stages), carried out by FSDP2:

- ``0``: DDP, nothing sharded;
- ``2``: weights, gradients and optimizer state sharded between steps; a unit's weights, once gathered,
  stay until its backward ends (``reshard_after_forward=False``: less communication, more memory);
- ``3``: each unit's weights are freed again right after its forward (``reshard_after_forward=True``, the
  ZeRO-3 / FULL_SHARD layout).

Each block class named in ``block_classes`` becomes one FSDP unit, so only the blocks in use hold full
weights. Processes come from ``accelerate launch`` as usual, but the sharding is applied here rather than
by accelerate's FSDP plugin: accelerate 1.15 turns FSDP on only for GPU-class devices (on CPU processes it
silently falls back to DDP), while ``fully_shard`` is the same engine on CPUs, GPUs and NPUs.

Checkpoints and final saves hold the *full* (unsharded) state: every process takes part in gathering it,
the main process receives it on the CPU. A sharded run can therefore resume at another process count.
DeepSpeed is not used: ``TrainStep`` owns accumulation, loss scaling and clipping, which DeepSpeed's engine
takes over; FSDP2 shards the same state and keeps those semantics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "ZERO_STAGES",
    "full_model_state",
    "is_sharded",
    "load_model_state",
    "load_optimizer_state",
    "local_state_bytes",
    "no_gradient_sync",
    "optimizer_state",
    "shard_model",
]

ZERO_STAGES = (0, 2, 3)


def shard_model(model: torch.nn.Module, zero_stage: int, block_classes: Iterable[str],
                device: torch.device) -> torch.nn.Module:
    """Shard ``model`` in place over all processes (one FSDP unit per block of ``block_classes``, then the
    rest as the root unit) and return it. ``zero_stage`` 0, or a single process, leaves it unchanged.
    Several processes need the process group that ``accelerate launch`` (and the Accelerator) set up."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage}")
    import torch.distributed as dist

    if zero_stage == 0 or not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    names = set(block_classes)
    reshard = zero_stage == 3
    for module in list(model.modules()):
        if type(module).__name__ in names:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def no_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """Accumulate this backward's gradients locally, unsharded, with no reduce-scatter (FSDP2's ``no_sync``)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict. Sharded: call on every process; the main process gets the tensors on
    the CPU, the others an empty dict."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def load_model_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Inverse of :func:`full_model_state`; every process passes the full state (e.g. read from a file)."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, dict(state), options=_options())


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()``; sharded, the full state keyed by parameter name (every process calls,
    the main process gets it)."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, _unwrapped(optimizer), options=_options(cpu_offload=True))


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Inverse of :func:`optimizer_state`, across layouts: a sharded run's state (keyed by parameter name)
    loads into an unsharded run and the other way round, so a run can resume at another process count."""
    by_name = _keyed_by_name(state)
    if not is_sharded(model) and not by_name:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not by_name:
        state = _key_by_name(state, model, _unwrapped(optimizer))
    set_optimizer_state_dict(model, _unwrapped(optimizer), state, options=_options())


def _keyed_by_name(state: dict[str, Any]) -> bool:
    return any(isinstance(key, str) for key in state.get("state", {}))


def _key_by_name(state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` numbers parameters in param-group order; name them after the model."""
    names = {id(param): name for name, param in model.named_parameters()}
    ordered = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    groups, start = [], 0
    for saved in state["param_groups"]:
        count = len(saved["params"])
        groups.append({**saved, "params": ordered[start:start + count]})
        start += count
    return {"state": {ordered[index]: value for index, value in state["state"].items()}, "param_groups": groups}


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of trainable weights, gradients and optimizer state held by this process (its shards only)."""
    total = 0
    for param in model.parameters():
        if param.requires_grad:
            total += _local_bytes(param)
            total += _local_bytes(param.grad) if param.grad is not None else 0
    for per_param in _unwrapped(optimizer).state.values():
        total += sum(_local_bytes(v) for v in per_param.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
    return total


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """accelerate's ``AcceleratedOptimizer`` hides the torch optimizer that the state-dict helpers need."""
    return getattr(optimizer, "optimizer", optimizer)


class FullState:
    """What a run checkpoints of ``model``: its full state, gathered from (and loaded into) every process's
    shards when it is sharded."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return full_model_state(self.model)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        load_model_state(self.model, state)
