"""The repeated blocks of a FLUX transformer or an SDXL UNet, and the two things done per block:
swapping frozen weights between host memory and the device (``--blocks_to_swap``), and regional
``torch.compile`` (``--compile``).

Why our own swapper and not diffusers' group offloading (``apply_group_offloading``, read in diffusers
0.42.1): it was written for inference. With streams, offloading a group puts back the pinned host copy
taken when the hooks were applied, so a trainable LoRA weight inside a block would lose its updates or
sit on the host beside a gradient on the device; its prefetch order is recorded in the first forward and
replayed during backward's recomputation, which runs the blocks in reverse; and it swaps ``param.data``
in place, which the tensors autograd saved for backward (the parameter objects themselves) then see.

What :class:`BlockSwapper` does instead:

- Only frozen tensors move. Trainable parameters (LoRA) stay on the device all the time, so the
  optimizer, gradient clipping and checkpoints see ordinary device tensors.
- A swapped block's frozen tensors live in (pinned, on CUDA) host memory. Before the block runs, a
  fresh device copy is put in place as a *new* parameter object; after it runs, the module gets a
  zero-byte ``meta`` placeholder instead. Autograd keeps the device copy alive exactly as long as
  backward needs it, and a block used while swapped out fails loudly instead of running elsewhere.
- With gradient checkpointing, backward recomputes each block's forward (in reverse order), which runs
  the same hooks: the swapper notices the reversal and prefetches the previous block instead of the next.
- On CUDA the copy of the next block runs on a side stream while the current block computes.
- At most two swapped blocks (the running one and the prefetched one) are on the device at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dreamstep.errors import UserError


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks in execution order: FLUX's double then single blocks, or the UNet's
    transformer blocks down, mid, up (the classes diffusers lists in ``_repeated_blocks``)."""
    names = tuple(getattr(model, "_repeated_blocks", ()))
    if not names:
        raise UserError(f"{type(model).__name__} has no repeated blocks to swap or compile")
    parts = [model]
    if all(hasattr(model, part) for part in ("down_blocks", "mid_block", "up_blocks")):
        parts = [model.down_blocks, model.mid_block, model.up_blocks]  # registration order puts mid last
    return [m for part in parts if part is not None for m in part.modules() if type(m).__name__ in names]


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Regional compilation: ``torch.compile`` each repeated block's ``forward`` (one graph shared by all
    blocks of a class), not the whole model; return how many blocks were compiled. Hooks such as the
    swapper's stay outside the compiled code."""
    blocks = repeated_blocks(model)
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)
    return len(blocks)


_Slot = tuple[nn.Module, str, bool]  # (owning module, tensor name, is a parameter)


class BlockSwapper:
    """Keep the frozen weights of ``blocks`` in host memory and put each on ``device`` only while it runs.

    Everything else of ``model`` (its other layers, and the blocks' trainable parameters) is moved to
    ``device`` here, so do not call ``model.to(...)`` afterwards (pass ``device_placement=False`` to
    accelerate for it). Build it after adapters are added and before the optimizer.
    """

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module], device: torch.device):
        self.device = torch.device(device)
        self.blocks = list(blocks)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._host: list[dict[_Slot, torch.Tensor]] = [self._take_to_host(block) for block in self.blocks]
        self._loaded: dict[int, tuple[list[torch.Tensor], Any]] = {}  # index -> (device tensors, copy event)
        self._last: int | None = None
        self._direction = 1  # +1 while running forward, -1 during backward's recomputation
        self.loads = 0  # host -> device block copies so far
        _move_rest(model, {slot for host in self._host for slot in host}, self.device)
        for index, block in enumerate(self.blocks):
            self._evict(index)
            block.register_forward_pre_hook(lambda module, args, i=index: self._before(i))
            block.register_forward_hook(lambda module, args, output, i=index: self._after(i))

    @classmethod
    def for_model(cls, model: nn.Module, blocks_to_swap: int, device: torch.device,
                  place: nn.Module | None = None, flag: str = "--blocks_to_swap") -> BlockSwapper:
        """Swap the last ``blocks_to_swap`` repeated blocks of ``model`` (sd-scripts' meaning of the flag);
        the rest of ``place`` (default: ``model``; give the module that holds it with its adapters when
        those live outside it) is moved to ``device``."""
        blocks = repeated_blocks(model)
        if not 1 <= blocks_to_swap <= len(blocks):
            raise UserError(f"{flag} {blocks_to_swap}: this {type(model).__name__} has {len(blocks)} blocks; "
                            f"give 1 to {len(blocks)}")
        return cls(place if place is not None else model, blocks[len(blocks) - blocks_to_swap:], device)

    def _take_to_host(self, block: nn.Module) -> dict[_Slot, torch.Tensor]:
        host = {}
        for module in block.modules():
            tensors = [(name, p, True) for name, p in module._parameters.items()
                       if p is not None and not p.requires_grad]
            tensors += [(name, b, False) for name, b in module._buffers.items() if b is not None]
            for name, tensor, is_param in tensors:
                copy = tensor.detach().to("cpu")
                if self._stream is not None and type(copy) is torch.Tensor:
                    copy = copy.pin_memory()  # lets the copy to the device run asynchronously
                host[(module, name, is_param)] = copy
        return host

    def _load(self, index: int) -> None:
        """Start copying block ``index`` to the device (on the side stream on CUDA)."""
        if index in self._loaded:
            return
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        moved = []
        with stream:
            for slot, host in self._host[index].items():
                tensor = host.to(self.device, non_blocking=True)
                _put(slot, tensor)
                moved.append(tensor)
            event = torch.cuda.Event() if self._stream is not None else None
            if event is not None:
                event.record(self._stream)
        self._loaded[index] = (moved, event)
        self.loads += 1

    def _evict(self, index: int) -> None:
        """Replace block ``index``'s frozen tensors by meta placeholders; the device copies are freed
        once nothing (autograd included) holds them."""
        for slot, host in self._host[index].items():
            # A plain meta tensor of the same shape and dtype: quantized weights (torchao tensor
            # subclasses) have no meta form of their own.
            _put(slot, torch.empty(host.shape, dtype=host.dtype, device="meta"))
        self._loaded.pop(index, None)

    def _before(self, index: int) -> None:
        if self._last is not None:
            # The same block twice in a row is a turn: forward's end into backward, or backward's end
            # into the next forward.
            self._direction = -self._direction if index == self._last else (1 if index > self._last else -1)
        self._last = index
        upcoming = index + self._direction
        for other in [i for i in self._loaded if i not in (index, upcoming)]:
            self._evict(other)
        self._load(index)
        moved, event = self._loaded[index]
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for tensor in moved:
                tensor.record_stream(current)  # the allocator must not reuse it before compute is done
        if 0 <= upcoming < len(self.blocks):
            self._load(upcoming)

    def _after(self, index: int) -> None:
        self._evict(index)


def _put(slot: _Slot, tensor: torch.Tensor) -> None:
    module, name, is_param = slot
    if is_param:
        module._parameters[name] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, False)
    else:
        module._buffers[name] = tensor


def _move_rest(model: nn.Module, swapped: set[_Slot], device: torch.device) -> None:
    """Move every parameter and buffer of ``model`` that is not a swapped slot to ``device`` in place
    (parameter objects are kept, so an optimizer built before or after still holds them)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and (module, name, True) not in swapped:
                param.data = param.data.to(device)
        for name, buffer in module._buffers.items():
            if buffer is not None and (module, name, False) not in swapped:
                module._buffers[name] = buffer.to(device)


def prepare_blocks(model: nn.Module, *, blocks_to_swap: int, compile: bool, device: torch.device,
                   num_processes: int = 1, place: nn.Module | None = None) -> BlockSwapper | None:
    """Apply ``--blocks_to_swap`` and ``--compile`` to ``model`` once its adapters are in place; return
    the swapper (``None`` without swapping). With a swapper, ``place`` (default ``model``) is on
    ``device`` already: pass ``device_placement=False`` for it to ``accelerator.prepare``."""
    swapper = None
    if blocks_to_swap:
        if num_processes > 1:
            raise UserError("--blocks_to_swap is for one small card; with several processes give each a card "
                            "that holds the model, or train on one process")
        swapper = BlockSwapper.for_model(model, blocks_to_swap, device, place)
    if compile:
        compile_blocks(model)
    return swapper
