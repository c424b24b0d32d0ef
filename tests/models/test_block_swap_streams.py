"""The swapper's CUDA path run on a CPU: side stream, events, ``record_stream`` and pinned host memory are
stand-ins (tests/cuda_stand_ins.py) that log what the swapper asks for, and the "device" is ``meta``, so a
tensor left in host memory is seen at once. A small FLUX transformer with a LoRA and gradient checkpointing
runs forward and backward with its last three blocks swapped, for every base dtype."""

from __future__ import annotations

import weakref

import pytest
import torch
from cuda_stand_ins import CudaRuntime, storage
from test_blocks import small_flux

from dreamstep.models.blocks import BlockSwapper, host_bytes_for, repeated_blocks

META = torch.device("meta")
MODES = ["bf16", "int8", "fp8", "nf4", "nf4 double-quant"]


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> CudaRuntime:
    return CudaRuntime(META).install(monkeypatch)


def quantized_flux(mode: str) -> torch.nn.Module:
    if mode.startswith("nf4"):
        pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (the 'quant' extra)")
    elif mode != "bf16":
        pytest.importorskip("torchao", reason="torchao is not installed (the 'quant' extra)")
    model = small_flux(double=2, single=2, quantization=mode.split()[0] if mode != "bf16" else "none",
                       double_quant="double-quant" in mode)
    if mode == "bf16":
        for param in model.parameters():
            if not param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    return model


def inner_tensors(weight: torch.Tensor) -> list[torch.Tensor]:
    """Every plain tensor a weight is made of, found the libraries' way: torchao subclasses name theirs in
    ``__tensor_flatten__``; a bitsandbytes 4-bit weight is its data plus every tensor in its QuantState
    (nested states included)."""
    if hasattr(type(weight), "__tensor_flatten__"):
        names, _ = weight.__tensor_flatten__()
        return [t for name in names for t in inner_tensors(getattr(weight, name))]
    if hasattr(weight, "quant_state"):
        return [weight.data, *tensors_in(weight.quant_state)]
    return [weight]


def tensors_in(state: object) -> list[torch.Tensor]:
    found = []
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif type(value).__name__ == "QuantState":
            found += tensors_in(value)
    return found


def frozen(block: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    return [(module, name, p) for module in block.modules() for name, p in module._parameters.items()
            if p is not None and not p.requires_grad]


def forward_backward(model: torch.nn.Module) -> None:
    """One training pass on ``meta`` inputs: forward, then backward through the recomputed blocks."""
    with torch.device(META):
        image, text = torch.randn(2, 16, 16), torch.randn(2, 5, 24)
        pred = model(hidden_states=image, encoder_hidden_states=text, pooled_projections=torch.randn(2, 12),
                     timestep=torch.tensor([0.3, 0.7]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3),
                     return_dict=False)[0]
    (pred - image).pow(2).mean().backward()


@pytest.mark.parametrize("mode", MODES)
def test_every_inner_tensor_is_on_the_device_and_copies_overlap_compute_in_backward_order(
        mode: str, runtime: CudaRuntime) -> None:
    model = quantized_flux(mode)
    types = {(id(m), name): type(p) for block in repeated_blocks(model) for m, name, p in frozen(block)}
    swapper = BlockSwapper.for_model(model, 3, META, side_stream=True)
    assert runtime.side_streams and runtime.pinned and swapper.host_bytes == sum(c.nbytes for c in runtime.pinned)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:  # the rest (and the LoRA) moved
        assert all(t.device == META for t in inner_tensors(tensor)), name

    runs: list[tuple[int, torch.UntypedStorage, int]] = []  # (block, its device buffer, log position) as run

    def check(index: int) -> None:
        # Runs right after the swapper's own pre-hook, before the block computes.
        buffers = []
        for module, name, weight in frozen(swapper.blocks[index]):
            assert type(weight) is types[(id(module), name)], (name, type(weight))
            for tensor in inner_tensors(weight):
                assert tensor.device == META, (mode, name, tensor.device)
                if name != "bias":  # bitsandbytes' Linear4bit.forward replaces its bias by a bf16 copy
                    buffers.append(storage(tensor))
            if hasattr(weight, "quant_state"):
                assert module.quant_state is weight.quant_state  # Linear4bit's own copy of the state
        buffer = buffers[0]
        assert all(b is buffer for b in buffers)  # every inner tensor is a view of the block's one buffer
        copies = [i for i, e in enumerate(runtime.log) if e[0] == "copy" and e[2] is buffer]
        assert copies, "the block's weights did not come from the host store"
        for i in copies:
            _, stream, _, source, non_blocking = runtime.log[i]
            assert stream is runtime.side_streams[0] and non_blocking and runtime.is_pinned(source)
        recorded = next(i for i, e in enumerate(runtime.log) if i > copies[-1] and e[0] == "record")
        _, stream, event = runtime.log[recorded]
        assert stream is runtime.side_streams[0]
        later = runtime.log[recorded:]
        assert ("wait", runtime.compute, event) in later  # compute waits for the copy to finish
        assert ("record_stream", buffer, runtime.compute) in later  # no reuse before compute is done
        runs.append((index, buffer, len(runtime.log)))
        runtime.log.append(("run", index))

    for index, block in enumerate(swapper.blocks):
        block.register_forward_pre_hook(lambda module, args, i=index: check(i))
    for _ in range(2):
        forward_backward(model)
    # Forward runs 0, 1, 2; backward's recomputation runs 2, 1, 0.
    assert [index for index, _, _ in runs] == [0, 1, 2, 2, 1, 0] * 2
    # Each block that follows another was copied before that other block ran: prefetched in the direction
    # of travel, backward's reverse order included.
    for (previous, _, previous_run), (index, buffer, _) in zip(runs, runs[1:]):
        if index != previous:
            first_copy = next(i for i, e in enumerate(runtime.log) if e[0] == "copy" and e[2] is buffer)
            assert first_copy < previous_run, (previous, index)
    assert all(p.is_meta for block in swapper.blocks for _, _, p in frozen(block))  # all evicted at the end


@pytest.mark.parametrize("mode", ["bf16", "int8", "nf4 double-quant"])
def test_pinned_memory_is_the_weights_bytes_and_each_original_is_freed_once_copied(
        mode: str, runtime: CudaRuntime) -> None:
    model = quantized_flux(mode)
    blocks = repeated_blocks(model)[1:]
    weights = [p for block in blocks for _, _, p in frozen(block)]
    weight_bytes = sum(t.nbytes for p in weights for t in inner_tensors(p))
    # A weight counts as alive while the memory of any of its inner tensors is (a storage lives as long as
    # any tensor viewing it).
    originals = [[weakref.ref(t.untyped_storage()) for t in inner_tensors(p)] for p in weights]
    del weights
    planned = host_bytes_for(blocks)  # what a memory plan reads from the blocks before anything moves
    alive: list[int] = []
    runtime.on_host_copy = lambda: alive.append(sum(any(ref() is not None for ref in refs) for refs in originals))

    swapper = BlockSwapper.for_model(model, 3, META, side_stream=True)
    # Pinned chunks are powers of two, so torch's pinned allocator rounds nothing up.
    assert all(c.nbytes & (c.nbytes - 1) == 0 for c in runtime.pinned)
    assert runtime.pinned_bytes == swapper.host_bytes == sum(c.nbytes for c in runtime.pinned) == planned
    assert weight_bytes <= swapper.host_bytes <= 1.05 * weight_bytes + 512 * 4 * len(originals)
    # Each weight's original is gone before the next weight is copied: at the k-th weight's copy, exactly
    # the originals from the k-th on are alive.
    assert sorted(set(alive), reverse=True) == list(range(len(originals), 0, -1))
    assert all(ref() is None for refs in originals for ref in refs)


def test_when_pinning_fails_the_rest_waits_in_pageable_memory_and_training_goes_on(runtime: CudaRuntime) -> None:
    model = quantized_flux("bf16")
    needed = host_bytes_for(repeated_blocks(model)[-3:])
    runtime.pinned_limit = needed // 2
    with pytest.warns(UserWarning, match=r"pinned host memory ran out \(CUDA error: out of memory\)"):
        swapper = BlockSwapper.for_model(model, 3, META, side_stream=True)
    assert 0 < runtime.pinned_bytes <= needed // 2 and swapper.host_bytes == needed  # every byte stored
    forward_backward(model)
    sources = [runtime.is_pinned(entry[3]) for entry in runtime.entries("copy")]
    assert True in sources and False in sources  # blocks came from both kinds of host memory
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("mode", MODES)
def test_a_step_holds_at_most_two_swapped_blocks_on_the_device(mode: str, runtime: CudaRuntime) -> None:
    """Gradient checkpointing keeps nothing of a block for backward but its input, so a swapped block's device
    buffer dies when the swapper lets it go, whatever the base: the one running and the one prefetched are alive,
    in forward and in backward's recomputation alike (not every block run so far, until backward reaches it)."""
    runtime.log_copies = False
    model = quantized_flux(mode)
    swapper = BlockSwapper.for_model(model, 4, META, side_stream=True)
    buffers: list[weakref.ref] = []  # every device buffer a block ran on
    alive: list[int] = []  # at each block run, how many of them are alive

    def count(block: torch.nn.Module, args: object) -> None:
        _, _, weight = frozen(block)[0]
        buffers.append(weakref.ref(storage(inner_tensors(weight)[0])))
        alive.append(sum(ref() is not None for ref in buffers))

    for block in swapper.blocks:
        block.register_forward_pre_hook(count)  # after the swapper's: the block is on the device
    forward_backward(model)
    assert len(alive) == 8  # 4 blocks in forward, 4 recomputed in backward
    assert max(alive) <= 2, alive
