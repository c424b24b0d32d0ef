"""Training on a quantized frozen base (``--base_quantization``, ``--fp8_base``) and with the encoders off the
device: the LoRA learns, its file loads on the unquantized base in diffusers and changes the image, resume is
exact, the loop never touches the encoders, and bad combinations stop before any model loads."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, fixed_noise_loss, generate, load_images, run_cli
from safetensors.torch import load_file
from sdxl_testkit import write_method

from dreamstep.config import memory, sdxl_lora, training
from dreamstep.errors import UserError
from dreamstep.models import class_images as class_images_module
from dreamstep.models import parking
from dreamstep.models.class_images import encode_class_prompt
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.flux.controlnet import meta_builder
from dreamstep.models.loading import load_flux_transformer, load_sdxl_unet
from dreamstep.models.memory_plan import PlanOptions
from dreamstep.models.plans import Estimator
from dreamstep.models.sdxl import plumbing as sdxl

pytest.importorskip("torchao", reason="the quantized modes need the 'quant' extra")

ARGS = ("--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
        "--center_crop", "--report_to", "none", "--checkpointing_steps", "0")


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_lora_on_a_quantized_base_learns_and_loads_on_the_unquantized_base(
        mode: str, tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir, "--output_dir", out,
                   *ARGS, "--base_quantization", mode, "--lora_layers", "all-linear", "--rank", "8",
                   "--learning_rate", "1e-2",
                   "--max_train_steps", "40", "--validation_prompt", ROBOT_PROMPT, "--num_validation_images", "1",
                   "--validation_inference_steps", "2") == 0
    assert (out / "samples").is_dir()  # validation ran on the quantized base, encoders brought back
    lora = out / "pytorch_lora_weights.safetensors"
    plain = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    reference = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    # The same keys as a LoRA trained on the unquantized base: peft names, no quantizer internals.
    assert all(k.startswith("transformer.") and ".lora_" in k and k.endswith(".weight") for k in load_file(lora))
    pixels = load_images(ROBOT_DIR, 32)
    before = fixed_noise_loss(plain, pixels, ROBOT_PROMPT)
    plain.load_lora_weights(lora)
    assert fixed_noise_loss(plain, pixels, ROBOT_PROMPT) < 0.9 * before  # fixed noise and σ: a fair comparison
    assert abs(generate(plain) - generate(reference)).max() > 1e-2


def test_base_loads_quantized_and_resume_is_exact(tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    from torchao.utils import TorchAOBaseTensor

    base = flux.load_encoders_for_training(str(tiny_flux_dev_dir), revision=None, variant=None,
                                           mixed_precision="no", device=torch.device("cpu"),
                                           text_encoder_quantization="int8")
    flux.load_transformer_for_training(base, str(tiny_flux_dev_dir), revision=None, variant=None,
                                       transformer_single_file=None, mixed_precision="no",
                                       device=torch.device("cpu"), base_quantization="int8")
    assert isinstance(base.transformer.transformer_blocks[0].attn.to_q.weight, TorchAOBaseTensor)
    assert isinstance(base.text_encoder_2.encoder.block[0].layer[0].SelfAttention.q.weight, TorchAOBaseTensor)

    common = ("--pretrained_model_name_or_path", tiny_flux_dev_dir, *ARGS[:-2], "--checkpointing_steps", "2",
              "--base_quantization", "int8", "--text_encoder_quantization", "int8", "--learning_rate", "1e-3")
    assert run_cli("train", "flux-lora", *common, "--output_dir", tmp_path / "straight", "--max_train_steps", "4") == 0
    split = tmp_path / "split"
    assert run_cli("train", "flux-lora", *common, "--output_dir", split, "--max_train_steps", "2") == 0
    assert run_cli("train", "flux-lora", *common, "--output_dir", split, "--max_train_steps", "4",
                   "--resume_from_checkpoint", "latest") == 0
    straight = load_file(tmp_path / "straight" / "pytorch_lora_weights.safetensors")
    resumed = load_file(split / "pytorch_lora_weights.safetensors")
    assert straight.keys() == resumed.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], atol=1e-6, rtol=0)


def _on_device(components: dict[str, torch.nn.Module | None]) -> tuple[str, ...]:
    """The components whose weights are on the CPU (parked ones wait on the meta device in these tests)."""
    return tuple(name for name, module in components.items()
                 if module is not None and any(p.device.type == "cpu" for p in module.parameters()))


# Per family: the models module, the name of its base and the functions that load the encoders, load the base and
# make validation images (sample images for SDXL), and class images (None: the family's trainers make none).
WATCHED = {"flux": (flux, "transformer", "load_encoders_for_training", "load_transformer_for_training", "generate",
                    "generate_class_images"),
           "sdxl": (sdxl, "unet", "load_encoders_for_training", "load_unet_for_training", "generate_samples", None)}


def _watch_phases(monkeypatch: pytest.MonkeyPatch, family: str = "flux") -> dict[str, set[tuple[str, ...]]]:
    """Record, in a trainer run of ``family`` in this process, which components are on the device when captions and
    images are encoded, at each training step, while validation images are made, and at the validation loss; and,
    with class images to make, when the class prompt is encoded ("class prompt") and while they are made."""
    # Parked modules go to the meta device here (host memory stands in by a copy of their weights, which
    # brings them back): any use of a parked module fails, and where each module's weights are shows, at each
    # moment recorded, what was on the device.
    monkeypatch.setattr(parking, "PARKING_DEVICE", torch.device("meta"))
    host: dict[torch.nn.Module, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}

    def move(module: torch.nn.Module, device: torch.device) -> None:
        if device.type == "meta":
            # The state dict, and the buffers it leaves out (CLIP's position ids).
            state = {k: v.clone() for k, v in module.state_dict().items()}
            host[module] = (state, {k: v.clone() for k, v in module.named_buffers() if k not in state})
            module.to(device)
        elif module in host:
            state, buffers = host.pop(module)
            module.to_empty(device=device).load_state_dict(state)
            for name, value in buffers.items():
                owner, _, leaf = name.rpartition(".")
                setattr(module.get_submodule(owner), leaf, value)

    seen: dict[str, set[tuple[str, ...]]] = {"encode images": set(), "encode text": set(), "train": set(),
                                             "validate": set(), "loss": set()}
    parts: dict[str, torch.nn.Module | None] = {}
    models, base_name, *names, class_images = WATCHED[family]
    load_encoders, load_base, generate = (getattr(models, name) for name in names)
    fills = {"encode images": parking.fill_latents, "encode text": parking.fill_texts}
    making: str | None = None  # "validate" or "class images" while they are made

    def encoders_and_watch(*args, **kwargs):
        components = load_encoders(*args, **kwargs)
        parts.update({base_name: getattr(components, base_name), "text_encoder": components.text_encoder,
                      "text_encoder_2": components.text_encoder_2, "vae": components.vae})
        return components

    def fill_and_watch(phase: str):
        def fill(*args, **kwargs):
            seen[phase].add(_on_device(parts))
            return fills[phase](*args, **kwargs)
        return fill

    def base_and_watch(*args, **kwargs):
        base = load_base(*args, **kwargs)
        parts[base_name] = base

        def record(module, inputs):
            phase = "train" if torch.is_grad_enabled() else making or "loss"
            seen.setdefault(phase, set()).add(_on_device(parts))
        base.register_forward_pre_hook(record)
        return base

    def making_and_watch(what: str, make):
        def watched(*args, **kwargs):
            nonlocal making
            making = what
            try:
                return make(*args, **kwargs)
            finally:
                making = None
        return watched

    def prompt_and_watch(components, device, text_encoders, encode):
        def watched():
            seen.setdefault("class prompt", set()).add(_on_device(parts))
            return encode()
        return encode_class_prompt(components, device, text_encoders, watched)

    generate_and_watch = making_and_watch("validate", generate)
    if class_images is not None:
        monkeypatch.setattr(models, class_images, making_and_watch("class images", getattr(models, class_images)))
        monkeypatch.setattr(class_images_module, "encode_class_prompt", prompt_and_watch)

    monkeypatch.setattr(parking, "move", move)
    monkeypatch.setattr(parking, "fill_latents", fill_and_watch("encode images"))
    monkeypatch.setattr(parking, "fill_texts", fill_and_watch("encode text"))
    for name, watched in zip(names, (encoders_and_watch, base_and_watch, generate_and_watch)):
        monkeypatch.setattr(models, name, watched)
    return seen


def _recorded_once(seen: dict[str, set[tuple[str, ...]]]) -> dict[str, tuple[str, ...]]:
    assert all(len(sets) == 1 for sets in seen.values()), seen  # each phase seen, always with the same components
    return {phase: next(iter(sets)) for phase, sets in seen.items()}


# sd-scripts' order: every held-out image, then every caption and validation prompt, is encoded before the
# transformer loads, the VAE while the text encoders wait in host memory and the other way round; training steps
# see only the transformer; validation images bring back only the VAE, the validation loss nothing.
PHASES_IN_SD_SCRIPTS_ORDER = {"encode images": ("vae",), "encode text": ("text_encoder", "text_encoder_2"),
                              "train": ("transformer",), "validate": ("transformer", "vae"), "loss": ("transformer",)}
PLANNED = ("encode images", "encode text", "train", "validate")


@pytest.mark.parametrize("mode", ["none", "int8"])
def test_each_phase_has_only_its_components_on_the_device(mode: str, tiny_flux_dev_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _watch_phases(monkeypatch)
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir,
                   "--output_dir", tmp_path / "out", *ARGS, "--max_train_steps", "2", "--base_quantization", mode,
                   "--validation_split", "0.34", "--validation_steps", "1", "--validation_prompt", ROBOT_PROMPT,
                   "--num_validation_images", "1", "--validation_inference_steps", "1") == 0
    recorded = _recorded_once(seen)
    assert recorded == PHASES_IN_SD_SCRIPTS_ORDER
    _assert_the_plan_prices(recorded, Estimator("flux", str(tiny_flux_dev_dir), rank=4, device_type="cpu"),
                            resolution=32, base_quantization=mode)


@pytest.mark.parametrize("mode, swapped", [("none", 0), ("int8", 2)])
def test_class_images_are_made_in_the_phase_the_plan_prices(mode: str, swapped: int, tiny_flux_dev_dir: Path,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prior preservation with an empty class folder: the class prompt is encoded with only the text encoders on the
    device, then the transformer, quantized and swapped as the run trains it, makes the class images beside the VAE
    alone; the run then trains in its usual phases, and the plan has the class images phase with those
    components."""
    seen = _watch_phases(monkeypatch)
    class_dir = tmp_path / "class"
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir,
                   "--output_dir", tmp_path / "out", *ARGS, "--max_train_steps", "2", "--base_quantization", mode,
                   "--blocks_to_swap", str(swapped), "--gradient_checkpointing", "--with_prior_preservation",
                   "--class_data_dir", class_dir, "--class_prompt", "a photo of a robot", "--num_class_images", "3",
                   "--sample_batch_size", "2") == 0
    assert len(list(class_dir.glob("class-*.png"))) == 3
    recorded = _recorded_once({phase: found for phase, found in seen.items() if found})  # no validation here
    assert recorded == {"class prompt": ("text_encoder", "text_encoder_2"), "class images": ("transformer", "vae"),
                        **{phase: PHASES_IN_SD_SCRIPTS_ORDER[phase] for phase in ("encode images", "encode text",
                                                                                   "train")}}
    plan = Estimator("flux", str(tiny_flux_dev_dir), rank=4, device_type="cpu")(PlanOptions(
        resolution=32, rank=4, base_quantization=mode, blocks_to_swap=swapped, class_images_batch=2))
    assert plan.phase("class images").resident == recorded["class images"]
    assert plan.phase("encode text").resident == recorded["class prompt"]
    if swapped:
        assert any(f"{swapped} swapped blocks" in line.what for line in plan.phase("class images").host)


def _assert_the_plan_prices(recorded: dict, estimator: Estimator, **options) -> None:
    """The plan puts the same components on the device in each phase as the trainer did (``recorded``), with
    validation images and with the validation loss alone."""
    with_images, loss_only = (estimator(PlanOptions(rank=4, validation_images=images, **options))
                              for images in (True, False))
    assert {phase: with_images.phase(phase).resident for phase in PLANNED} == {
        phase: recorded[phase] for phase in PLANNED}
    assert loss_only.phase("validate").resident == recorded["loss"]


def test_controlnet_phases_have_only_their_components_on_the_device(tiny_flux_dev_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from test_flux_controlnet import COMMON, make_pairs

    pairs = make_pairs(tmp_path / "pairs")
    seen = _watch_phases(monkeypatch)
    assert run_cli("train", "flux-controlnet", "--pretrained_model_name_or_path", tiny_flux_dev_dir,
                   "--output_dir", tmp_path / "out", "--train_data_dir", pairs / "images", "--conditioning_data_dir",
                   pairs / "conditioning", *COMMON, "--max_train_steps", "2", "--validation_split", "0.34",
                   "--validation_steps", "1", "--validation_image", pairs / "conditioning" / "pair_0.png",
                   "--validation_prompt", "a red square", "--num_validation_images", "1",
                   "--validation_inference_steps", "1") == 0
    recorded = _recorded_once(seen)
    assert recorded == PHASES_IN_SD_SCRIPTS_ORDER
    plan = Estimator("flux", str(tiny_flux_dev_dir), device_type="cpu", build_trainable=meta_builder(1, 1),
                     trainable_label="ControlNet")(PlanOptions(resolution=32))
    assert {phase: plan.phase(phase).resident for phase in PLANNED} == {phase: recorded[phase] for phase in PLANNED}


# sdxl-lora in the same order, with its UNet.
SDXL_PHASES = {phase: tuple("unet" if name == "transformer" else name for name in names)
               for phase, names in PHASES_IN_SD_SCRIPTS_ORDER.items()}


@pytest.mark.parametrize("mode, single_file", [("none", False), ("int8", False), ("none", True)])
def test_sdxl_phases_have_only_their_components_on_the_device(mode: str, single_file: bool, tiny_sdxl_dir: Path,
                                                              tiny_sdxl_single_file: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A single file is read whole: its UNet waits in host memory while the encoders encode."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red dog --n blurry --w 64 --h 64 --s 1\na blue cat --w 64 --h 64 --s 1 --l 1\n")
    seen = _watch_phases(monkeypatch, "sdxl")
    source = tiny_sdxl_single_file if single_file else tiny_sdxl_dir
    assert run_cli("train", "sdxl-lora", f"--pretrained_model_name_or_path={source}",
                   f"--dataset_config={write_method(tmp_path, 'captions')}", "--network_train_unet_only",
                   "--max_train_steps=2", "--log_with=none", f"--output_dir={tmp_path / 'out'}",
                   f"--base_quantization={mode}", "--validation_split=0.25", "--validate_every_n_steps=1",
                   f"--sample_prompts={prompts}", "--sample_every_n_steps=1") == 0
    recorded = _recorded_once(seen)
    assert recorded == SDXL_PHASES
    assert sorted(p.name for p in (tmp_path / "out" / "sample").glob("last_*.png")) == [
        f"last_{step:06d}_{i:02d}.png" for step in (1, 2) for i in (0, 1)]
    _assert_the_plan_prices(recorded, Estimator("sdxl", str(tiny_sdxl_dir), rank=4, device_type="cpu"),
                            resolution=64, base_quantization=mode)


def test_sdxl_text_encoders_that_train_stay_on_the_device(tiny_sdxl_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With the text-encoder LoRA (sd-scripts' default) the loop encodes every caption: both CLIP encoders stay
    on the device from the "encode text" phase on; the VAE (latents cached) still comes back only for samples."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red dog --w 64 --h 64 --s 1\n")
    seen = _watch_phases(monkeypatch, "sdxl")
    assert run_cli("train", "sdxl-lora", f"--pretrained_model_name_or_path={tiny_sdxl_dir}",
                   f"--dataset_config={write_method(tmp_path, 'captions')}", "--max_train_steps=2", "--log_with=none",
                   f"--output_dir={tmp_path / 'out'}", "--validation_split=0.25", "--validate_every_n_steps=1",
                   f"--sample_prompts={prompts}", "--sample_every_n_steps=1") == 0
    texts = ("text_encoder", "text_encoder_2")
    assert _recorded_once(seen) == {"encode images": ("vae",), "encode text": texts, "train": ("unet", *texts),
                                    "validate": ("unet", *texts, "vae"), "loss": ("unet", *texts)}


@pytest.fixture
def nf4_as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' bitsandbytes loader and dreamstep's flags refuse nf4 without a GPU: both are told there is one
    (bitsandbytes itself quantizes and computes on the CPU). A CPU build of torch fails any placement on a GPU, so
    a loader or trainer that puts a weight there fails the test."""
    pytest.importorskip("bitsandbytes", reason="nf4 needs the 'quant' extra")
    from diffusers.quantizers.bitsandbytes.bnb_quantizer import BnB4BitDiffusersQuantizer

    monkeypatch.setattr(BnB4BitDiffusersQuantizer, "validate_environment", lambda self, *args, **kwargs: None)
    for config in (training, sdxl_lora):
        monkeypatch.setattr(config, "check_quantization", functools.partial(memory.check_quantization,
                                                                            cuda_available=True))


def _quantized_in_host_memory(model: torch.nn.Module) -> bool:
    import bitsandbytes as bnb

    weights = [m.weight for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    return bool(weights) and all(w.bnb_quantized and w.device.type == "cpu" and w.quant_state.absmax.device.type
                                 == "cpu" for w in weights)


def test_a_4bit_base_that_waits_in_host_memory_is_quantized_there(tiny_flux_dev_dir: Path, tiny_sdxl_dir: Path,
                                                                  nf4_as_on_a_gpu) -> None:
    """A swapped FLUX transformer or SDXL UNet (the swapper then moves only its resident part): its 4-bit weights
    never go to the GPU while it loads."""
    transformer = load_flux_transformer(str(tiny_flux_dev_dir), weight_dtype=torch.bfloat16,
                                        base_quantization="nf4", on_host=True)
    assert _quantized_in_host_memory(transformer)
    unet = load_sdxl_unet(str(tiny_sdxl_dir), weight_dtype=torch.bfloat16, unet_quantization="nf4", on_host=True)
    assert _quantized_in_host_memory(unet)
    if not torch.cuda.is_available():  # the stand-in finds a loader that places the weights on the GPU
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            load_flux_transformer(str(tiny_flux_dev_dir), weight_dtype=torch.bfloat16, base_quantization="nf4")


def test_nf4_from_a_single_file_is_one_line_before_anything_loads(tiny_flux_dev_dir: Path, tiny_sdxl_single_file: Path,
                                                                   tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                   nf4_as_on_a_gpu) -> None:
    """diffusers' single-file loader takes a bitsandbytes config only for weights saved quantized (it fails on a plain
    checkpoint, here after the encoders ran); the trainers say so first."""
    flux_file = tmp_path / "flux-transformer.safetensors"
    flux_file.write_bytes((tiny_flux_dev_dir / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes())
    runs = {"--transformer_single_file": ("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir,
                                          "--transformer_single_file", flux_file, *ARGS),
            "--pretrained_model_name_or_path": ("train", "sdxl-lora", "--pretrained_model_name_or_path",
                                                tiny_sdxl_single_file, "--dataset_config",
                                                write_method(tmp_path, "captions"), "--log_with", "none")}
    for flag, command in runs.items():
        out = tmp_path / flag.strip("-")
        assert run_cli(*command, "--base_quantization", "nf4", "--output_dir", out) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"--base_quantization nf4 cannot load {flag}" in err and "int8" in err
        assert not out.exists()
    with pytest.raises(UserError, match="bitsandbytes"):  # what diffusers does with one
        sdxl.load_encoders_for_training(str(tiny_sdxl_single_file), model_config=None, mixed_precision="bf16",
                                        device=torch.device("cpu"), unet_quantization="nf4")


def test_a_swapped_4bit_base_trains_in_the_phases_the_plan_prices(tiny_flux_dev_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  nf4_as_on_a_gpu) -> None:
    """Without validation: bitsandbytes' CPU kernel for forwards without gradients needs widths of 64 at least, more
    than the tiny model has."""
    seen = _watch_phases(monkeypatch)
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir,
                   "--output_dir", tmp_path / "out", *ARGS, "--max_train_steps", "2", "--base_quantization", "nf4",
                   "--blocks_to_swap", "2", "--gradient_checkpointing", "--mixed_precision", "bf16") == 0
    trained = ("encode images", "encode text", "train")
    recorded = _recorded_once({phase: seen[phase] for phase in trained})
    assert recorded == {phase: PHASES_IN_SD_SCRIPTS_ORDER[phase] for phase in trained}
    estimator = Estimator("flux", str(tiny_flux_dev_dir), rank=4, device_type="cpu")
    options = PlanOptions(resolution=32, rank=4, base_quantization="nf4", blocks_to_swap=2)
    plan = estimator(options)
    assert {phase: plan.phase(phase).resident for phase in trained} == recorded
    # Swapped, it loads into host memory; not swapped, diffusers' bitsandbytes loader quantizes it on the device.
    assert plan.phase("load").resident == ()
    assert estimator(replace(options, blocks_to_swap=0)).phase("load").resident == ("transformer",)


def test_nf4_without_a_gpu_is_one_line_before_anything_loads(tiny_flux_dev_dir: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU, so nf4 is allowed")
    code = run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tmp_path / "no-such-model",
                   "--output_dir", tmp_path / "out", *ARGS, "--base_quantization", "nf4")
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert "--base_quantization nf4 needs a CUDA GPU" in err and "int8" in err
    assert not (tmp_path / "out").exists()


def test_sdxl_fp8_base_trains_and_conflicting_flags_are_refused(tiny_sdxl_dir: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    toml = write_method(tmp_path, "dreambooth")
    common = (f"--pretrained_model_name_or_path={tiny_sdxl_dir}", f"--dataset_config={toml}",
              "--network_train_unet_only", "--max_train_steps=2", "--log_with=none")
    assert run_cli("train", "sdxl-lora", *common, "--fp8_base", "--base_quantization=int8",
                   f"--output_dir={tmp_path / 'bad'}") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--fp8_base" in err and "--base_quantization is int8" in err
    assert not (tmp_path / "bad").exists()
    assert run_cli("train", "sdxl-lora", *common, "--fp8_base", f"--output_dir={tmp_path / 'out'}") == 0
    weights = load_file(next((tmp_path / "out").glob("*.safetensors")))
    assert any(k.startswith("lora_unet_") for k in weights)


def test_controlnet_trains_beside_an_int8_base_and_starts_from_its_dequantized_blocks(
        tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    from diffusers import FluxControlNetModel, FluxTransformer2DModel
    from test_flux_controlnet import COMMON, make_pairs

    pairs = make_pairs(tmp_path / "pairs")
    out = tmp_path / "out"
    assert run_cli("train", "flux-controlnet", "--pretrained_model_name_or_path", tiny_flux_dev_dir,
                   "--output_dir", out, "--train_data_dir", pairs / "images", "--conditioning_data_dir",
                   pairs / "conditioning", *COMMON, "--base_quantization", "int8", "--max_train_steps", "2",
                   "--learning_rate", "1e-12", "--validation_image", pairs / "conditioning" / "pair_0.png",
                   "--validation_prompt", "a red square", "--num_validation_images", "1",
                   "--validation_inference_steps", "2") == 0
    controlnet = FluxControlNetModel.from_pretrained(out)
    plain = FluxTransformer2DModel.from_pretrained(tiny_flux_dev_dir, subfolder="transformer")
    copied, original = (m.transformer_blocks[0].attn.to_q.weight for m in (controlnet, plain))
    # int8 per-row scales: each weight within half a quantization step of the bf16/fp32 original.
    step = original.abs().amax(dim=1, keepdim=True) / 127
    assert ((copied - original).abs() <= step).all() and not torch.equal(copied, torch.zeros_like(copied))


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_swapped_blocks_of_a_quantized_base_train_the_same_lora(mode: str, tiny_flux_dev_dir: Path,
                                                                 tmp_path: Path) -> None:
    # sd-scripts' smallest-card recipe: a quantized base with blocks swapped to host memory.
    common = ("--pretrained_model_name_or_path", tiny_flux_dev_dir, *ARGS, "--base_quantization", mode,
              "--gradient_checkpointing", "--max_train_steps", "3", "--learning_rate", "1e-3")
    assert run_cli("train", "flux-lora", *common, "--output_dir", tmp_path / "resident") == 0
    assert run_cli("train", "flux-lora", *common, "--output_dir", tmp_path / "swapped", "--blocks_to_swap", "2") == 0
    resident, swapped = (load_file(tmp_path / name / "pytorch_lora_weights.safetensors")
                         for name in ("resident", "swapped"))
    assert resident.keys() == swapped.keys()
    assert all(resident[key].abs().max() > 0 for key in resident if "lora_B" in key)  # B starts at zero
    for key in resident:
        torch.testing.assert_close(swapped[key], resident[key], atol=1e-6, rtol=0)


@pytest.mark.parametrize("trainer, flag", [("flux-lora", "--base_quantization=int8"),
                                           ("flux-lora", "--base_quantization=fp8"), ("sdxl-lora", "--fp8_base")])
def test_compile_with_a_torchao_base_is_refused_before_anything_loads(trainer: str, flag: str, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """torch.compile stops with a long traceback inside the first step on torchao weights."""
    data = (("--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT) if trainer == "flux-lora"
            else ("--train_data_dir", tmp_path))
    code = run_cli("train", trainer, "--pretrained_model_name_or_path", tmp_path / "no-such-model", "--output_dir",
                   tmp_path / "out", *data, flag, "--compile")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: --compile cannot compile blocks with ")
    assert not (tmp_path / "out").exists()
