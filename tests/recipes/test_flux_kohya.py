"""``train flux-kohya``: sd-scripts' FLUX LoRA command line as its documentation writes it, on tiny FLUX files in the
ComfyUI / sd-scripts layouts; the file it writes (sd-scripts' keys, ss_* metadata, hashes) loads in diffusers and
changes the image as the trained network does; resume is exact; every bad flag, value or file gets its line."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from flux_testkit import ROBOT_DIR, run_cli
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dreamstep.config.flux_network_args import FluxNetworkOptions
from dreamstep.lora.kohya_flux_network import create_flux_network
from dreamstep.lora.kohya_network import weight_hashes


def _dataset(tmp_path: Path) -> Path:
    """A Kohya dataset TOML over the robot images (4 images, batch 2: 2 steps an epoch) with captions."""
    images = tmp_path / "img"
    images.mkdir()
    for i in range(4):
        shutil.copy(ROBOT_DIR / f"robot_{i}.png", images / f"robot_{i}.png")
        (images / f"robot_{i}.txt").write_text("a photo of sks robot, blue")
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[general]\ncaption_extension = ".txt"\n\n[[datasets]]\nresolution = 32\nbatch_size = 2\n\n'
                    f'  [[datasets.subsets]]\n  image_dir = "{images.as_posix()}"\n  num_repeats = 1\n')
    return toml


def _files(files: dict[str, Path], model_config: Path) -> tuple[str, ...]:
    """sd-scripts' model flags with the tiny component files (bf16 BFL transformer and ae, fp16 CLIP-L and T5)."""
    return (f"--pretrained_model_name_or_path={files['transformer']}", f"--clip_l={files['clip_l']}",
            f"--t5xxl={files['t5xxl']}", f"--ae={files['ae']}", f"--model_config={model_config}")


def test_the_documentation_command_line_runs_on_the_files(tiny_flux_files: dict[str, Path], tiny_flux_dev_dir: Path,
                                                         tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# samples\na photo of sks robot --w 32 --h 32 --s 2 --d 7 --g 3.0\n"
                       "sks robot in the snow --n blurry --l 2.5 --w 48 --h 32 --s 2\n")
    out = tmp_path / "out"
    # docs/flux_train_network.md's example (AdamW for AdamW8bit, bf16 for fp16 on a CPU, tiny sizes), as written.
    assert run_cli("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir),
                   f"--dataset_config={_dataset(tmp_path)}", f"--output_dir={out}", "--output_name=my_flux_lora",
                   "--save_model_as=safetensors", "--network_module=networks.lora_flux", "--network_dim=4",
                   "--network_alpha=1", "--learning_rate=5e-3", '--optimizer_type=AdamW', '--lr_scheduler=constant',
                   "--sdpa", "--max_train_epochs=3", "--save_every_n_epochs=1", '--mixed_precision=bf16',
                   "--gradient_checkpointing", "--guidance_scale=1.0", '--timestep_sampling=flux_shift',
                   '--model_prediction_type=raw', "--blocks_to_swap=1", "--cache_text_encoder_outputs",
                   "--cache_latents", "--persistent_data_loader_workers", "--seed=42",
                   f"--sample_prompts={prompts}", "--sample_every_n_epochs=3", "--log_with=none") == 0
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        "my_flux_lora-000001.safetensors", "my_flux_lora-000002.safetensors", "my_flux_lora.safetensors"]
    assert sorted(p.name for p in (out / "sample").glob("my_flux_lora_*.png")) == [
        "my_flux_lora_000006_00.png", "my_flux_lora_000006_01.png"]
    path = out / "my_flux_lora.safetensors"
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in tensors
    assert "lora_unet_single_blocks_0_linear1.alpha" in tensors
    assert "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight" in tensors
    assert all(k.startswith(("lora_unet_", "lora_te1_")) for k in tensors)
    assert {k: metadata[k] for k in ("ss_network_module", "ss_base_model_version", "ss_network_dim",
                                     "ss_network_alpha", "ss_timestep_sampling", "ss_model_prediction_type",
                                     "ss_guidance_scale", "ss_steps", "ss_epoch", "ss_num_epochs",
                                     "ss_output_name", "ss_sd_model_name", "ss_max_train_steps")} == {
        "ss_network_module": "networks.lora_flux", "ss_base_model_version": "flux1", "ss_network_dim": "4",
        "ss_network_alpha": "1.0", "ss_timestep_sampling": "flux_shift", "ss_model_prediction_type": "raw",
        "ss_guidance_scale": "1.0", "ss_steps": "6", "ss_epoch": "3", "ss_num_epochs": "3",
        "ss_output_name": "my_flux_lora", "ss_sd_model_name": tiny_flux_files["transformer"].name,
        "ss_max_train_steps": "6"}
    assert metadata["sshs_model_hash"] == weight_hashes(tensors, metadata)["sshs_model_hash"]
    assert json.loads(metadata["ss_dataset_dirs"]) == {"img": {"n_repeats": 1, "img_count": 4}}


def _image(pipe: FluxPipeline) -> torch.Tensor:
    return pipe("a photo of sks robot", num_inference_steps=2, guidance_scale=3.5, height=32, width=32,
                generator=torch.Generator().manual_seed(0), output_type="pt").images


def test_the_file_loads_in_diffusers_and_changes_the_image_as_the_trained_network(
        tiny_flux_files: dict[str, Path], tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    # diffusers' Kohya FLUX reader splits a single block's linear1 by FLUX.1's full widths (3072 x 3 + 12288),
    # which a tiny model has not: the double blocks (fused qkv included) and CLIP-L are read here.
    out = tmp_path / "out"
    assert run_cli("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config",
                   _dataset(tmp_path), "--output_dir", out, "--network_dim", "4", "--network_alpha", "8",
                   "--network_args", "train_blocks=double", "--learning_rate", "2e-2", "--max_train_steps", "6",
                   "--log_with", "none", "--seed", "1") == 0
    path = out / "last.safetensors"
    pipe = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    pipe.set_progress_bar_config(disable=True)
    base = _image(pipe)
    network = create_flux_network(pipe.transformer, pipe.text_encoder,
                                  FluxNetworkOptions(dim=4, alpha=8.0, train_blocks="double"))
    network.load_weights(path)
    ours = _image(pipe)
    network.detach()
    pipe.load_lora_weights(path)
    loaded = _image(pipe)
    assert (ours - base).abs().max() > 0.02
    torch.testing.assert_close(loaded, ours, atol=2e-4, rtol=0)


def test_resume_is_exact(tiny_flux_files: dict[str, Path], tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    base = ("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config",
            _dataset(tmp_path), "--network_dim", "4", "--learning_rate", "1e-3", "--seed", "5", "--log_with", "none",
            "--network_args", "split_qkv=True", "rank_dropout=0.1", "--timestep_sampling", "shift",
            "--gradient_checkpointing", "--cpu_offload_checkpointing")
    assert run_cli(*base, "--output_dir", tmp_path / "straight", "--max_train_steps", "5") == 0
    interrupted = tmp_path / "interrupted"
    assert run_cli(*base, "--output_dir", interrupted, "--max_train_steps", "3", "--save_state",
                   "--save_every_n_steps", "2") == 0
    assert (interrupted / "checkpoint-2").is_dir() and (interrupted / "checkpoint-3").is_dir()
    assert run_cli(*base, "--output_dir", interrupted, "--max_train_steps", "5", "--resume", "checkpoint-2",
                   "--overwrite_output_dir") == 0
    straight = load_file(tmp_path / "straight" / "last.safetensors")
    resumed = load_file(interrupted / "last.safetensors")
    assert straight.keys() == resumed.keys()
    for key, value in straight.items():
        assert torch.equal(value, resumed[key]), key


def test_t5_attention_mask_trains_caches_the_mask_and_samples(tiny_flux_files: dict[str, Path],
                                                              tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    toml = _dataset(tmp_path)
    for i, caption in enumerate(("sks robot", "a photo of sks robot standing in a field, blue, detailed")):
        (tmp_path / "img" / f"robot_{i}.txt").write_text(caption)  # batch mates with different padding
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("sks robot --w 32 --h 32 --s 2 --d 3\n"
                       "a photo of sks robot in the snow --n blurry --l 2.5 --w 32 --h 32 --s 2\n")
    out = tmp_path / "out"
    assert run_cli("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config", toml,
                   "--output_dir", out, "--apply_t5_attn_mask", "--t5xxl_max_token_length", "32",
                   "--gradient_checkpointing", "--blocks_to_swap", "1", "--learning_rate", "1e-3",
                   "--max_train_steps", "2", "--cache_text_encoder_outputs_to_disk", "--sample_prompts", prompts,
                   "--sample_every_n_steps", "2", "--log_with", "none", "--seed", "3") == 0
    with safe_open(out / "last.safetensors", "pt") as f:
        assert f.metadata()["ss_apply_t5_attn_mask"] == "True"
    assert len(list((out / "sample").glob("last_000002_*.png"))) == 2
    entries = [load_file(p) for p in (out / "cache" / "text").rglob("*.safetensors")]
    assert len(entries) == 5 and all(e["t5_mask"].shape == (32,) for e in entries)  # 3 captions, 2 prompts
    assert sorted(int(e["t5_mask"].sum()) for e in entries)[0] < 32  # padding there, masked


def test_masked_and_unmasked_text_never_share_cache_entries(tiny_flux_files: dict[str, Path],
                                                            tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    from dreamstep.data.cache import text_content_key
    from dreamstep.models.flux import plumbing as flux
    from dreamstep.models.flux.files import resolve_base

    base = resolve_base(str(tiny_flux_files["transformer"]), model_config=str(tiny_flux_dev_dir),
                        clip_l=str(tiny_flux_files["clip_l"]), t5xxl=str(tiny_flux_files["t5xxl"]),
                        ae=str(tiny_flux_files["ae"]))
    paths = [flux.training_caches(tmp_path, base.source, revision=None, variant=None, mixed_precision="no",
                                  max_sequence_length=32, cache_latents=False, image_dirs=[], files=base.files,
                                  t5_attention_mask=masked)[1].path(text_content_key("sks robot"))
             for masked in (False, True)]
    assert paths[0] != paths[1]


def test_samples_mask_each_prompts_own_t5_padding(tiny_flux_dev_dir: Path) -> None:
    # With --apply_t5_attn_mask the prompt and the negative prompt (true CFG) each get their own mask: what their
    # padding holds changes no sample; without the masks it does.
    from contextlib import nullcontext

    from dreamstep.models.flux import plumbing as flux
    from dreamstep.models.flux.samples import FluxSampleWriter
    from dreamstep.models.parking import ParkedModules
    from dreamstep.models.sample_prompts import SamplePrompt

    pipe = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    pipe.set_progress_bar_config(disable=True)
    conditioner = flux.FluxConditioner(pipe, latent_cache=None, text_cache=_memory_cache(), max_sequence_length=24,
                                       device=torch.device("cpu"), t5_attention_mask=True)
    sample = SamplePrompt("a photo of sks robot in the snow at night", negative_prompt="blurry", width=32,
                          height=32, steps=2, scale=2.5, seed=1, guidance=3.5)
    embeddings = FluxSampleWriter.encode(conditioner, [sample])
    assert [int(e["text_mask"].sum()) for e in embeddings.values()] != [24, 24]
    noisy = {text: {**e, "prompt_embeds": torch.where(e["text_mask"][..., None].bool(), e["prompt_embeds"],
                                                      torch.randn(e["prompt_embeds"].shape))}
             for text, e in embeddings.items()}

    def image(found: dict, masked: bool = True) -> torch.Tensor:
        found = found if masked else {t: {k: v for k, v in e.items() if k != "text_mask"} for t, e in found.items()}
        writer = FluxSampleWriter(pipe, torch.nn.Identity(), [sample], found, folder=Path("unused"), name="x",
                                  seed=0, autocast=nullcontext, encoders=ParkedModules({}, torch.device("cpu")),
                                  clip_trains=False)
        return torch.from_numpy(__import__("numpy").asarray(writer._sample(sample, 0), dtype="float32"))

    torch.testing.assert_close(image(noisy), image(embeddings), atol=0, rtol=0)
    assert (image(noisy, masked=False) - image(embeddings, masked=False)).abs().max() > 0


def test_train_t5xxl_trains_t5_saves_lora_te3_and_resumes_exactly(tiny_flux_files: dict[str, Path],
                                                                   tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("sks robot --n blurry --l 2.0 --w 32 --h 32 --s 2\n")
    base = ("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config",
            _dataset(tmp_path), "--network_dim", "4", "--network_alpha", "4", "--learning_rate", "1e-2",
            "--seed", "2", "--log_with", "none", "--network_args", "train_t5xxl=True", "--apply_t5_attn_mask",
            "--t5xxl_max_token_length", "16", "--gradient_checkpointing")
    straight = tmp_path / "straight"
    assert run_cli(*base, "--output_dir", straight, "--max_train_steps", "4", "--sample_prompts", prompts) == 0
    assert (straight / "sample" / "last_000004_00.png").is_file()
    tensors = load_file(straight / "last.safetensors")
    t5_keys = sorted(k.removesuffix(".lora_down.weight") for k in tensors
                     if k.startswith("lora_te3_") and k.endswith(".lora_down.weight"))
    assert len(t5_keys) == 7 * 2 and "lora_te3_encoder_block_0_layer_0_SelfAttention_q" in t5_keys  # tiny T5: 2
    assert any(k.startswith("lora_te1_") for k in tensors) and any(k.startswith("lora_unet_") for k in tensors)
    assert not (straight / "cache" / "text").exists()  # T5 trains: nothing of the text is cached
    # The trained file's text-encoder half changes T5's output (read back into a fresh T5 by our network).
    pipe = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    ids = pipe.tokenizer_2(["a photo of sks robot"], return_tensors="pt").input_ids
    with torch.no_grad():
        before = pipe.text_encoder_2(ids)[0]
        network = create_flux_network(None, pipe.text_encoder, FluxNetworkOptions(dim=4, alpha=4.0),
                                      pipe.text_encoder_2)
        network.load_state_dict({k: v for k, v in tensors.items() if k.startswith("lora_te")})
        after = pipe.text_encoder_2(ids)[0]
        network.detach()
    assert (after - before).abs().max() > 1e-3
    interrupted = tmp_path / "interrupted"
    assert run_cli(*base, "--output_dir", interrupted, "--max_train_steps", "2", "--save_state") == 0
    assert run_cli(*base, "--output_dir", interrupted, "--max_train_steps", "4", "--resume", "checkpoint-2",
                   "--overwrite_output_dir") == 0
    resumed = load_file(interrupted / "last.safetensors")
    assert resumed.keys() == tensors.keys()
    for key, value in tensors.items():
        assert torch.equal(value, resumed[key]), key


def _memory_cache():
    """A text cache that keeps nothing (every prompt is encoded)."""
    class NoCache:
        def get_or_compute(self, keys, compute, known=None):
            return compute(list(range(len(keys))))
    return NoCache()


@pytest.mark.parametrize(("flags", "message"), [
    (("--highvram", "--xformers", "--save_last_n_epochs", "2"),
     "error: --highvram (dreamstep places the models itself; remove it), --xformers (FLUX runs PyTorch's "
     "scaled-dot-product attention (--sdpa)), --save_last_n_epochs (not implemented; delete old files yourself): "
     "sd-scripts flags that dreamstep train flux-kohya does not support; remove them"),
    (("--network_dimm", "8"), "error: unknown flag --network_dimm (did you mean '--network_dim'?)"),
    (("--network_module", "networks.lora"), "error: --network_module 'networks.lora' is not supported here"),
    (("--network_args", "train_t5xxl=True", "--cache_text_encoder_outputs"),
     "error: --cache_text_encoder_outputs with --network_args train_t5xxl=True: T5-XXL trains, so its outputs "
     "cannot be cached (sd-scripts' rule)"),
    (("--network_args", "train_t5xxl=True", "--network_train_unet_only"),
     "error: --network_args train_t5xxl=True with --network_train_unet_only: no text encoder LoRA would train"),
    (("--timestep_sampling", "sigmoid", "--discrete_flow_shift", "3.1582"),
     "error: --discrete_flow_shift has no effect with --timestep_sampling sigmoid; remove it"),
    (("--model_prediction_type", "raw", "--weighting_scheme", "sigma_sqrt"),
     "error: --weighting_scheme sigma_sqrt weighs the loss only with --model_prediction_type sigma_scaled"),
    (("--timestep_sampling", "shift", "--weighting_scheme", "logit_normal"),
     "error: --weighting_scheme logit_normal draws σ from the σ table"),
    (("--model_prediction_type", "sigma",), "error: --model_prediction_type: 'sigma' is not a valid choice"),
    (("--loss_type", "huber"), "error: --loss_type huber with --huber_schedule snr needs a DDPM schedule's SNR"),
    (("--cache_text_encoder_outputs", "false"), "error: --cache_text_encoder_outputs false: dreamstep's FLUX"),
    (("--sample_every_n_steps", "2"), "error: --sample_every_n_steps has no effect without --sample_prompts"),
    (("--gradient_checkpointing", "--cpu_offload_checkpointing", "--blocks_to_swap", "1"),
     "error: --cpu_offload_checkpointing with --blocks_to_swap: sd-scripts takes one of the two"),
    (("--gradient_checkpointing", "--blocks_to_swap", "2"),
     "error: --blocks_to_swap 2: sd-scripts swaps N//2 double and 2(N - N//2) single FLUX blocks and keeps two of "
     "each kind on the device; this FluxTransformer2DModel (1 + 1 blocks) takes 1 to 1"),
    (("--network_args", "single_dim=4", "single_dim=8"), "error: --network_args: 'single_dim' is given twice"),
    (("--network_args", "train_double_block_indices="), "error: --network_args train_double_block_indices=: give "
                                                         "all, none, or block indices"),
    (("--network_args", "train_blocks=single", "train_double_block_indices=0"),
     "error: --network_args train_double_block_indices selects double blocks, but train_blocks=single trains none"),
    (("--network_args", "txt_mlp_dim=-2"), "error: --network_args txt_mlp_dim=-2: a rank is 0 or more"),
    # The block counts come from the transformer's config, read before anything is cached or written.
    (("--network_args", "train_single_block_indices=5"),
     "error: --network_args train_single_block_indices=5: '5' is outside blocks 0-"),
])
def test_bad_flags_get_one_line(flags: tuple[str, ...], message: str, tiny_flux_files: dict[str, Path],
                                tiny_flux_dev_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_cli("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config",
                   _dataset(tmp_path), "--output_dir", out, *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert not out.exists()


@pytest.mark.parametrize(("line", "message"), [
    ("a robot --ss euler", "prompts.txt:1: unknown prompt option '--ss'"),
    ("a robot --w 40", "prompts.txt:1: FLUX needs --w and --h in multiples of 16 (got 40x512)"),
    ("a robot --g high", "prompts.txt:1: --g 'high' is not a number"),
])
def test_bad_sample_prompts_and_files_get_one_line(line: str, message: str, tiny_flux_files: dict[str, Path],
                                                   tiny_flux_dev_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(line + "\n")
    args = ("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config",
            _dataset(tmp_path), "--output_dir", tmp_path / "out")
    assert run_cli(*args, "--sample_prompts", prompts) == 2
    assert message in capsys.readouterr().err
    assert run_cli(*args, "--ae", tiny_flux_files["clip_l"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --ae ") and "CLIP" in err[0], err


@pytest.mark.parametrize(("content", "message"), [
    (b"a robot --s 0\n", "prompts.txt:1: --s 0 is out of range; give at least 1"),
    (b"a robot --w -512\n", "prompts.txt:1: --w -512 is out of range; give at least 8"),
    (b"a robot --s -3\n", "prompts.txt:1: --s -3 is out of range"),
    (b"a robot --l nan\n", "prompts.txt:1: --l nan is out of range"),
    (b"a robot --g inf\n", "prompts.txt:1: --g inf is out of range"),
    (b"a robot --d -1\n", "prompts.txt:1: --d -1 is out of range; give 0 to 2**64 - 1"),
    (b"--w 512 --h 512\n", "prompts.txt:1: the line has no prompt before its options"),
    (b"a robot --s 1e9\n", "prompts.txt:1: --s '1e9' is not a whole number"),
    (b"a robot\n--w 512 --h 512\n", "prompts.txt:2: the line has no prompt before its options"),
    ("a robot\n".encode("utf-16"), "prompts.txt: not UTF-8 text"),
    (b"a r\xf6bot\n", "prompts.txt: not UTF-8 text"),
])
def test_sample_prompt_files_are_checked_at_the_door(content: bytes, message: str, tiny_flux_files: dict[str, Path],
                                                     tiny_flux_dev_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(content)
    out = tmp_path / "out"
    assert run_cli("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config",
                   _dataset(tmp_path), "--output_dir", out, "--sample_prompts", prompts) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_an_unreadable_or_sdxl_network_weights_file_is_refused_before_anything_is_written(
        tiny_flux_files: dict[str, Path], tiny_flux_dev_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.safetensors"
    junk.write_text("not a LoRA")
    sdxl = tmp_path / "sdxl.safetensors"
    save_file({"lora_unet_input_blocks_4_1_proj_in.lora_down.weight": torch.zeros(4, 8),
               "lora_unet_input_blocks_4_1_proj_in.lora_up.weight": torch.zeros(8, 4)}, str(sdxl))
    out, dataset = tmp_path / "out", _dataset(tmp_path)
    for weights, said in ((junk, "not a LoRA file"), (sdxl, "looks made for SDXL")):
        assert run_cli("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config",
                       dataset, "--output_dir", out, "--network_weights", weights) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --network_weights: {weights}") and said in err[0], err
        assert not out.exists()


def test_dry_run_prints_the_plan_from_the_files(tiny_flux_files: dict[str, Path], tiny_flux_dev_dir: Path,
                                                tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_cli("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config",
                   _dataset(tmp_path), "--output_dir", out, "--fp8_base", "--dry_run") == 0
    assert "peak device memory" in capsys.readouterr().out
    assert not list(out.glob("*.safetensors"))


def test_plan_takes_the_component_files(tiny_flux_files: dict[str, Path], tiny_flux_dev_dir: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    files = ("--clip_l", tiny_flux_files["clip_l"], "--t5xxl", tiny_flux_files["t5xxl"], "--ae", tiny_flux_files["ae"],
             "--model_config", tiny_flux_dev_dir, "--resolution", "64", "--device_memory", "2GB")
    assert run_cli("plan", "flux", "--pretrained_model_name_or_path", tiny_flux_files["transformer"], *files) == 0
    bf16 = capsys.readouterr().out
    assert run_cli("plan", "flux", "--pretrained_model_name_or_path", tiny_flux_files["fp8_transformer"], *files) == 0
    fp8 = capsys.readouterr().out
    # The tiny configs are read (not FLUX.1-dev's), and the fp8-stored file is planned as the fp8 base it trains as.
    assert "fits" in bf16 and "GiB" not in bf16.split("peak device memory")[1].split("\n")[0]
    assert "fp8" in fp8 and "fp8" not in bf16
    assert run_cli("plan", "flux", "--pretrained_model_name_or_path", tiny_flux_files["transformer"],
                   "--ae", tiny_flux_files["clip_l"], "--model_config", tiny_flux_dev_dir) == 2
    assert capsys.readouterr().err.startswith("error: --ae ")
    assert run_cli("plan", "sdxl", "--clip_l", tiny_flux_files["clip_l"]) == 2
    assert "--clip_l is a FLUX component flag" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "said"), [
    (("--network_dim=8",), "has rank 4 (lora_unet_double_blocks_0_img_attn_proj) where --network_dim is 8; give "
                           "--network_dim=4"),
    (("--network_dim=8", "--network_args", "split_qkv=True"), "where --network_dim is 8; give --network_dim=4"),
    (("--network_dim=4", "--network_args", "img_attn_dim=2"),
     "where --network_args img_attn_dim is 2; give --network_args img_attn_dim=4"),
])
def test_network_weights_of_another_rank_are_refused_naming_both_ranks(
        flags: tuple[str, ...], said: str, tiny_flux_files: dict[str, Path], tiny_flux_dev_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # sd-scripts loads --network_weights into a network of --network_dim and stops at the size mismatch.
    transformer = FluxPipeline.from_pretrained(tiny_flux_dev_dir).transformer
    weights = create_flux_network(transformer, None, FluxNetworkOptions(dim=4)).save_weights(
        tmp_path / "rank4.safetensors", None, {})
    out = tmp_path / "out"
    capsys.readouterr()
    assert run_cli("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config",
                   _dataset(tmp_path), "--output_dir", out, "--network_weights", weights, *flags,
                   "--cache_latents", "--cache_text_encoder_outputs") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0] and err[0].startswith(f"error: --network_weights: {weights}"), err
    assert not out.exists()


def test_network_weights_of_split_qkv_and_the_same_rank_continue(tiny_flux_files: dict[str, Path],
                                                                 tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    transformer = FluxPipeline.from_pretrained(tiny_flux_dev_dir).transformer
    weights = create_flux_network(transformer, None, FluxNetworkOptions(dim=4, split_qkv=True)).save_weights(
        tmp_path / "split.safetensors", None, {})
    assert run_cli("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config",
                   _dataset(tmp_path), "--output_dir", tmp_path / "out", "--network_weights", weights,
                   "--network_dim=4", "--network_args", "split_qkv=True", "--network_train_unet_only",
                   "--cache_latents", "--cache_text_encoder_outputs", "--max_train_steps", "1",
                   "--log_with", "none") == 0


def test_network_weights_that_do_not_fit_the_network_are_refused_before_anything_is_written(
        tiny_flux_files: dict[str, Path], tiny_flux_dev_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    pipeline = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    with_inputs = create_flux_network(pipeline.transformer, None, FluxNetworkOptions(dim=4, in_dims=(4, 0, 0, 0, 0))
                                      ).save_weights(tmp_path / "in_dims.safetensors", None, {})
    with_clip = create_flux_network(pipeline.transformer, pipeline.text_encoder, FluxNetworkOptions(dim=4)
                                    ).save_weights(tmp_path / "clip.safetensors", None, {})
    out, dataset = tmp_path / "out", _dataset(tmp_path)
    capsys.readouterr()
    for weights, flags in ((with_inputs, ()), (with_clip, ("--network_train_unet_only",))):
        assert run_cli("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config",
                       dataset, "--output_dir", out, "--network_weights", weights, "--network_dim=4",
                       "--cache_latents", "--cache_text_encoder_outputs", *flags) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "do not belong to this network" in err[0], err
        assert not out.exists()


@pytest.mark.parametrize("args", [
    ("train_double_block_indices=9",), ("img_attn_dim=-1",), ("train_blocks=nope",), ("in_dims=[1,2]",),
    ("split_qkv=maybe",), ("train_blocks=double", "train_single_block_indices=0"), ("loraplus_lr_ratio=abc",),
    ("train_blocks=single", "train_blocks=all"),
])
def test_bad_network_args_write_nothing(args: tuple[str, ...], tiny_flux_files: dict[str, Path],
                                        tiny_flux_dev_dir: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_cli("train", "flux-kohya", *_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config",
                   _dataset(tmp_path), "--output_dir", out, "--cache_latents", "--cache_text_encoder_outputs",
                   "--network_args", *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --network_args"), err
    assert not out.exists()


@pytest.mark.parametrize("flags", [
    ("--network_train_unet_only", "--network_args", "train_blocks=single"),
    ("--network_args", "train_double_block_indices=0", "train_single_block_indices=none", "img_attn_dim=2",
     "txt_mlp_dim=0", "in_dims=[2,0,0,0,2]"),
    ("--network_args", "train_blocks=double", "single_dim=8", "img_mod_dim=3"),
    ("--network_train_text_encoder_only",),
])
def test_the_plan_counts_the_parameters_the_run_trains(flags: tuple[str, ...], tiny_flux_files: dict[str, Path],
                                                       tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    from dreamstep.config.flux_kohya import FluxKohyaConfig
    from dreamstep.config.schema import add_arguments, build_config
    from dreamstep.recipes.flux_kohya import plan_inputs, training_datasets

    out = tmp_path / "out"
    argv = [str(a) for a in (*_files(tiny_flux_files, tiny_flux_dev_dir), "--dataset_config", _dataset(tmp_path),
                             "--output_dir", out, "--network_dim", "4", "--log_with", "none", *flags)]
    parser = argparse.ArgumentParser()
    add_arguments(parser, FluxKohyaConfig)
    config = build_config(FluxKohyaConfig, parser.parse_args(argv))
    planned = plan_inputs(config, training_datasets(config), False).estimator().trainable
    planned_count = sum(p.numel() for p in planned.parameters() if p.requires_grad)
    assert run_cli("train", "flux-kohya", *argv, "--max_train_steps", "1") == 0
    trained = load_file(out / "last.safetensors")  # every trained tensor, and the scalar alphas
    assert planned_count == sum(v.numel() for k, v in trained.items() if not k.endswith(".alpha")) > 0
