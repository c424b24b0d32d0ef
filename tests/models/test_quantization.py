"""A frozen torchao linear keeps only its quantized weight for backward (quantization.keep_only_quantized_weights,
installed by the loaders): the LoRA trained over it is the one trained without that, and a training step saves a
bf16 copy of each quantized weight less for backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models import loading, quantization
from dreamstep.models import memory_plan as mp
from dreamstep.models.blocks import BlockSwapper
from dreamstep.models.flux.lora_targets import flux_lora_targets
from dreamstep.models.precision import cast_trainable_params_to_fp32
from dreamstep.recipes.flux_lora import FluxLoraModel, FluxLoraStep

pytest.importorskip("torchao", reason="the quantized modes need the 'quant' extra")

RANK, TEXT_TOKENS, STEPS, LEARNING_RATE = 4, 16, 3, 0.1


def _base(folder: Path, mode: str, fixed: bool) -> torch.nn.Module:
    """The transformer quantized as the trainer loads it (``fixed``), or as diffusers alone gives it."""
    if fixed:
        return loading.load_flux_transformer(folder, weight_dtype=torch.bfloat16, base_quantization=mode)
    return FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer", torch_dtype=torch.bfloat16,
                                                  quantization_config=quantization.diffusers_config(mode,
                                                                                                    torch.bfloat16))


@dataclass
class Step:
    saved: int  # bytes autograd saved for backward outside checkpointed blocks (which drop and recompute theirs)
    peak: int  # the step's peak bytes beyond the model, as the memory plan counts them
    quantized_elements: int  # weight elements of the quantized linears that ran with inputs that need gradients


@contextlib.contextmanager
def _watching_quantized_linears(model: torch.nn.Module, grad_inputs: list[int]) -> Iterator[None]:
    from torchao.utils import TorchAOBaseTensor

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if args[0].requires_grad and torch.is_grad_enabled():
            grad_inputs.append(module.weight.numel())

    handles = [m.register_forward_pre_hook(record) for m in model.modules()
               if isinstance(m, torch.nn.Linear) and isinstance(m.weight, TorchAOBaseTensor)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _train(folder: Path, mode: str, fixed: bool, checkpointing: bool,
           blocks_to_swap: int = 0) -> tuple[dict[str, torch.Tensor], Step]:
    """The LoRA's change over a few of the trainer's steps (fp32 inputs under bf16 autocast) on the base, and what
    the first step kept. SGD, not AdamW: AdamW divides by each element's running gradient size, so a bf16 rounding
    of a near-zero gradient element moves it as far as a real gradient would; SGD's step is the gradient itself."""
    transformer = _base(folder, mode, fixed)
    transformer.requires_grad_(False)
    torch.manual_seed(0)
    add_lora(transformer, flux_lora_targets(transformer, ["attention"]), RANK, RANK)
    cast_trainable_params_to_fp32(transformer)
    if checkpointing:
        transformer.enable_gradient_checkpointing()
    transformer.train()
    if blocks_to_swap:
        BlockSwapper.for_model(transformer, blocks_to_swap, torch.device("cpu"))
    model = FluxLoraModel(transformer)
    params = [p for p in model.parameters() if p.requires_grad]
    for param in params:  # peft starts B at zero; start it elsewhere so the steps' gradients reach both
        torch.nn.init.normal_(param, std=0.02)
    start = {name: p.detach().clone() for name, p in transformer.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD(params, lr=LEARNING_RATE)
    step = FluxLoraStep(model, optimizer=optimizer, accelerator=make_accelerator(mixed_precision="bf16"),
                        sigmas=torch.linspace(1, 0, 1000), objective=FlowMatchingObjective(),
                        guidance_scale=3.5, prior_loss_weight=1.0)
    channels = transformer.config.in_channels // 4
    saved, grad_inputs = [], []

    def count(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter):
            saved.append(tensor.untyped_storage().nbytes())
        return tensor

    for index in range(STEPS):
        torch.manual_seed(index)
        batch = {"latent_dist": torch.randn(1, 2 * channels, 8, 8),
                 "prompt_embeds": torch.randn(1, TEXT_TOKENS, transformer.config.joint_attention_dim),
                 "pooled": torch.randn(1, transformer.config.pooled_projection_dim),
                 "text_ids": torch.zeros(TEXT_TOKENS, 3), "is_reg": torch.zeros(1, dtype=torch.bool)}
        if index > 0:
            step(batch)
            continue
        with _watching_quantized_linears(transformer, grad_inputs), \
                torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor), \
                mp.LiveTensorBytes(mp.tensors_of(model)) as tracker:
            step(batch)
    updates = {name: p.detach() - start[name] for name, p in transformer.named_parameters() if p.requires_grad}
    return updates, Step(sum(saved), tracker.peak, sum(grad_inputs))


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_a_lora_trains_the_same_on_a_base_that_keeps_only_quantized_weights(
        mode: str, checkpointing: bool, tiny_flux_dev_dir: Path) -> None:
    fixed, fixed_step = _train(tiny_flux_dev_dir, mode, fixed=True, checkpointing=checkpointing)
    plain, plain_step = _train(tiny_flux_dev_dir, mode, fixed=False, checkpointing=checkpointing)
    assert fixed.keys() == plain.keys() and fixed
    for name in fixed:
        assert plain[name].norm() > 0, name
        if mode == "fp8":  # dequantize() gives the very values torchao's fp8 linear multiplies with
            assert torch.equal(fixed[name], plain[name]), name
        else:  # torchao's int8 linear scales after the matmul; its bf16 rounding differs in the last bit
            assert (fixed[name] - plain[name]).norm() <= 0.02 * plain[name].norm(), name
    assert fixed_step.quantized_elements == plain_step.quantized_elements > 0
    if not checkpointing:  # a bf16 copy of every quantized weight that needed an input gradient is no longer saved
        assert plain_step.saved - fixed_step.saved >= 2 * fixed_step.quantized_elements
    assert fixed_step.peak < plain_step.peak


@pytest.mark.parametrize("checkpointing", [False, True])
def test_swapped_blocks_give_backward_the_weights_they_ran_with(checkpointing: bool, tiny_flux_dev_dir: Path) -> None:
    """A swapped block's weights are put back as new objects before each of its runs, and taken away after: the
    linear reads the weight it holds at call time, and backward keeps the one its forward used."""
    resident, _ = _train(tiny_flux_dev_dir, "int8", fixed=True, checkpointing=checkpointing)
    swapped, _ = _train(tiny_flux_dev_dir, "int8", fixed=True, checkpointing=checkpointing, blocks_to_swap=2)
    assert resident.keys() == swapped.keys()
    for name in resident:
        assert torch.equal(swapped[name], resident[name]), name


def _saved_bytes_of_a_forward(unet: torch.nn.Module) -> tuple[int, int]:
    """Bytes autograd saves for backward (parameters aside) in one bf16 forward of the UNet on inputs that need
    gradients, and the weight elements of the quantized linears that ran on such inputs."""
    config = unet.config
    saved, grad_inputs = [], []

    def count(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter):
            saved.append(tensor.untyped_storage().nbytes())
        return tensor

    pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    bf16 = {"dtype": torch.bfloat16}
    with _watching_quantized_linears(unet, grad_inputs), torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        unet(torch.randn(1, config.in_channels, 8, 8, **bf16, requires_grad=True), torch.tensor([500]),
             encoder_hidden_states=torch.randn(1, 77, config.cross_attention_dim, **bf16),
             added_cond_kwargs={"text_embeds": torch.randn(1, pooled, **bf16), "time_ids": torch.randn(1, 6, **bf16)})
    return sum(saved), sum(grad_inputs)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_the_sdxl_loader_keeps_only_quantized_weights_for_backward(mode: str, tiny_sdxl_dir: Path) -> None:
    """As for FLUX: sdxl-lora's UNet keeps no dequantized copy of its quantized weights for backward."""
    from diffusers import UNet2DConditionModel

    ours, quantized = _saved_bytes_of_a_forward(
        loading.load_sdxl_unet(str(tiny_sdxl_dir), weight_dtype=torch.bfloat16, unet_quantization=mode))
    plain, _ = _saved_bytes_of_a_forward(UNet2DConditionModel.from_pretrained(
        tiny_sdxl_dir, subfolder="unet", torch_dtype=torch.bfloat16,
        quantization_config=quantization.diffusers_config(mode, torch.bfloat16)))
    assert quantized > 0
    # Without the loader's forward, the quantized linears that dequantize to bf16 keep that copy for backward
    # (at these widths torchao does so for some shapes only: the difference, not 2 bytes per element).
    assert ours < plain, (plain, ours)
