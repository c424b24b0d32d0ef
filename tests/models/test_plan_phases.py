"""The memory plan phase by phase against what the trainer really does on the CPU: the training step's tensors
with the trainer's dtypes (fp32 cached inputs under bf16 autocast, a quantized base), and which components are on
the device in each phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel

from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora, flux_lora_targets
from dreamstep.models import memory_plan as mp
from dreamstep.models import quantization
from dreamstep.models.plans import Estimator
from dreamstep.models.precision import cast_trainable_params_to_fp32
from dreamstep.models.published_configs import FLUX_DEV_TRANSFORMER
from dreamstep.recipes.flux_lora import FluxLoraModel, FluxLoraStep

# FLUX.1's blocks at a quarter of its width: 2 double + 4 single blocks, 256 px (256 image tokens), 64 T5 tokens.
WIDTH, RESOLUTION, TEXT_TOKENS, RANK = 768, 256, 64, 16
MODES = ["none", "fp8", "int8"]


@pytest.fixture(scope="module")
def small_flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("small-flux")
    config = dict(FLUX_DEV_TRANSFORMER, num_layers=2, num_single_layers=4, num_attention_heads=WIDTH // 128)
    torch.manual_seed(0)
    FluxTransformer2DModel.from_config(config).to(torch.bfloat16).save_pretrained(folder / "transformer")
    assert json.loads((folder / "transformer" / "config.json").read_text())["num_layers"] == 2
    return folder


def _measured_training_step(folder: Path, mode: str) -> int:
    """Bytes on the device at the peak of the trainer's first step: the frozen base (quantized as the trainer
    loads it), the LoRA, and every tensor the step creates (activations, gradients, AdamW's state)."""
    pytest.importorskip("torchao")
    transformer = FluxTransformer2DModel.from_pretrained(
        folder, subfolder="transformer", torch_dtype=torch.bfloat16,
        quantization_config=quantization.diffusers_config(mode, torch.bfloat16))
    transformer.requires_grad_(False)
    add_lora(transformer, flux_lora_targets(transformer, ["attention"]), RANK, RANK)
    cast_trainable_params_to_fp32(transformer)
    transformer.enable_gradient_checkpointing()
    transformer.train()
    model = FluxLoraModel(transformer)
    optimizer = build_optimizer("AdamW", [{"params": [p for p in model.parameters() if p.requires_grad]}], 1e-4)
    step = FluxLoraStep(model, optimizer=optimizer, accelerator=make_accelerator(mixed_precision="bf16"),
                        sigmas=torch.linspace(1, 0, 1000), weighting_scheme="none", logit_mean=0.0, logit_std=1.0,
                        mode_scale=1.29, guidance_scale=3.5, prior_loss_weight=1.0)
    side = RESOLUTION // 8
    # What FluxConditioner gives the step: fp32 posteriors and embeddings from the caches.
    batch = {"latent_dist": torch.randn(1, 32, side, side), "prompt_embeds": torch.randn(1, TEXT_TOKENS, 4096),
             "pooled": torch.randn(1, 768), "text_ids": torch.zeros(TEXT_TOKENS, 3),
             "is_reg": torch.zeros(1, dtype=torch.bool)}
    resident = sum(mp.stored_bytes(t) for t in mp.tensors_of(model))
    with mp.LiveTensorBytes(mp.tensors_of(model)) as tracker:
        step(batch)
    return resident + tracker.peak


@pytest.mark.parametrize("mode", MODES)
def test_the_training_phase_holds_the_trainers_step_and_by_at_most_a_quarter(small_flux: Path, mode: str) -> None:
    measured = _measured_training_step(small_flux, mode)
    estimator = Estimator("flux", str(small_flux), rank=RANK, device_type="cpu")
    plan = estimator(mp.PlanOptions(resolution=RESOLUTION, rank=RANK, base_quantization=mode,
                                    max_sequence_length=TEXT_TOKENS, validation_images=False))
    planned = plan.phase("train").device_total
    assert measured <= planned <= 1.25 * measured, (mode, planned / measured)
