"""The repeated blocks of a FLUX transformer or an SDXL UNet, and the three things done per block:
swapping frozen weights between host memory and the device (``--blocks_to_swap``), keeping the inputs that
gradient checkpointing saves for the recomputation in host memory (``--cpu_offload_checkpointing``), and
regional ``torch.compile`` (``--compile``).

Why our own swapper and not diffusers' group offloading (``apply_group_offloading``, read in diffusers
0.42.1): it was written for inference. With streams, offloading a group puts back the pinned host copy
taken when the hooks were applied, so a trainable LoRA weight inside a block would lose its updates or
sit on the host beside a gradient on the device; its prefetch order is recorded in the first forward and
replayed during backward's recomputation, which runs the blocks in reverse; and it swaps ``param.data``
in place, which the tensors autograd saved for backward (the parameter objects themselves) then see.

What :class:`BlockSwapper` does instead:

- Only frozen tensors move. Trainable parameters (LoRA) stay on the device all the time, so the
  optimizer, gradient clipping and checkpoints see ordinary device tensors.
- A weight is moved as the plain tensors it is made of: a plain tensor is itself; a torchao weight
  (``Int8Tensor``, ``Float8Tensor``, any traceable tensor subclass) is the inner tensors its own
  ``__tensor_flatten__`` names (``qdata``, ``scale``, ...), rebuilt with ``__tensor_unflatten__``; a
  bitsandbytes ``Params4bit`` is its packed data plus its ``QuantState``'s tensors (absmax, code and the
  nested statistics), rebuilt through ``QuantState`` and ``Params4bit`` with its module. Every inner
  tensor of a rebuilt weight is on the device; a weight of any other tensor subclass is refused.
- A swapped block's frozen tensors live as bytes in host memory (pinned when a side stream copies them).
  Before the block runs, all of them come to the device in one buffer per block, and the weights are put
  in place as *new* parameter objects viewing that buffer; after it runs, the module gets zero-byte
  ``meta`` placeholders instead. Autograd keeps the buffer alive exactly as long as backward needs it, and
  a block used while swapped out fails loudly instead of running elsewhere.
- With gradient checkpointing, backward recomputes each block's forward (in reverse order), which runs
  the same hooks: the swapper notices the reversal and prefetches the previous block instead of the next.
- On CUDA the copy of the next block runs on a side stream while the current block computes; the compute
  stream waits on an event recorded after the copy, and the block's buffer (a plain tensor, so this works
  for torchao weights too, which do not implement ``record_stream``) is recorded on the compute stream.
- At most two swapped blocks (the running one and the prefetched one) are on the device at a time, besides
  what autograd still holds.

Host memory. torch's pinned allocator rounds every allocation up to a power of two, so pinning each tensor,
or each block as one buffer, costs up to twice the weights (40 bf16 FLUX.1 blocks: 11.3 GiB of weights,
17.4 GiB pinned). The swapped bytes are instead laid end to end (each tensor at a 512-byte boundary) and cut
into chunks whose sizes are powers of two: 64 MiB chunks, then the remainder's binary digits (32 MiB,
8 MiB, ... 512 B). No chunk is rounded, so :attr:`BlockSwapper.host_bytes` is the weights' bytes plus under
512 bytes per stored tensor (about 1.00x for FLUX.1). A block's range may span chunks; its copy to the
device is one large copy per chunk it touches. Each weight is copied in and its original dropped at once,
so during setup the host holds at most the not-yet-copied originals, the chunks filled so far, and one
64 MiB pageable chunk being pinned. When the device is the CPU itself nothing is copied: the originals
are the host copies (swapping there only exercises the hooks, and keeps results bit-identical). Pinning the
originals in place with ``cudaHostRegister`` was the other choice, rejected: the originals belong to the
loader (they may be pages of a memory-mapped file, small ones share pages with unrelated memory, torchao's
inner tensors are many small allocations), every registration must be undone before its memory is freed,
and the device would still receive dozens of small copies per block instead of a few large ones.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from dreamstep.errors import UserError
from dreamstep.models.family import check_blocks_to_swap

ALIGNMENT = 512  # bytes; every stored tensor starts at a multiple (torch's CUDA allocator aligns to 512 too)
CHUNK_BYTES = 64 * 2**20  # host chunk size: a power of two, so the pinned allocator does not round it


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


def swapped_blocks(model: nn.Module, blocks_to_swap: int, *, sd_scripts_flux: bool = False,
                   flag: str = "--blocks_to_swap") -> list[nn.Module]:
    """The blocks ``--blocks_to_swap N`` keeps in host memory, in execution order (the trainers and the memory plan
    both ask here): the last N repeated blocks; with ``sd_scripts_flux`` (flux-kohya, whose flag is sd-scripts'),
    what sd-scripts' FLUX ``enable_block_swap`` swaps: the last N//2 double blocks and the last 2(N - N//2) single
    blocks (a single block holds about half a double one's weights), keeping at least two of each kind on the
    device, so N is at most 35 on FLUX.1. A model too small for that (the tiny test model) takes N = 1, with each
    count cut to the blocks it has."""
    if not sd_scripts_flux:
        blocks = repeated_blocks(model)
        check_blocks_to_swap(blocks_to_swap, len(blocks), flag)
        return blocks[len(blocks) - blocks_to_swap:] if blocks_to_swap else []
    double, single = list(model.transformer_blocks), list(model.single_transformer_blocks)
    most = most_blocks_to_swap(model, sd_scripts_flux=True)
    if not 1 <= blocks_to_swap <= most:
        raise UserError(f"{flag} {blocks_to_swap}: sd-scripts swaps N//2 double and 2(N - N//2) single FLUX blocks "
                        f"and keeps two of each kind on the device; this {type(model).__name__} "
                        f"({len(double)} + {len(single)} blocks) takes 1 to {most}")
    doubles = min(blocks_to_swap // 2, len(double))
    singles = min(2 * (blocks_to_swap - blocks_to_swap // 2), len(single))
    return double[len(double) - doubles:] + single[len(single) - singles:]


def most_blocks_to_swap(model: nn.Module, *, sd_scripts_flux: bool = False) -> int:
    """The largest ``--blocks_to_swap`` the memory plan suggests: every block but one, or sd-scripts' largest."""
    if not sd_scripts_flux:
        return len(repeated_blocks(model)) - 1
    double, single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    # The largest N with N//2 <= double - 2 and 2(N - N//2) <= single - 2.
    return max(1, min(2 * (double - 2) + 1, 2 * ((single - 2) // 2)))


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Regional compilation: ``torch.compile`` each repeated block's ``forward`` (one graph shared by all
    blocks of a class), not the whole model; return how many blocks were compiled. Hooks such as the
    swapper's stay outside the compiled code."""
    blocks = repeated_blocks(model)
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)
    return len(blocks)


class HostCheckpointing:
    """diffusers' ``gradient_checkpointing_func`` for ``--cpu_offload_checkpointing`` (sd-scripts' flag): torch's
    non-reentrant ``checkpoint``, run under saved-tensor hooks that put the block inputs it saves for the
    recomputation in host memory, and bring each back to its device when backward recomputes the block. Only those
    inputs go: what the block saves inside is the checkpoint's own (its hooks are innermost). ``pinned`` (a CUDA
    device): the host copies are pinned and both copies non-blocking, ordered on the compute stream. On the CPU
    the inputs already are in host memory and stay as they are; on the meta device (the memory plan) a host copy
    is a zero-byte stand-in of the input's shape. ``host_bytes``: what the inputs saved so far hold in host memory.

    The block swapper's hooks are unaffected: the recomputation calls the block itself."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.host_bytes = 0

    def _to_host(self, tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        if tensor.device.type == "cpu" and not self.pinned:
            return tensor.device, tensor
        self.host_bytes += tensor.numel() * tensor.element_size()
        if tensor.device.type == "meta":
            return tensor.device, torch.empty((), dtype=tensor.dtype).expand(tensor.shape)
        host = host_empty(tensor.shape, tensor.dtype, pinned=self.pinned)
        host.copy_(tensor, non_blocking=self.pinned)
        return tensor.device, host

    def _to_device(self, saved: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, host = saved
        if host.device == device and not self.pinned:  # the CPU's own inputs, kept as they were
            return host
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        return out.copy_(host, non_blocking=self.pinned)

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(self._to_host, self._to_device):
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def host_empty(shape: Sequence[int], dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """An empty host tensor, pinned when asked and the pinned allocator gives it; when it refuses (the machine's
    memory, or the driver's limit on page-locked memory, is spent) an ordinary one, with a warning (shown once, as
    Python shows a warning). Copies between pageable host memory and the device are staged through the driver:
    slower and synchronous with the host, but correct with ``non_blocking=True`` as with pinned memory."""
    if pinned:
        try:
            return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
        except RuntimeError as error:
            warnings.warn(f"pinned host memory ran out ({str(error).splitlines()[0]}); the rest of the swapped "
                          "blocks and offloaded inputs wait in pageable memory, whose copies are slower", stacklevel=2)
    return torch.empty(tuple(shape), dtype=dtype)


def enable_checkpointing(model: nn.Module, *, offload_to_host: bool, device: torch.device) -> None:
    """``--gradient_checkpointing`` on a diffusers model, with ``--cpu_offload_checkpointing`` when
    ``offload_to_host``."""
    if offload_to_host:
        model.enable_gradient_checkpointing(gradient_checkpointing_func=HostCheckpointing(device.type == "cuda"))
    else:
        model.enable_gradient_checkpointing()


_Slot = tuple[nn.Module, str, bool]  # (owning module, tensor name, is a parameter)
_Rebuild = Callable[[list[torch.Tensor], nn.Module], torch.Tensor]  # (moved plain parts, owning module) -> weight


def weight_parts(weight: torch.Tensor) -> tuple[list[torch.Tensor], _Rebuild]:
    """The plain tensors ``weight`` is made of, and how to make it again from copies of them (on any
    device) for the module that owns it; see the module docstring. The rebuild holds no tensor."""
    if type(weight) in (torch.Tensor, nn.Parameter):
        return [weight.detach()], lambda parts, module: parts[0]
    if _is_bnb_4bit(weight):
        return _bnb_4bit_parts(weight)
    if hasattr(type(weight), "__tensor_flatten__"):
        return _subclass_parts(weight)
    raise UserError(f"--blocks_to_swap cannot move a {type(weight).__module__}.{type(weight).__name__} weight; "
                    "swap fewer blocks (keep that layer resident) or load the base without that quantization")


def _subclass_parts(weight: torch.Tensor) -> tuple[list[torch.Tensor], _Rebuild]:
    """A traceable tensor subclass (torchao's): its own ``__tensor_flatten__`` names the inner tensors
    (themselves possibly subclasses), ``__tensor_unflatten__`` puts them back together."""
    names, context = weight.__tensor_flatten__()
    inner_parts, inner_rebuilds = zip(*(weight_parts(getattr(weight, name)) for name in names))
    ends = list(itertools.accumulate(len(parts) for parts in inner_parts))
    starts = [0, *ends[:-1]]
    kind, size, stride = type(weight), weight.size(), weight.stride()

    def rebuild(parts: list[torch.Tensor], module: nn.Module) -> torch.Tensor:
        tensors = {name: inner_rebuild(parts[start:end], module)
                   for name, inner_rebuild, start, end in zip(names, inner_rebuilds, starts, ends)}
        return kind.__tensor_unflatten__(tensors, context, size, stride)

    return [part for parts in inner_parts for part in parts], rebuild


def _is_bnb_4bit(weight: torch.Tensor) -> bool:
    bnb = sys.modules.get("bitsandbytes")  # without it imported, no Params4bit exists
    return bnb is not None and isinstance(weight, bnb.nn.Params4bit)


def _bnb_4bit_parts(weight: torch.Tensor) -> tuple[list[torch.Tensor], _Rebuild]:
    """bitsandbytes 4-bit: the packed data and the tensors of its ``QuantState`` (and of the nested state
    that quantizes absmax, when statistics are compressed). Rebuilt with the owning module, as bitsandbytes
    does when it quantizes, so ``Linear4bit`` finds the state on the weight and on itself."""
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Params4bit

    state, nested = weight.quant_state, weight.quant_state.state2
    parts = [weight.data, state.absmax, state.code]
    if nested is not None:
        parts += [state.offset, nested.absmax, nested.code]
    settings = {"blocksize": weight.blocksize, "compress_statistics": weight.compress_statistics,
                "quant_type": weight.quant_type, "quant_storage": weight.quant_storage}
    layout = {"shape": state.shape, "blocksize": state.blocksize, "quant_type": state.quant_type, "dtype": state.dtype}
    nested_layout = None if nested is None else {"blocksize": nested.blocksize, "dtype": nested.dtype}

    def rebuild(parts: list[torch.Tensor], module: nn.Module) -> torch.Tensor:
        data, absmax, code, *rest = parts
        state2 = None
        if nested_layout is not None:
            offset, nested_absmax, nested_code = rest
            state2 = QuantState(absmax=nested_absmax, code=nested_code, **nested_layout)
        quant_state = QuantState(absmax=absmax, code=code, offset=rest[0] if rest else None, state2=state2,
                                 **layout)
        module.quant_state = quant_state
        return Params4bit(data, requires_grad=False, quant_state=quant_state, module=module, bnb_quantized=True,
                          **settings)

    return parts, rebuild


def moved(weight: torch.Tensor, device: torch.device, module: nn.Module) -> torch.Tensor:
    """``weight`` with every tensor it is made of on ``device`` (itself when they are all there)."""
    parts, rebuild = weight_parts(weight)
    if all(part.device == device for part in parts):
        return weight
    return rebuild([part.to(device) for part in parts], module)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def chunk_sizes(total: int) -> list[int]:
    """Powers of two adding up to ``total`` (a multiple of :data:`ALIGNMENT`): full chunks, then the
    remainder's binary digits, largest first."""
    full, rest = divmod(total, CHUNK_BYTES)
    return [CHUNK_BYTES] * full + [1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]


class _HostStore:
    """One run of bytes held in host chunks whose sizes are powers of two, allocated as they fill."""

    def __init__(self, total: int, pinned: bool):
        self._sizes = chunk_sizes(total)
        self._starts = [0, *itertools.accumulate(self._sizes)][:-1]
        self._chunks: list[torch.Tensor] = []
        self._pinned = pinned

    @property
    def nbytes(self) -> int:
        return sum(chunk.numel() for chunk in self._chunks)

    def write(self, start: int, data: torch.Tensor) -> None:
        """Copy the bytes ``data`` (1-D uint8, any device) to ``[start, start + len(data))``."""
        for index, offset, done, length in self._pieces(start, len(data)):
            self._chunk(index)[offset:offset + length].copy_(data[done:done + length])

    def read_into(self, start: int, out: torch.Tensor) -> None:
        """Start copying ``[start, start + len(out))`` into ``out`` (1-D uint8); asynchronous from pinned
        chunks to a CUDA device."""
        for index, offset, done, length in self._pieces(start, len(out)):
            out[done:done + length].copy_(self._chunks[index][offset:offset + length], non_blocking=True)

    def _pieces(self, start: int, length: int) -> Iterator[tuple[int, int, int, int]]:
        """(chunk index, offset in the chunk, offset in the range, length) of each chunk the range touches."""
        index, done = bisect.bisect_right(self._starts, start) - 1, 0
        while done < length:
            offset = start + done - self._starts[index]
            piece = min(length - done, self._sizes[index] - offset)
            yield index, offset, done, piece
            index, done = index + 1, done + piece

    def _chunk(self, index: int) -> torch.Tensor:
        while len(self._chunks) <= index:
            self._chunks.append(host_empty((self._sizes[len(self._chunks)],), torch.uint8, pinned=self._pinned))
        return self._chunks[index]


@dataclass(frozen=True)
class _Part:
    """One plain tensor of a stored weight: where its bytes are in its block and how to view them."""
    offset: int
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        nbytes = self.shape.numel() * self.dtype.itemsize
        return buffer[self.offset:self.offset + nbytes].view(self.dtype).as_strided(self.shape, self.stride)


@dataclass(frozen=True)
class _StoredWeight:
    slot: _Slot
    parts: list[_Part]  # in the host store; empty when the originals stay in place
    originals: tuple[torch.Tensor, ...]  # the weight's own plain tensors, kept when the device is the host
    rebuild: _Rebuild
    shape: torch.Size  # of the weight itself, for its meta placeholder
    dtype: torch.dtype


@dataclass
class _StoredBlock:
    start: int  # byte range of the block in the host store
    stop: int
    weights: list[_StoredWeight]


def _frozen_slots(block: nn.Module) -> list[_Slot]:
    slots = []
    for module in block.modules():
        slots += [(module, name, True) for name, p in module._parameters.items()
                  if p is not None and not p.requires_grad]
        slots += [(module, name, False) for name, b in module._buffers.items() if b is not None]
    return slots


def stored_tensors(block: nn.Module) -> list[torch.Tensor]:
    """The plain tensors a :class:`BlockSwapper` keeps in host memory for ``block``: every inner tensor of
    its frozen parameters, and its buffers."""
    return [part for slot in _frozen_slots(block) for part in weight_parts(_get(slot))[0]]


def host_bytes_for(blocks: Sequence[nn.Module]) -> int:
    """The host memory a :class:`BlockSwapper` of ``blocks`` holds (:attr:`BlockSwapper.host_bytes`), read
    from the blocks without copying anything (so also from a model built on the meta device)."""
    return sum(_padded(part.nbytes) for block in blocks for part in stored_tensors(block))


def _get(slot: _Slot) -> torch.Tensor:
    module, name, is_param = slot
    return module._parameters[name] if is_param else module._buffers[name]


def _memory_order_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(the tensor's elements as 1-D uint8 in memory order, the strides to view them with). A dense tensor
    keeps its strides (``empty_like`` keeps exactly those); any other is made contiguous first."""
    stride = torch.empty_like(tensor, device="meta").stride()
    if tensor.stride() != stride:
        tensor = tensor.contiguous()
    return tensor.as_strided((tensor.numel(),), (1,)).view(torch.uint8), stride


class BlockSwapper:
    """Keep the frozen weights of ``blocks`` in host memory and put each on ``device`` only while it runs.

    Everything else of ``model`` (its other layers, and the blocks' trainable parameters) is moved to
    ``device`` here, so do not call ``model.to(...)`` afterwards (pass ``device_placement=False`` to
    accelerate for it). Build it after adapters are added and before the optimizer. ``side_stream``
    (default: on CUDA) copies on a second stream, from pinned host memory.
    """

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module], device: torch.device,
                 side_stream: bool | None = None):
        self.device = torch.device(device)
        self.blocks = list(blocks)
        asynchronous = self.device.type == "cuda" if side_stream is None else side_stream
        self._stream = torch.cuda.Stream(self.device) if asynchronous else None
        # Swapping to the CPU from the CPU copies nothing: the originals are the host copies.
        self._in_place = not asynchronous and self.device.type == "cpu"
        self._store = _HostStore(0 if self._in_place else host_bytes_for(self.blocks), pinned=asynchronous)
        self._host: list[_StoredBlock] = []
        position = 0
        for block in self.blocks:
            start, weights = position, []
            for slot in _frozen_slots(block):
                weight, position = self._take_to_host(slot, start, position)
                weights.append(weight)
            self._host.append(_StoredBlock(start, position, weights))
        self._loaded: dict[int, tuple[torch.Tensor, Any]] = {}  # index -> (device buffer, copy event)
        self._last: int | None = None
        self._direction = 1  # +1 while running forward, -1 during backward's recomputation
        self.loads = 0  # host -> device block copies so far
        _move_rest(model, {weight.slot for block in self._host for weight in block.weights}, self.device)
        for index, block in enumerate(self.blocks):
            block.register_forward_pre_hook(lambda module, args, i=index: self._before(i))
            block.register_forward_hook(lambda module, args, output, i=index: self._after(i))

    @classmethod
    def for_model(cls, model: nn.Module, blocks_to_swap: int, device: torch.device,
                  place: nn.Module | None = None, flag: str = "--blocks_to_swap",
                  side_stream: bool | None = None, sd_scripts_flux: bool = False) -> BlockSwapper:
        """Swap the :func:`swapped_blocks` of ``model``; the rest of ``place`` (default: ``model``; give the module
        that holds it with its adapters when those live outside it) is moved to ``device``."""
        blocks = swapped_blocks(model, blocks_to_swap, sd_scripts_flux=sd_scripts_flux, flag=flag)
        return cls(place if place is not None else model, blocks, device, side_stream)

    @property
    def host_bytes(self) -> int:
        """Host memory the swapper holds (pinned with a side stream): the swapped weights' bytes plus under
        :data:`ALIGNMENT` bytes per stored tensor (0 when the device is the CPU: the originals stay)."""
        return self._store.nbytes

    def _take_to_host(self, slot: _Slot, block_start: int, position: int) -> tuple[_StoredWeight, int]:
        """Copy the weight in ``slot`` into the host store from ``position`` on (unless it stays in place) and
        put a meta placeholder in its place, so that the original is freed now; return its record and the next
        free position."""
        weight = _get(slot)
        tensors, rebuild = weight_parts(weight)
        parts = []
        for tensor in [] if self._in_place else tensors:
            data, stride = _memory_order_bytes(tensor)
            self._store.write(position, data)
            parts.append(_Part(position - block_start, tensor.dtype, tensor.shape, stride))
            position += _padded(len(data))
        originals = tuple(tensors) if self._in_place else ()
        stored = _StoredWeight(slot, parts, originals, rebuild, weight.shape, weight.dtype)
        _put_placeholder(stored)
        return stored, position

    def _load(self, index: int) -> None:
        """Start copying block ``index`` to the device (on the side stream, if any) and put its weights in
        place as views of one device buffer."""
        if index in self._loaded:
            return
        block = self._host[index]
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with stream:
            buffer = torch.empty(block.stop - block.start, dtype=torch.uint8, device=self.device)
            self._store.read_into(block.start, buffer)
            for weight in block.weights:
                parts = weight.originals or [part.view(buffer) for part in weight.parts]
                _put(weight.slot, weight.rebuild(list(parts), weight.slot[0]))
            event = torch.cuda.Event() if self._stream is not None else None
            if event is not None:
                event.record(self._stream)
        self._loaded[index] = (buffer, event)
        self.loads += 1

    def _evict(self, index: int) -> None:
        """Replace block ``index``'s frozen tensors by meta placeholders; its device buffer is freed once
        nothing (autograd included) holds a view of it."""
        for weight in self._host[index].weights:
            _put_placeholder(weight)
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
        buffer, event = self._loaded[index]
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            buffer.record_stream(current)  # the allocator must not reuse it before compute is done
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


def _put_placeholder(weight: _StoredWeight) -> None:
    """A plain meta tensor of the weight's shape and dtype: quantized weights have no meta form of their own.
    bitsandbytes' ``Linear4bit`` also keeps its weight's ``QuantState`` on itself, which would keep the
    tensors alive: that goes too (the next load puts it back)."""
    module = weight.slot[0]
    _put(weight.slot, torch.empty(weight.shape, dtype=weight.dtype, device="meta"))
    if getattr(module, "quant_state", None) is not None:
        module.quant_state = None


def _move_rest(model: nn.Module, swapped: set[_Slot], device: torch.device) -> None:
    """Move every parameter and buffer of ``model`` that is not a swapped slot to ``device``: plain
    parameters keep their objects (so an optimizer built before or after still holds them), quantized ones
    are rebuilt from their moved parts."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or (module, name, True) in swapped:
                continue
            if type(param) in (torch.Tensor, nn.Parameter):
                if param.device != device:
                    _move_in_place(param, param.detach().to(device))
            else:
                _put((module, name, True), moved(param, device, module))
        for name, buffer in module._buffers.items():
            if buffer is not None and (module, name, False) not in swapped:
                module._buffers[name] = moved(buffer, device, module)


def _move_in_place(param: nn.Parameter, value: torch.Tensor) -> None:
    """Give ``param`` the data ``value``, keeping the object, the way ``nn.Module._apply`` does: ``.data``
    where the two tensor types allow it (CPU and CUDA do), else swapping the tensors' contents (to meta)."""
    if torch._has_compatible_shallow_copy_type(param, value):
        param.data = value
    else:
        torch.utils.swap_tensors(param, nn.Parameter(value, param.requires_grad))


def prepare_blocks(model: nn.Module, *, blocks_to_swap: int, compile: bool, device: torch.device,
                   num_processes: int = 1, place: nn.Module | None = None,
                   sd_scripts_flux: bool = False) -> BlockSwapper | None:
    """Apply ``--blocks_to_swap`` (counted as :func:`swapped_blocks` says) and ``--compile`` to ``model`` once its
    adapters are in place; return the swapper (``None`` without swapping). With a swapper, ``place`` (default
    ``model``) is on ``device`` already: pass ``device_placement=False`` for it to ``accelerator.prepare``."""
    swapper = None
    if blocks_to_swap:
        if num_processes > 1:
            raise UserError("--blocks_to_swap is for one small card; with several processes give each a card "
                            "that holds the model, or train on one process")
        swapper = BlockSwapper.for_model(model, blocks_to_swap, device, place, sd_scripts_flux=sd_scripts_flux)
    if compile:
        compile_blocks(model)
    return swapper
