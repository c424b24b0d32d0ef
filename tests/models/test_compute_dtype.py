"""The denoiser computes in the compute dtype over a quantized base (issue 37, item 7): the step casts the cached
fp32 latents and embeddings to bf16 under ``--mixed_precision bf16``, as diffusers' ``train_dreambooth_lora_flux.py``
casts ``model_input`` and its prompt embeddings to ``weight_dtype``, and a frozen quantized linear casts its input
as autocast casts a plain linear's. Without both, torchao's int8 and bitsandbytes' 4-bit linears, which return
their input's dtype, make the residual stream fp32 (1.8x the activations of a bf16 one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models import memory_plan as mp
from dreamstep.models import quantization
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.flux.lora_targets import flux_lora_targets
from dreamstep.models.flux.tiny import build_tiny_flux
from dreamstep.models.plans import Estimator
from dreamstep.models.precision import cast_trainable_params_to_fp32
from dreamstep.models.published_configs import FLUX_DEV_TRANSFORMER
from dreamstep.models.vae import encode_posterior
from dreamstep.recipes.flux_lora import FluxLoraModel, FluxLoraStep

pytest.importorskip("torchao", reason="the quantized modes need the 'quant' extra")

GUIDANCE = 3.5
WEIGHT_DTYPE = torch.bfloat16


@torch.no_grad()
def _reference_loss(pipe: FluxPipeline, pixels: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
    """train_dreambooth_lora_flux.py's step from "Convert images to latent space" to the loss, with its casts to
    ``weight_dtype`` (bf16) and under the autocast accelerate runs the transformer in. One line differs: the noise is
    drawn in fp32 and cast (the script draws it in bf16, whose stream of numbers is not fp32's)."""
    vae, transformer = pipe.vae, pipe.transformer
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    model_input = vae.encode(pixels).latent_dist.sample()
    model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    model_input = model_input.to(dtype=WEIGHT_DTYPE)
    bsz, _, height, width = model_input.shape
    latent_image_ids = FluxPipeline._prepare_latent_image_ids(bsz, height // 2, width // 2, "cpu", WEIGHT_DTYPE)
    noise = torch.randn_like(model_input, dtype=torch.float32).to(WEIGHT_DTYPE)
    u = compute_density_for_timestep_sampling(weighting_scheme="none", batch_size=bsz, logit_mean=0.0,
                                              logit_std=1.0, mode_scale=1.29)
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    step_indices = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[step_indices].flatten().reshape(-1, 1, 1, 1).to(WEIGHT_DTYPE)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    packed = FluxPipeline._pack_latents(noisy_model_input, bsz, model_input.shape[1], height, width)
    guidance = torch.tensor([GUIDANCE]).expand(bsz)
    with torch.autocast("cpu", dtype=WEIGHT_DTYPE):
        model_pred = transformer(hidden_states=packed, timestep=timesteps / 1000, guidance=guidance,
                                 pooled_projections=text["pooled"].to(WEIGHT_DTYPE),
                                 encoder_hidden_states=text["prompt_embeds"].to(WEIGHT_DTYPE),
                                 txt_ids=text["text_ids"].to(WEIGHT_DTYPE), img_ids=latent_image_ids,
                                 return_dict=False)[0]
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    model_pred = FluxPipeline._unpack_latents(model_pred, height * scale, width * scale, scale)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(bsz, -1), 1)
    return loss.mean()


def test_an_int8_base_reads_bf16_inputs_keeps_a_bf16_stream_and_has_the_reference_loss() -> None:
    pipe = build_tiny_flux(seed=0, guidance_embeds=True)
    transformer = pipe.transformer
    quantization.quantize_built_model(transformer, "int8")  # as --base_quantization int8 loads it
    transformer.requires_grad_(False)
    add_lora(transformer, flux_lora_targets(transformer, ["attention"]), rank=4, alpha=4)
    cast_trainable_params_to_fp32(transformer)  # LoRA's up weights start at zero: the base's prediction
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    text = flux.encode_prompts(pipe, ["a robot", "a red robot"], max_sequence_length=16)
    text["text_ids"] = flux.text_ids(text["prompt_embeds"].shape[1], "cpu", torch.float32)
    # What FluxConditioner gives the step: fp32 posteriors and embeddings from the caches.
    batch = {"latent_dist": encode_posterior(pipe.vae, pixels), **text}
    assert all(t.dtype == torch.float32 for t in batch.values())
    inputs, stream, linear_outputs = {}, set(), set()
    transformer.register_forward_pre_hook(
        lambda _, args, kwargs: inputs.update({k: v.dtype for k, v in kwargs.items()
                                               if isinstance(v, torch.Tensor)}), with_kwargs=True)
    for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
        block.register_forward_hook(lambda _, args, out: stream.update(t.dtype for t in out))
    for module in transformer.modules():
        if isinstance(module, torch.nn.Linear) and type(module.weight).__name__ == "Int8Tensor":
            module.register_forward_hook(lambda _, args, out: linear_outputs.add(out.dtype))
    assert linear_outputs == set()
    params = [p for p in transformer.parameters() if p.requires_grad]
    step = FluxLoraStep(FluxLoraModel(transformer), optimizer=build_optimizer("AdamW", params, 1e-4),
                        accelerator=make_accelerator(mixed_precision="bf16"), max_grad_norm=1.0,
                        sigmas=flux.training_sigmas(pipe.scheduler), objective=FlowMatchingObjective(),
                        guidance_scale=GUIDANCE)

    torch.manual_seed(7)
    expected = _reference_loss(pipe, pixels, text)
    torch.manual_seed(7)
    (loss,) = step(batch)

    for name in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
        assert inputs[name] == torch.bfloat16, name
    assert inputs["timestep"] == inputs["guidance"] == inputs["img_ids"] == torch.float32  # σ and positions exact
    assert stream == linear_outputs == {torch.bfloat16}
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected.to(loss.dtype), rtol=5e-3, atol=1e-5)  # measured: 6e-4


@pytest.mark.parametrize("mode", ["int8", "fp8", "nf4"])
def test_a_frozen_quantized_linear_computes_an_fp32_input_as_autocast_computes_a_linears(mode: str) -> None:
    """CUDA's autocast keeps a norm's output in fp32: the quantized linear after it must still return bf16, and
    torchao's int8 must dequantize to bf16 alone (2 bytes per weight), not to fp32 first (6)."""
    pytest.importorskip("bitsandbytes" if mode == "nf4" else "torchao")
    holder = torch.nn.Sequential(torch.nn.Linear(256, 512, dtype=torch.bfloat16))
    quantization.quantize_built_model(holder, mode)
    holder.requires_grad_(False)
    x = torch.randn(64, 256, requires_grad=True)
    with mp.LiveTensorBytes([*mp.tensors_of(holder), x]) as tracker, torch.autocast("cpu", dtype=torch.bfloat16):
        out = holder(x)
    assert out.dtype == torch.bfloat16
    per_weight = (tracker.peak - out.nbytes - x.numel() * 2) / holder[0].weight.shape.numel()
    assert per_weight <= _cpu_bytes_per_weight(mode), per_weight
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert holder(x.detach().bfloat16()).dtype == torch.bfloat16  # outside autocast the input is left alone
        if mode == "int8":
            assert holder(x.detach()).dtype == torch.float32


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_the_plan_prices_an_int8_or_nf4_training_pass_as_a_bf16_ones(tmp_path: Path, device_type: str) -> None:
    """FLUX.1's blocks at a quarter of its width on the meta device: with bf16 inputs and a bf16 stream, a quantized
    base's training pass differs from the bf16 base's only by the dequantized weight of the linear that runs: 1.06x
    to 1.11x here (the fp32 stream made int8's 1.94x and nf4's 1.77x under CUDA's policy)."""
    config = dict(FLUX_DEV_TRANSFORMER, num_layers=2, num_single_layers=4, num_attention_heads=6)
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(config))
    estimator = Estimator("flux", str(tmp_path), rank=16, device_type=device_type)
    bf16 = estimator.activations(512, 1, True, 128)
    for mode in ("int8", "nf4"):
        assert bf16 < estimator.activations(512, 1, True, 128, mode) < 1.15 * bf16, mode


def test_sdxl_lora_feeds_an_int8_unet_bf16_latents_and_embeddings_and_exact_sizes() -> None:
    """sd-scripts casts x_t and the text conditioning to ``weight_dtype`` and embeds the sizes from exact values; the
    UNet's blocks then run bf16 over an int8 base too."""
    from dreamstep.diffusion import noise_prediction as noise_math
    from dreamstep.diffusion.losses import LossFunction
    from dreamstep.models.sdxl.plumbing import SDXLLoraModel
    from dreamstep.models.sdxl.tiny import build_tiny_sdxl
    from dreamstep.recipes.sdxl_lora import SDXLLoraStep

    pipe = build_tiny_sdxl(seed=0)
    unet = pipe.unet.to(torch.bfloat16)
    quantization.quantize_built_model(unet, "int8")
    unet.requires_grad_(False)
    seen, stream = {}, set()
    unet.register_forward_pre_hook(lambda _, args, kwargs: seen.update(
        sample=args[0].dtype, text=kwargs["encoder_hidden_states"].dtype,
        pooled=kwargs["added_cond_kwargs"]["text_embeds"].dtype,
        sizes=kwargs["added_cond_kwargs"]["time_ids"].dtype), with_kwargs=True)
    for block in [*unet.down_blocks, unet.mid_block, *unet.up_blocks]:
        block.register_forward_hook(lambda _, args, out: stream.update(
            t.dtype for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)))
    step = SDXLLoraStep(SDXLLoraModel(unet, torch.nn.Identity(), pipe), optimizer=torch.optim.SGD([torch.zeros(1)]),
                        accelerator=make_accelerator(mixed_precision="bf16"),
                        noise_scheduler=noise_math.training_scheduler(pipe.scheduler.config), v_prediction=False,
                        min_snr_gamma=None, noise_offset=None, adaptive_noise_scale=None, multires_iterations=None,
                        multires_discount=0.3, timestep_range=(0, 1000), prior_loss_weight=1.0,
                        loss=LossFunction("l2", "snr", 0.1), debiased_estimation_loss=False, ip_noise_gamma=None,
                        ip_noise_gamma_random_strength=False)
    width = unet.config.cross_attention_dim
    pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
    mean = torch.randn(2, 4, 8, 8)
    batch = {"latent_dist": torch.cat([mean, torch.zeros_like(mean)], dim=1),
             "prompt_embeds": torch.randn(2, 5, width), "pooled": torch.randn(2, pooled),
             "add_time_ids": torch.tensor([[1017.0, 517, 3, 5, 1024, 512]] * 2), "is_reg": torch.tensor([False, True])}
    with torch.no_grad(), step.autocast():
        loss = step.forward(batch)
    assert seen == {"sample": torch.bfloat16, "text": torch.bfloat16, "pooled": torch.bfloat16,
                    "sizes": torch.float32}
    assert stream == {torch.bfloat16}
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def _cpu_bytes_per_weight(mode: str) -> float:
    """What the plan prices per weight for one matmul (CUDA's kernels), which the CPU paths match, except the CPU
    4-bit matmul of older bitsandbytes: 0.48 (the floor) dequantizes through fp32 (4 bytes), 0.50 does not (0.49 is
    counted with the older ones, unmeasured)."""
    if mode == "nf4":
        import bitsandbytes
        from packaging.version import Version

        if Version(bitsandbytes.__version__) < Version("0.50"):
            return 4.0
    return mp.QUANTIZED_LINEAR_BYTES[mode][0]
