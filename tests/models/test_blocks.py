"""Block swapping and regional compilation on a small FLUX transformer with a peft LoRA, trained for a
few steps with gradient checkpointing: the same losses and LoRA as with every block resident, and the
swapped blocks' weights really off the execution device (meta placeholders) except while they run."""

from __future__ import annotations

import pytest
import torch
from cuda_stand_ins import CudaRuntime
from diffusers import FluxTransformer2DModel

from dreamstep.errors import UserError
from dreamstep.lora.inject import add_lora
from dreamstep.models.blocks import BlockSwapper, compile_blocks, repeated_blocks, swapped_blocks
from dreamstep.models.flux.lora_targets import flux_lora_targets
from dreamstep.models.precision import cast_trainable_params_to_fp32, freeze
from dreamstep.models.quantization import quantize_built_model

CPU = torch.device("cpu")


def small_flux(double: int = 2, single: int = 2, layers: str = "all-linear", checkpointing: bool = True,
               quantization: str = "none", double_quant: bool = False) -> FluxTransformer2DModel:
    """A FLUX transformer a few channels wide (its linear weights quantized as ``--base_quantization``
    ``quantization`` does) with a LoRA whose B is non-zero, so every block matters."""
    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=double, num_single_layers=single,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=24,
                                   pooled_projection_dim=12, axes_dims_rope=(2, 2, 4))
    freeze(model)
    quantize_built_model(model, quantization, double_quant)
    add_lora(model, flux_lora_targets(model, [layers]), rank=4, alpha=4)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    cast_trainable_params_to_fp32(model)
    if checkpointing:
        model.enable_gradient_checkpointing()
    return model.train()


def train(model: torch.nn.Module, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """AdamW on the LoRA for ``steps`` steps of a fixed random regression; (losses, LoRA weights)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        image, text = torch.randn(2, 16, 16, generator=generator), torch.randn(2, 5, 24, generator=generator)
        pred = model(hidden_states=image, encoder_hidden_states=text, pooled_projections=torch.randn(2, 12),
                     timestep=torch.tensor([0.3, 0.7]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3),
                     return_dict=False)[0]
        loss = (pred - image).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def is_off_device(block: torch.nn.Module) -> bool:
    frozen = [p for p in block.parameters() if not p.requires_grad]
    return all(p.is_meta for p in frozen)


@pytest.mark.parametrize("quantization, copied", [("none", False), ("none", True), ("int8", True), ("fp8", True),
                                                   ("nf4", True)])
def test_swapped_blocks_train_exactly_like_resident_ones(quantization: str, copied: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the originals stay in place; with a side stream (the CUDA path, its CUDA pieces stood in for
    by tests/cuda_stand_ins.py) every load is a copy out of the pinned host chunks, quantized weights too."""
    if quantization != "none":
        pytest.importorskip("bitsandbytes" if quantization == "nf4" else "torchao", reason="the 'quant' extra")
    reference_losses, reference_lora = train(small_flux(quantization=quantization), steps=3)
    model = small_flux(quantization=quantization)
    if copied:
        runtime = CudaRuntime(CPU).install(monkeypatch)
    swapper = BlockSwapper.for_model(model, 3, CPU, side_stream=copied)
    assert (swapper.host_bytes > 0) == copied
    losses, lora = train(model, steps=3)
    if copied:  # every load read the pinned chunks
        assert sum(runtime.is_pinned(source) for _, _, _, source, _ in runtime.entries("copy")) >= swapper.loads
    assert losses == reference_losses
    assert lora.keys() == reference_lora.keys()
    for name in lora:
        torch.testing.assert_close(lora[name], reference_lora[name], rtol=0, atol=0)
    assert swapper.loads >= 3 * 2 * 2  # every step brought each swapped block in for forward and backward


def test_only_the_running_block_and_the_next_one_are_on_the_device() -> None:
    model = small_flux()
    swapper = BlockSwapper.for_model(model, 3, CPU)
    resident_blocks = repeated_blocks(model)[:1]
    seen = []

    def check(index: int) -> None:
        # Runs after the swapper's own hook: block ``index`` is in place, at most one more (prefetched).
        on_device = [i for i, block in enumerate(swapper.blocks) if not is_off_device(block)]
        assert index in on_device and len(on_device) <= 2, (index, on_device)
        assert all(abs(i - index) <= 1 for i in on_device), (index, on_device)
        assert not any(is_off_device(block) for block in resident_blocks)
        seen.append(index)

    for index, block in enumerate(swapper.blocks):
        block.register_forward_pre_hook(lambda module, args, i=index: check(i))
    train(model, steps=2)
    # Forward runs 0, 1, 2; backward's recomputation runs them again in reverse.
    assert seen == [0, 1, 2, 2, 1, 0] * 2
    assert all(p.device == CPU for p in model.parameters() if p.requires_grad)  # the LoRA never moves
    assert sum(not is_off_device(block) for block in swapper.blocks) <= 1


def test_a_swapped_out_block_cannot_run_by_accident() -> None:
    model = small_flux(double=1, single=2)
    swapper = BlockSwapper.for_model(model, 1, CPU)
    block = swapper.blocks[0]
    assert is_off_device(block)
    with pytest.raises(RuntimeError, match="meta"):
        # Called without the swapper's hooks: the weights are placeholders without data.
        block.forward(torch.randn(1, 4, 16), torch.randn(1, 2, 16), temb=torch.randn(1, 16))


def test_blocks_to_swap_beyond_the_model_is_one_clear_error() -> None:
    with pytest.raises(UserError, match="--blocks_to_swap 5: the model has 4 blocks; choose 0 to 4"):
        BlockSwapper.for_model(small_flux(), 5, CPU)


@pytest.mark.parametrize(("blocks_to_swap", "double", "single", "params"), [
    (8, 4, 8, 2.49e9), (16, 8, 16, 4.98e9), (28, 14, 28, 8.72e9), (35, 17, 36, 10.87e9)])
def test_flux_kohya_swaps_the_blocks_sd_scripts_swaps(blocks_to_swap: int, double: int, single: int,
                                                      params: float) -> None:
    """sd-scripts' library/flux_models.py (enable_block_swap): N//2 double blocks and 2(N - N//2) single blocks,
    the last of each kind; 8, 16 and 28 are its documented low-memory settings, 35 its largest."""
    from dreamstep.models import memory_plan as mp
    from dreamstep.models.published_configs import FLUX_DEV_TRANSFORMER

    model = mp.build_on_meta(FluxTransformer2DModel, FLUX_DEV_TRANSFORMER)
    swapped = swapped_blocks(model, blocks_to_swap, sd_scripts_flux=True)
    assert swapped == [*model.transformer_blocks[19 - double:], *model.single_transformer_blocks[38 - single:]]
    assert sum(p.numel() for block in swapped for p in block.parameters()) == pytest.approx(params, rel=0.002)
    assert len(swapped_blocks(model, blocks_to_swap)) == blocks_to_swap  # the other trainers: the last N blocks
    with pytest.raises(UserError, match="--blocks_to_swap 36: sd-scripts swaps N//2 double and 2[(]N - N//2[)] "
                                        "single FLUX blocks .* takes 1 to 35"):
        swapped_blocks(model, 36, sd_scripts_flux=True)


def test_regional_compilation_gives_the_eager_losses() -> None:
    """aot_eager traces forward and backward as inductor does, without generating C++ (seconds, not minutes)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    reference_losses, reference_lora = train(small_flux(1, 1, "attention", checkpointing=False), steps=2)
    model = small_flux(1, 1, "attention", checkpointing=False)
    assert compile_blocks(model, backend="aot_eager") == 2
    losses, lora = train(model, steps=2)
    assert counters["stats"]["unique_graphs"] >= 2  # both block classes really ran compiled
    torch.testing.assert_close(losses, reference_losses, rtol=1e-5, atol=1e-6)
    for name in lora:
        torch.testing.assert_close(lora[name], reference_lora[name], rtol=1e-4, atol=1e-6)
