"""The memory plan phase by phase against what the trainer really does on the CPU: the training step's tensors
with the trainer's dtypes (fp32 cached inputs that the step casts to bf16, bf16 autocast, a quantized base), and
which components are on the device in each phase."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cuda_stand_ins import CudaRuntime
from diffusers import AutoencoderKL, FluxTransformer2DModel

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models import memory_plan as mp
from dreamstep.models import quantization
from dreamstep.models.blocks import enable_checkpointing
from dreamstep.models.flux.lora_targets import flux_lora_targets
from dreamstep.models.plans import Estimator
from dreamstep.models.precision import cast_trainable_params_to_fp32
from dreamstep.models.published_configs import FLUX_DEV_TRANSFORMER
from dreamstep.recipes.flux_lora import FluxLoraModel, FluxLoraStep

# FLUX.1's blocks at a quarter of its width: 2 double + 4 single blocks, 256 px (256 image tokens), 64 T5 tokens.
WIDTH, RESOLUTION, TEXT_TOKENS, RANK = 768, 256, 64, 16
MODES = ["none", "fp8", "int8", "nf4"]


@pytest.fixture(scope="module")
def small_flux(tmp_path_factory: pytest.TempPathFactory, tiny_flux_dev_dir: Path) -> Path:
    """A transformer of FLUX.1's blocks beside the tiny model's VAE."""
    folder = tmp_path_factory.mktemp("small-flux")
    shutil.copytree(tiny_flux_dev_dir / "vae", folder / "vae")
    config = dict(FLUX_DEV_TRANSFORMER, num_layers=2, num_single_layers=4, num_attention_heads=WIDTH // 128)
    torch.manual_seed(0)
    FluxTransformer2DModel.from_config(config).to(torch.bfloat16).save_pretrained(folder / "transformer")
    assert json.loads((folder / "transformer" / "config.json").read_text())["num_layers"] == 2
    return folder


def _trained_step(folder: Path, mode: str, runtime: CudaRuntime | None = None,
                  ) -> tuple[FluxLoraStep, dict[str, torch.Tensor], int, int]:
    """The trainer's step over the frozen base (quantized as the trainer loads it) with its LoRA, after its
    first call, the batch it took, the peak bytes on the device during that call (the base, the LoRA, and
    every tensor the step created: activations, gradients, AdamW's state), and of them those the step created.
    With a ``runtime`` (CUDA's pieces stood in for), the blocks' checkpointed inputs wait in its pinned host memory
    (``--cpu_offload_checkpointing``), which is not device memory."""
    pytest.importorskip("bitsandbytes" if mode == "nf4" else "torchao")
    # diffusers loads nf4 on a GPU only: on the CPU the same Linear4bit layers are made from the loaded weights.
    transformer = FluxTransformer2DModel.from_pretrained(
        folder, subfolder="transformer", torch_dtype=torch.bfloat16,
        quantization_config=quantization.diffusers_config(mode if mode != "nf4" else "none", torch.bfloat16))
    if mode == "nf4":
        quantization.quantize_built_model(transformer, "nf4")
    quantization.keep_only_quantized_weights(transformer)  # as dreamstep.models.loading does
    transformer.requires_grad_(False)
    add_lora(transformer, flux_lora_targets(transformer, ["attention"]), RANK, RANK)
    cast_trainable_params_to_fp32(transformer)
    enable_checkpointing(transformer, offload_to_host=runtime is not None, device=torch.device("cuda"))
    transformer.train()
    model = FluxLoraModel(transformer)
    optimizer = build_optimizer("AdamW", [{"params": [p for p in model.parameters() if p.requires_grad]}], 1e-4)
    step = FluxLoraStep(model, optimizer=optimizer, accelerator=make_accelerator(mixed_precision="bf16"),
                        sigmas=torch.linspace(1, 0, 1000), objective=FlowMatchingObjective(),
                        guidance_scale=3.5, prior_loss_weight=1.0)
    side = RESOLUTION // 8
    # What FluxConditioner gives the step: fp32 posteriors and embeddings from the caches (the step casts them).
    batch = {"latent_dist": torch.randn(1, 32, side, side), "prompt_embeds": torch.randn(1, TEXT_TOKENS, 4096),
             "pooled": torch.randn(1, 768), "text_ids": torch.zeros(TEXT_TOKENS, 3),
             "is_reg": torch.zeros(1, dtype=torch.bool)}
    resident = sum(mp.stored_bytes(t) for t in mp.tensors_of(model))
    with mp.LiveTensorBytes(mp.tensors_of(model), runtime.is_pinned if runtime else None) as tracker:
        step(batch)
    return step, batch, resident + tracker.peak, tracker.peak


def _plan(folder: Path, mode: str, validation_images: bool = True, offload: bool = False) -> mp.MemoryPlan:
    return Estimator("flux", str(folder), rank=RANK, device_type="cpu")(mp.PlanOptions(
        resolution=RESOLUTION, rank=RANK, base_quantization=mode, max_sequence_length=TEXT_TOKENS,
        validation_images=validation_images, cpu_offload_checkpointing=offload))


@pytest.mark.parametrize("mode", MODES)
def test_the_train_phase_holds_the_trainers_step_and_by_at_most_a_quarter(small_flux: Path, mode: str) -> None:
    _, _, measured, created = _trained_step(small_flux, mode)
    phase = _plan(small_flux, mode).phase("train")
    assert measured <= phase.device_total <= 1.25 * measured, (mode, phase.device_total / measured)
    # The pass on its own (the weights are most of the total, so the total's bound alone would let the pass be
    # far off): the training pass's line and AdamW's state (in the LoRA's line, beside its fp32 weights). Measured
    # here: 1.25x for bf16, 1.11x for fp8, 1.24x for int8; never under. nf4 1.37x: bitsandbytes dequantizes a 4-bit
    # weight for its forward inside one op (gemm_4bit), where LiveTensorBytes does not see it, so the measured
    # figure lacks the bf16 weight that the plan prices (up to 5.6 MiB here, beside a 20 MiB step).
    training_pass = next(line.nbytes for line in phase.device if line.what.startswith("training pass"))
    lora = next(line for line in phase.device if line.what.startswith("LoRA rank"))
    planned = training_pass + lora.nbytes - 4 * lora.params
    assert created <= planned <= (1.4 if mode == "nf4" else 1.3) * created, (mode, planned / created)


@pytest.mark.parametrize("mode", MODES)
def test_offloaded_checkpointing_in_the_train_phase_is_priced_on_the_device_and_in_host_memory(
        small_flux: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(small_flux, mode, offload=True).phase("train")
    assert plan.device_total < _plan(small_flux, mode).phase("train").device_total
    runtime = CudaRuntime(torch.device("cpu"), log_copies=False).install(monkeypatch)
    _, _, measured, _ = _trained_step(small_flux, mode, runtime)
    assert measured <= plan.device_total <= 1.25 * measured, (mode, plan.device_total / measured)
    offloaded = next(line.nbytes for line in plan.host if "--cpu_offload_checkpointing" in line.what)
    assert offloaded == sum(t.nbytes for t in runtime.pinned) > 0


# Not nf4: bitsandbytes' CPU code dequantizes a 4-bit weight per inference matmul in steps of its own (measured here
# at 1.7x the plan's validation forward), where its CUDA kernels multiply a one-image batch without dequantizing.
@pytest.mark.parametrize("mode", [mode for mode in MODES if mode != "nf4"])
def test_the_validate_phase_holds_what_validation_has_and_by_at_most_a_quarter(small_flux: Path, mode: str) -> None:
    step, batch, _, _ = _trained_step(small_flux, mode)
    # Validation: what trains stays (the LoRA with AdamW's state), the VAE comes back; one forward of the
    # transformer as the pipeline runs it (inputs in the base's dtype, no gradients), and the VAE's decode.
    vae = AutoencoderKL.from_pretrained(small_flux / "vae", torch_dtype=torch.bfloat16)
    model = step.unwrapped_model
    state = [t for per_param in step.optimizer.state.values() for t in per_param.values() if t.dim()]
    resident = sum(mp.stored_bytes(t) for t in [*mp.tensors_of(model, vae), *state])
    model.eval()
    tokens = (RESOLUTION // 16) ** 2
    inputs = dict(hidden_states=torch.randn(1, tokens, 64), encoder_hidden_states=batch["prompt_embeds"],
                  pooled_projections=batch["pooled"], timestep=torch.ones(1), guidance=torch.full((1,), 3.5),
                  img_ids=torch.zeros(tokens, 3), txt_ids=batch["text_ids"])
    with torch.no_grad(), mp.LiveTensorBytes(mp.tensors_of(model, vae)) as forward:
        model.transformer(**{k: v.to(torch.bfloat16) if k.endswith(("states", "projections")) else v
                             for k, v in inputs.items()}, return_dict=False)
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    latents = torch.randn(1, vae.config.latent_channels, RESOLUTION // factor, RESOLUTION // factor,
                          dtype=torch.bfloat16)
    with torch.no_grad(), mp.LiveTensorBytes(mp.tensors_of(model, vae)) as decode:
        vae.decode(latents)
    for images, peak in ((True, max(forward.peak, decode.peak)), (False, forward.peak)):
        measured = resident + peak
        planned = _plan(small_flux, mode, images).phase("validate").device_total
        assert measured <= planned <= 1.25 * measured, (mode, images, planned / measured)


def test_each_encode_phase_holds_its_encoders_and_their_largest_pass(tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    """The text encoders as the trainer loads them encoding a batch of captions (padded to T5's 512 tokens, as
    FluxPipeline pads them), and the VAE encoding one image; each while the other waits in host memory."""
    from dreamstep.data.cache import TensorCache
    from dreamstep.models.flux import plumbing as flux

    base = flux.load_encoders_for_training(str(tiny_flux_dev_dir), revision=None, variant=None,
                                           mixed_precision="bf16", device=torch.device("cpu"))
    conditioner = flux.FluxConditioner(flux.assemble_pipeline(base), latent_cache=None,
                                       text_cache=TensorCache(tmp_path / "text", "tiny", []),
                                       max_sequence_length=512, device=torch.device("cpu"))
    texts = [base.text_encoder, base.text_encoder_2]
    with mp.LiveTensorBytes(mp.tensors_of(*texts)) as captions:
        conditioner.prompts([f"caption number {i}" for i in range(8)])
    with mp.LiveTensorBytes(mp.tensors_of(base.vae)) as image:
        conditioner.latents({"pixel_values": torch.zeros(1, 3, 64, 64), "pixel_items": [0], "captions": ["a"],
                             "image_paths": [tmp_path / "a.png"]})
    plan = Estimator("flux", str(tiny_flux_dev_dir), rank=4, device_type="cpu")(
        mp.PlanOptions(resolution=64, rank=4, max_sequence_length=512))
    for phase, encoders, peak in (("encode text", texts, captions.peak), ("encode images", [base.vae], image.peak)):
        measured = sum(mp.stored_bytes(t) for t in mp.tensors_of(*encoders)) + peak
        planned = plan.phase(phase).device_total
        assert measured <= planned <= 1.25 * measured, (phase, planned / measured)
    assert plan.phase("encode text").resident == ("text_encoder", "text_encoder_2")
    assert plan.phase("encode images").resident == ("vae",)


def test_the_plan_counts_the_condition_images_tokens_of_a_model_that_reads_them(tiny_flux_dev_dir: Path) -> None:
    """A transformer that reads a condition image's tokens beside the target's (image_token_multiplier) is
    planned for all of them: 4 images' tokens at 64 px are the tokens of one 128 px image."""
    estimator = Estimator("flux", str(tiny_flux_dev_dir), rank=4, device_type="cpu")
    one = mp.PlanOptions(resolution=64, rank=4, max_sequence_length=16)
    two = mp.PlanOptions(resolution=64, rank=4, max_sequence_length=16, image_token_multiplier=2)
    assert estimator(two).phase("train").device_total > estimator(one).phase("train").device_total
    for train in (True, False):
        assert (estimator.activations(64, 1, True, 16, train=train, image_token_multiplier=4)
                == estimator.activations(128, 1, True, 16, train=train))
