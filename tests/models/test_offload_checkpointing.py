"""``--cpu_offload_checkpointing`` on a small FLUX transformer with a LoRA: its CUDA path (pinned host copies,
non-blocking copies; tests/cuda_stand_ins.py stands in for pinned memory on the CPU) trains the same LoRA as plain
gradient checkpointing, with the block swapper too, and the inputs each checkpointed block keeps for its
recomputation wait in pinned host memory until backward copies them back."""

from __future__ import annotations

import weakref

import pytest
import torch
from cuda_stand_ins import CudaRuntime, storage
from test_blocks import small_flux, train

from dreamstep.models.blocks import BlockSwapper, HostCheckpointing, repeated_blocks

CPU = torch.device("cpu")


@pytest.mark.parametrize("swap", [False, True])
def test_offloaded_inputs_train_the_same_lora(swap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    reference_losses, reference_lora = train(small_flux(), steps=3)
    model = small_flux()
    runtime = CudaRuntime(CPU).install(monkeypatch)
    model.enable_gradient_checkpointing(gradient_checkpointing_func=HostCheckpointing(pinned=True))
    if swap:
        BlockSwapper.for_model(model, 3, CPU, side_stream=True)
    losses, lora = train(model, steps=3)
    assert losses == reference_losses
    assert lora.keys() == reference_lora.keys()
    for name in lora:
        torch.testing.assert_close(lora[name], reference_lora[name], rtol=0, atol=0)
    assert runtime.pinned


def _tensor_args(args: tuple) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("offload", [False, True])
def test_checkpointed_inputs_wait_in_pinned_host_memory_until_backward(offload: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model = small_flux()
    runtime = CudaRuntime(CPU).install(monkeypatch)
    if offload:
        model.enable_gradient_checkpointing(gradient_checkpointing_func=HostCheckpointing(pinned=True))
    blocks = repeated_blocks(model)
    forward_inputs: list[list[weakref.ref]] = []
    recomputed: list[tuple[int, list[torch.Tensor]]] = []  # (block, its inputs), as backward recomputes them
    in_backward = False

    def record(block: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if in_backward:
            recomputed.append((blocks.index(block), _tensor_args(args)))
        else:
            forward_inputs.append([weakref.ref(t) for t in _tensor_args(args)])

    for block in blocks:
        block.register_forward_pre_hook(record, with_kwargs=True)
    image, text = torch.randn(2, 16, 16), torch.randn(2, 5, 24)
    pred = model(hidden_states=image, encoder_hidden_states=text, pooled_projections=torch.randn(2, 12),
                 timestep=torch.tensor([0.3, 0.7]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3),
                 return_dict=False)[0]
    loss = (pred - image).pow(2).mean()
    # Each block's input residual stream (hidden_states) is kept by the checkpoint only without offloading.
    assert [refs[0]() is not None for refs in forward_inputs] == [not offload] * len(blocks)
    host_copies = [entry for entry in runtime.entries("copy") if runtime.is_pinned(entry[2])]
    assert len(host_copies) == (sum(len(refs) for refs in forward_inputs) if offload else 0)
    assert all(non_blocking for *_, non_blocking in host_copies)
    in_backward = True
    loss.backward()
    assert [index for index, _ in recomputed] == list(reversed(range(len(blocks))))
    back = {entry[2]: entry for entry in runtime.entries("copy") if runtime.is_pinned(entry[3])}
    for index, inputs in recomputed:
        # With offloading every input a recomputed block runs on was just copied, non-blocking, out of one of
        # the pinned host copies taken in forward.
        copied = [storage(t) in back and back[storage(t)][4] for t in inputs]
        assert copied == [offload] * len(inputs), index
