"""One FLUX flow-matching step with sd-scripts' timestep samplers and loss types has the loss that
sd-scripts' formulas (``flux_train_utils.get_noisy_model_input_and_timesteps``, ``train_util.conditional_loss``
and ``get_huber_threshold_if_needed``) give for the same draws, written out here from sd-scripts' code."""

from __future__ import annotations

import math

import pytest
import torch

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.diffusion.losses import LossFunction
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.flux.lora_targets import flux_lora_targets
from dreamstep.models.flux.tiny import build_tiny_flux
from dreamstep.recipes.flux_lora import FluxLoraModel, FluxLoraStep

BATCH, HEIGHT, WIDTH = 2, 8, 4  # latents (B, 16, 8, 4): 4·2 = 8 packed tokens


@pytest.fixture(scope="module")
def transformer() -> torch.nn.Module:
    pipe = build_tiny_flux(seed=0, guidance_embeds=True)
    add_lora(pipe.transformer, flux_lora_targets(pipe.transformer, ["attention"]), rank=4, alpha=4)
    with torch.no_grad():  # a LoRA that already moves the output
        for name, p in pipe.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    return pipe.transformer


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    mean, std = torch.randn(BATCH, 16, HEIGHT, WIDTH, generator=g), torch.rand(BATCH, 16, HEIGHT, WIDTH, generator=g)
    return {"latent_dist": torch.cat([mean, 0.1 * std], dim=1), "pooled": torch.randn(BATCH, 32, generator=g),
            "prompt_embeds": torch.randn(BATCH, 6, 32, generator=g), "text_ids": flux.text_ids(6, "cpu", torch.float32)}


def _step(transformer: torch.nn.Module, objective: FlowMatchingObjective) -> FluxLoraStep:
    params = [p for p in transformer.parameters() if p.requires_grad]
    return FluxLoraStep(FluxLoraModel(transformer), optimizer=build_optimizer("AdamW", params, 1e-4),
                        accelerator=make_accelerator(mixed_precision="no"), sigmas=torch.linspace(1, 0.001, 1000),
                        objective=objective, guidance_scale=3.5)


def _sd_scripts_sigmas(method: str, objective: FlowMatchingObjective, table: torch.Tensor) -> torch.Tensor:
    """get_noisy_model_input_and_timesteps' σ, as written there."""
    if method in ("uniform", "sigmoid"):
        if method == "sigmoid":
            return torch.sigmoid(objective.sigmoid_scale * torch.randn((BATCH,)))
        return torch.rand((BATCH,))
    if method == "shift":
        sigmas = (torch.randn(BATCH) * objective.sigmoid_scale).sigmoid()
        shift = objective.discrete_flow_shift
        return (sigmas * shift) / (1 + (shift - 1) * sigmas)
    if method == "flux_shift":
        sigmas = (torch.randn(BATCH) * objective.sigmoid_scale).sigmoid()
        m = (1.15 - 0.5) / (4096 - 256)
        mu = m * ((HEIGHT // 2) * (WIDTH // 2)) + 0.5 - m * 256
        return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)
    u = torch.sigmoid(torch.normal(mean=objective.logit_mean, std=objective.logit_std, size=(BATCH,)))
    return table[(u * 1000).long()]


def _sd_scripts_loss(pred: torch.Tensor, target: torch.Tensor, loss: LossFunction,
                     timesteps: torch.Tensor) -> torch.Tensor:
    """conditional_loss(reduction="none") with get_huber_threshold_if_needed's c, as written there."""
    if loss.loss_type == "l2":
        return torch.nn.functional.mse_loss(pred, target, reduction="none")
    if loss.loss_type == "l1":
        return torch.nn.functional.l1_loss(pred, target, reduction="none")
    if loss.huber_schedule == "exponential":
        alpha = -math.log(loss.huber_c) / 1000
        c = torch.exp(-alpha * timesteps) * loss.huber_scale
    else:
        c = torch.full((BATCH,), loss.huber_c * loss.huber_scale)
    c = c.view(-1, 1, 1, 1)
    core = torch.sqrt((pred - target) ** 2 + c**2) - c
    return 2 * c * core if loss.loss_type == "huber" else 2 * core


CASES = {
    "shift + huber exponential": FlowMatchingObjective(timestep_sampling="shift", sigmoid_scale=1.5,
                                                       discrete_flow_shift=3.1858,
                                                       loss=LossFunction("huber", "exponential", 0.2, 1.5)),
    "sigmoid + smooth_l1 constant": FlowMatchingObjective(timestep_sampling="sigmoid", sigmoid_scale=0.7,
                                                          loss=LossFunction("smooth_l1", "constant", 0.3, 2.0)),
    "flux_shift + l1": FlowMatchingObjective(timestep_sampling="flux_shift", loss=LossFunction("l1")),
    "uniform + l2": FlowMatchingObjective(timestep_sampling="uniform"),
    "sigma (logit_normal) + huber": FlowMatchingObjective(weighting_scheme="logit_normal", logit_mean=0.3,
                                                          loss=LossFunction("huber", "constant")),
}


@pytest.mark.parametrize("case", CASES)
def test_one_step_has_sd_scripts_loss_for_the_same_draws(case: str, transformer: torch.nn.Module) -> None:
    objective, batch = CASES[case], _batch()
    step = _step(transformer, objective)
    torch.manual_seed(11)
    loss = step.forward(batch)

    torch.manual_seed(11)  # the reference's draws in the same order: latents, noise, σ
    mean, std = batch["latent_dist"].chunk(2, dim=1)
    latents = mean + std * torch.randn_like(mean)
    noise = torch.randn_like(latents)
    sigmas = _sd_scripts_sigmas(objective.timestep_sampling, objective, step.sigmas).view(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    with torch.no_grad():
        out = transformer(hidden_states=flux.pack(noisy), timestep=sigmas.flatten(), guidance=torch.full((BATCH,), 3.5),
                          pooled_projections=batch["pooled"], encoder_hidden_states=batch["prompt_embeds"],
                          txt_ids=batch["text_ids"], img_ids=flux.latent_image_ids(HEIGHT, WIDTH, "cpu", torch.float32),
                          return_dict=False)[0]
    target = noise - latents
    expected = _sd_scripts_loss(flux.unpack(out, HEIGHT, WIDTH), target, objective.loss, sigmas.flatten() * 1000)
    assert loss.item() == pytest.approx(expected.mean([1, 2, 3]).mean().item(), rel=1e-5)


def test_a_masked_region_contributes_no_gradient_and_the_loss_is_sd_scripts_masked_loss(
        transformer: torch.nn.Module) -> None:
    """apply_masked_loss: the (B, 1, H, W) mask area-averaged to the latent size weights each element; the
    prediction's gradient is zero under black, and the loss is the masked elements' sum over all elements."""
    batch = _batch()
    mask = torch.ones(BATCH, 1, HEIGHT * 8, WIDTH * 8)
    mask[:, :, HEIGHT * 4:] = 0.0  # the bottom half of each image is black
    mask[1, :, : HEIGHT * 2] = 0.5  # a grey band: half the weight
    batch["masks"] = mask
    outputs = []

    def keep_output(module, args, output):
        output[0].retain_grad()
        outputs.append(output[0])

    handle = transformer.register_forward_hook(keep_output)
    try:
        step = _step(transformer, FlowMatchingObjective())
        torch.manual_seed(2)
        loss = step.forward(batch)
        loss.backward()
    finally:
        handle.remove()
        transformer.zero_grad()
    grad = flux.unpack(outputs[0].grad, HEIGHT, WIDTH)  # (B, 16, h, w)
    assert grad[:, :, HEIGHT // 2:].eq(0).all() and grad[:, :, : HEIGHT // 2].ne(0).any()
    pred = flux.unpack(outputs[0].detach(), HEIGHT, WIDTH)
    torch.manual_seed(2)
    mean, std = batch["latent_dist"].chunk(2, dim=1)
    latents = mean + std * torch.randn_like(mean)
    target = torch.randn_like(latents) - latents
    weight = torch.nn.functional.interpolate(mask, size=(HEIGHT, WIDTH), mode="area")
    expected = ((pred - target) ** 2 * weight).mean([1, 2, 3]).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_loss_types_change_the_gradient_as_their_formulas_say(transformer: torch.nn.Module) -> None:
    """Per element, l1's gradient is sign(d), huber's 2c·d/√(d² + c²): the same draws give other gradients."""
    grads = {}
    for loss_type in ("l2", "l1", "huber"):
        step = _step(transformer, FlowMatchingObjective(loss=LossFunction(loss_type, "constant")))
        transformer.zero_grad()
        torch.manual_seed(3)
        step.forward(_batch()).backward()
        grads[loss_type] = torch.cat([p.grad.flatten() for p in transformer.parameters() if p.requires_grad])
    assert not torch.allclose(grads["l2"], grads["l1"]) and not torch.allclose(grads["l2"], grads["huber"])
    transformer.zero_grad()


# ------------------------------------------------------------------------------------ SDXL


@pytest.fixture(scope="module")
def tiny_sdxl():
    from dreamstep.models.sdxl.tiny import build_tiny_sdxl

    return build_tiny_sdxl(seed=0)


def _sdxl_batch(pipe) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    mean = torch.randn(2, 4, 8, 8, generator=g)
    width = pipe.unet.config.cross_attention_dim
    pooled = pipe.unet.config.projection_class_embeddings_input_dim - 6 * pipe.unet.config.addition_time_embed_dim
    return {"latent_dist": torch.cat([mean, torch.zeros_like(mean)], dim=1),
            "prompt_embeds": torch.randn(2, 5, width, generator=g), "pooled": torch.randn(2, pooled, generator=g),
            "add_time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2), "is_reg": torch.tensor([False, True])}


@pytest.mark.parametrize("v_prediction", [False, True])
def test_one_sdxl_step_has_sd_scripts_loss_for_the_same_draws(v_prediction: bool, tiny_sdxl) -> None:
    """Huber with the snr schedule, input perturbation of random strength, min-SNR and the debiased estimation
    weight, prior weight 0.5: train_network.py's loss, written out from its code."""
    from dreamstep.diffusion import noise_prediction as noise_math
    from dreamstep.models.sdxl.plumbing import SDXLLoraModel
    from dreamstep.recipes.sdxl_lora import SDXLLoraStep

    scheduler = noise_math.training_scheduler(tiny_sdxl.scheduler.config)
    model = SDXLLoraModel(tiny_sdxl.unet, torch.nn.Identity(), tiny_sdxl)
    step = SDXLLoraStep(model, optimizer=torch.optim.SGD(tiny_sdxl.unet.parameters(), 0.0),
                        accelerator=make_accelerator(mixed_precision="no"), noise_scheduler=scheduler,
                        v_prediction=v_prediction, min_snr_gamma=5.0, noise_offset=None, adaptive_noise_scale=None,
                        multires_iterations=None, multires_discount=0.3, timestep_range=(0, 1000),
                        prior_loss_weight=0.5, loss=LossFunction("huber", "snr", 0.2),
                        debiased_estimation_loss=True, ip_noise_gamma=0.1, ip_noise_gamma_random_strength=True)
    batch = _sdxl_batch(tiny_sdxl)
    torch.manual_seed(4)
    loss = step.forward(batch)

    torch.manual_seed(4)  # sd-scripts' draws: latents, noise, timesteps, ip strength, ip noise
    latents = batch["latent_dist"][:, :4] + batch["latent_dist"][:, 4:] * torch.randn(2, 4, 8, 8)
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, 1000, (2,))
    strength = torch.rand(1) * 0.1
    noisy = scheduler.add_noise(latents, noise + strength * torch.randn_like(latents), timesteps)
    with torch.no_grad():
        pred = model(noisy, timesteps, batch["add_time_ids"], prompt_embeds=batch["prompt_embeds"],
                     pooled=batch["pooled"])
    target = scheduler.get_velocity(latents, noise, timesteps) if v_prediction else noise
    alphas_cumprod = scheduler.alphas_cumprod[timesteps]
    c = ((1 - 0.2) / (1 + ((1.0 - alphas_cumprod) / alphas_cumprod) ** 0.5) ** 2 + 0.2).view(-1, 1, 1, 1)
    per_sample = (2 * c * (torch.sqrt((pred - target) ** 2 + c**2) - c)).mean([1, 2, 3])
    per_sample = per_sample * torch.tensor([1.0, 0.5])
    snr = alphas_cumprod / (1 - alphas_cumprod)
    min_snr = torch.minimum(snr, torch.full_like(snr, 5.0))
    per_sample = per_sample * (min_snr / (snr + 1) if v_prediction else min_snr / snr)
    snr_capped = torch.minimum(snr, torch.ones_like(snr) * 1000)
    per_sample = per_sample * (1 / (snr_capped + 1) if v_prediction else 1 / torch.sqrt(snr_capped))
    assert loss.item() == pytest.approx(per_sample.mean().item(), rel=1e-5)
