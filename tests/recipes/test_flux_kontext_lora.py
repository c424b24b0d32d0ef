"""`dreamstep train flux-kontext-lora` on the tiny FLUX.1 Kontext model: it learns the edit of its pairs, its
LoRA loads in diffusers' ``FluxKontextPipeline`` (and, in sd-scripts' names, in ``generate flux-kontext``), resume
is exact, every data layout trains, and bad input is one line before anything is written."""

from __future__ import annotations

import csv
import json
import shlex
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from flux_testkit import load_images, run_cli, write_control_pairs
from PIL import Image
from safetensors.torch import load_file

from dreamstep.diffusion import flow_matching as fm
from dreamstep.engine.logging import LABEL_WIDTH
from dreamstep.engine.run_folder import read_status
from dreamstep.models.flux import plumbing as flux
from dreamstep.png_text import JSON_KEY

INSTRUCTION = "an orange ball"
TRAIN = ("--resolution", "32", "--max_sequence_length", "16", "--report_to", "none", "--checkpointing_steps", "0")
MAX_SEQUENCE_LENGTH = 16
SAME, CHANGED = 3, 8  # uint8 images: the same LoRA by another route may round a few values the other way


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Four "before" images (a square outline) and their "after" images (a filled ball), captioned."""
    return write_control_pairs(tmp_path_factory.mktemp("kontext_pairs"))


@pytest.fixture(scope="module")
def trained(tiny_flux_kontext_dir: Path, pairs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    images, conditioning = pairs
    out = tmp_path_factory.mktemp("flux_kontext_lora") / "out"
    assert run_cli("train", "flux-kontext-lora", "--pretrained_model_name_or_path", tiny_flux_kontext_dir,
                   "--output_dir", out, "--instance_data_dir", images, "--conditioning_data_dir", conditioning, *TRAIN,
                   "--lora_layers", "all-linear", "--rank", "8", "--learning_rate", "1e-2", "--max_train_steps", "30",
                   "--save_kohya_format", "--validation_prompt", INSTRUCTION, "--validation_image",
                   conditioning / "0.png", "--num_validation_images", "1", "--validation_inference_steps", "2") == 0
    return out


@torch.no_grad()
def _edit_loss(pipe: FluxKontextPipeline, targets: torch.Tensor, conditions: torch.Tensor) -> float:
    """Mean flow-matching MSE on the targets' tokens, the conditions' tokens beside them (laid out with diffusers'
    own Kontext helpers), over fixed σ with seeded noise."""
    generator = torch.Generator().manual_seed(0)
    latents, _ = flux.encode_posterior(pipe.vae, targets).chunk(2, dim=1)
    condition, _ = flux.encode_posterior(pipe.vae, conditions).chunk(2, dim=1)
    n, c, h, w = latents.shape
    embeds = flux.encode_prompts(pipe, [INSTRUCTION] * n, max_sequence_length=MAX_SEQUENCE_LENGTH)
    ids = FluxKontextPipeline._prepare_latent_image_ids(n, h // 2, w // 2, "cpu", torch.float32)
    condition_ids = ids.clone()
    condition_ids[..., 0] = 1
    losses = []
    for sigma in (0.2, 0.4, 0.6, 0.8):
        noise = torch.randn(latents.shape, generator=generator)
        s = torch.full((n, 1, 1, 1), sigma)
        tokens = torch.cat([FluxKontextPipeline._pack_latents(fm.noisy_latents(latents, noise, s), n, c, h, w),
                            FluxKontextPipeline._pack_latents(condition, n, c, h, w)], dim=1)
        out = pipe.transformer(hidden_states=tokens, timestep=s.flatten(), guidance=torch.full((n,), 3.5),
                               pooled_projections=embeds["pooled"], encoder_hidden_states=embeds["prompt_embeds"],
                               txt_ids=torch.zeros(embeds["prompt_embeds"].shape[1], 3),
                               img_ids=torch.cat([ids, condition_ids]), return_dict=False)[0]
        pred = FluxKontextPipeline._unpack_latents(out[:, :tokens.shape[1] // 2], h * 8, w * 8, 8)
        losses.append(fm.weighted_mse(pred, noise - latents, s, "none").mean().item())
    return sum(losses) / len(losses)


def _edit(pipe: FluxKontextPipeline, image: Image.Image) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe(image=image, prompt=INSTRUCTION, num_inference_steps=2, height=32, width=32, max_area=32 * 32,
                _auto_resize=False, generator=torch.Generator().manual_seed(0), output_type="np").images[0]


def test_the_lora_lowers_the_fixed_noise_loss_on_its_pairs(trained: Path, tiny_flux_kontext_dir: Path,
                                                           pairs: tuple[Path, Path]) -> None:
    targets, conditions = (load_images(folder, 32) for folder in pairs)
    pipe = FluxKontextPipeline.from_pretrained(tiny_flux_kontext_dir)
    before = _edit_loss(pipe, targets, conditions)
    pipe.load_lora_weights(trained / "pytorch_lora_weights.safetensors")
    after = _edit_loss(pipe, targets, conditions)
    assert after < 0.9 * before, (before, after)


def test_outputs_and_the_validation_grid_shows_the_condition_beside_the_edit(trained: Path) -> None:
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors", "loss_curve.png",
                 "config.toml", "train.log"):
        assert (trained / name).is_file(), name
    (path,) = (trained / "samples").glob("final-*.png")
    grid = Image.open(path)
    cells = json.loads(grid.text[JSON_KEY])["images"]
    # the condition beside the edit (2 x 32 px), in a cell widened for the edit's label
    assert grid.width == max(2 * 32, LABEL_WIDTH)
    assert [(c["width"], c["height"], c["prompt"]) for c in cells] == [(32, 32, INSTRUCTION)]


def test_the_dashboard_shows_the_run(trained: Path) -> None:
    from dreamstep.dashboard.runs import RunIndex

    (run,) = RunIndex([trained]).runs().values()
    summary = run.summary()
    assert (summary["state"], summary["step"], summary["errors"]) == ("finished", 30, [])
    assert run.samples()[-1]["prompt"] == INSTRUCTION and len(run.curves()["loss"]["steps"]) == 30
    assert {lora["name"]: "fits:      yes" in lora["info"] for lora in run.loras()} == {
        "pytorch_lora_weights.safetensors": True, "pytorch_lora_weights_kohya.safetensors": True}


def test_diffusers_loads_the_lora_and_generate_gives_the_same_edit_from_the_kohya_file(
        trained: Path, tiny_flux_kontext_dir: Path, pairs: tuple[Path, Path], tmp_path: Path) -> None:
    before = Image.open(pairs[1] / "0.png").convert("RGB")
    pipe = FluxKontextPipeline.from_pretrained(tiny_flux_kontext_dir)
    base = _edit(pipe, before)
    pipe.load_lora_weights(trained / "pytorch_lora_weights.safetensors")
    assert np.abs(_edit(pipe, before) - base).max() > 1e-2

    def generate(*lora: object) -> np.ndarray:
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        assert run_cli("generate", "flux-kontext", "--model", tiny_flux_kontext_dir, "--image", pairs[1] / "0.png",
                       "--keep_image_size", "--prompt", INSTRUCTION, "--steps", "2", "--seed", "3", "--output_dir",
                       out, *lora) == 0
        (path,) = out.glob("*.png")
        return np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)

    plain = generate()
    edited = generate("--lora", trained / "pytorch_lora_weights.safetensors")
    assert plain.shape == (32, 32, 3) and np.abs(edited - plain).max() > CHANGED
    np.testing.assert_allclose(generate("--lora", trained / "pytorch_lora_weights_kohya.safetensors"), edited,
                               atol=SAME)


def test_eval_scores_the_edits_of_every_candidate(trained: Path, tiny_flux_kontext_dir: Path,
                                                  pairs: tuple[Path, Path], tiny_evaluators: dict[str, Path],
                                                  tmp_path: Path) -> None:
    out = tmp_path / "eval"
    assert run_cli("eval", "flux-kontext", "--model", tiny_flux_kontext_dir, "--weights",
                   trained / "pytorch_lora_weights.safetensors", "--output_dir", out, "--prompt", INSTRUCTION,
                   "--image", pairs[1] / "0.png", "--instance_data_dir", pairs[0], "--resolution", "32",
                   "--steps", "2", "--num_images", "1", "--dino_model", tiny_evaluators["dino"],
                   "--clip_model", tiny_evaluators["clip"]) == 0
    rows = json.loads((out / "scores.json").read_text())["candidates"]
    assert rows[0]["label"] == "base model" and len(rows) == 2
    assert rows[0]["dino"] != rows[1]["dino"]  # the LoRA changed the edit that was scored


def test_resume_equals_an_uninterrupted_run(tiny_flux_kontext_dir: Path, pairs: tuple[Path, Path],
                                            tmp_path: Path) -> None:
    images, conditioning = pairs
    common = ("--pretrained_model_name_or_path", tiny_flux_kontext_dir, "--instance_data_dir", images,
              "--conditioning_data_dir", conditioning, "--resolution", "32", "--max_sequence_length", "16",
              "--report_to", "none",
              "--train_batch_size", "2", "--random_flip", "--vae_encode_mode", "sample", "--learning_rate", "1e-3",
              "--weighting_scheme", "logit_normal", "--checkpointing_steps", "2",
              "--ema_decay", "0.9", "--caption_dropout_rate", "0.5")
    assert run_cli("train", "flux-kontext-lora", *common, "--output_dir", tmp_path / "straight",
                   "--max_train_steps", "4") == 0
    split = tmp_path / "split"
    assert run_cli("train", "flux-kontext-lora", *common, "--output_dir", split, "--max_train_steps", "2") == 0
    assert run_cli("train", "flux-kontext-lora", *common, "--output_dir", split, "--max_train_steps", "4",
                   "--resume_from_checkpoint", "latest") == 0
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ema.safetensors"):  # and the EMA
        straight = load_file(tmp_path / "straight" / name)
        resumed = load_file(split / name)
        assert straight.keys() == resumed.keys()
        for key in straight:
            torch.testing.assert_close(resumed[key], straight[key], atol=1e-6, rtol=0)


def _table(root: Path, images: Path, conditioning: Path, kind: str) -> Path:
    """The pairs as a metadata table with diffusers-style column names, paths relative to the table."""
    rows = [{"after": f"images/{i}.png", "before": f"conditioning/{i}.png", "instruction": INSTRUCTION}
            for i in range(4)]
    for folder in (images, conditioning):
        (root / folder.name).symlink_to(folder)
    if kind == "jsonl":
        path = root / "pairs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path
    with (root / "metadata.csv").open("w", newline="") as f:  # a Hugging Face image folder: file_name is the image
        writer = csv.DictWriter(f, fieldnames=["file_name", "before", "instruction"])
        writer.writeheader()
        writer.writerows({"file_name": r["after"], "before": r["before"], "instruction": r["instruction"]}
                         for r in rows)
    return root


@pytest.mark.parametrize("layout", ["text_to_image", "jsonl", "image_folder", "toml"])
def test_every_data_layout_trains(layout: str, tiny_flux_kontext_dir: Path, pairs: tuple[Path, Path],
                                  tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images, conditioning = pairs
    table = {"image_column": "after", "cond_image_column": "before", "caption_column": "instruction"}
    data = {
        "text_to_image": lambda: ["--instance_data_dir", images],
        "jsonl": lambda: ["--dataset_name", _table(tmp_path, images, conditioning, "jsonl"),
                          *[a for k, v in table.items() for a in (f"--{k}", v)]],
        "image_folder": lambda: ["--dataset_name", _table(tmp_path, images, conditioning, "csv"),
                                 "--cond_image_column", "before", "--caption_column", "instruction"],
        "toml": lambda: ["--dataset_config", _toml(tmp_path, images, conditioning)],
    }[layout]()
    out = tmp_path / "out"
    assert run_cli("train", "flux-kontext-lora", "--pretrained_model_name_or_path", tiny_flux_kontext_dir,
                   "--output_dir", out, *data, *TRAIN, "--max_train_steps", "2") == 0
    cached = len(list((out / "cache" / "latents").rglob("*.safetensors")))
    assert cached == (4 if layout == "text_to_image" else 8)  # the condition latents are cached too
    assert "4 images" in capsys.readouterr().out


def _toml(root: Path, images: Path, conditioning: Path, **subset: str) -> Path:
    path = root / "dataset.toml"
    extra = "".join(f"{k} = '{v}'\n" for k, v in subset.items())
    path.write_text(f"[general]\ncaption_extension = '.txt'\n[[datasets]]\nresolution = 32\n[[datasets.subsets]]\n"
                    f"image_dir = '{images.as_posix()}'\nconditioning_data_dir = '{conditioning.as_posix()}'\n{extra}")
    return path


def _unmatched(root: Path, conditioning: Path) -> Path:
    """The conditioning folder with one "before" image that has no "after" image."""
    folder = root / "unmatched"
    folder.mkdir()
    for path in conditioning.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    Image.new("RGB", (32, 32)).save(folder / "extra.png")
    return folder


def _table_with(root: Path, rows: list[dict[str, str]]) -> Path:
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("case", ["missing_cond_dir", "unmatched_pair", "bad_vae_encode_mode", "missing_column",
                                  "toml_missing_cond_dir", "two_sources", "missing_validation_image", "empty_table",
                                  "path_out_of_the_table_folder"])
def test_bad_input_gives_one_line_and_writes_nothing(case: str, tiny_flux_kontext_dir: Path,
                                                     pairs: tuple[Path, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    images, conditioning = pairs
    folders = ["--instance_data_dir", images, "--conditioning_data_dir"]
    args, named = {
        "missing_cond_dir": lambda: ([*folders, tmp_path / "nope"], "--conditioning_data_dir"),
        "unmatched_pair": lambda: ([*folders, _unmatched(tmp_path, conditioning)], "extra.png"),
        "bad_vae_encode_mode": lambda: ([*folders, conditioning, "--vae_encode_mode", "mean"], "--vae_encode_mode"),
        "missing_column": lambda: (["--dataset_name", _table(tmp_path, images, conditioning, "jsonl"),
                                    "--image_column", "after", "--cond_image_column", "source"],
                                   "'source' (--cond_image_column)"),
        "toml_missing_cond_dir": lambda: (["--dataset_config", _toml(tmp_path, images, tmp_path / "nope")], "nope"),
        "two_sources": lambda: ([*folders, conditioning, "--dataset_config", tmp_path / "x.toml"], "not 2"),
        "missing_validation_image": lambda: ([*folders, conditioning, "--validation_prompt", INSTRUCTION,
                                              "--validation_image", tmp_path / "no.png"], "--validation_image"),
        "empty_table": lambda: (["--dataset_name", _table_with(tmp_path, []), "--cond_image_column", "before"],
                                f"{tmp_path / 'pairs.jsonl'}: the table has no rows"),
        "path_out_of_the_table_folder": lambda: (
            ["--dataset_name", _table_with(tmp_path, [{"image": f"../{images.name}/0.png", "before": "b.png",
                                                       "text": INSTRUCTION}]),
             "--cond_image_column", "before", "--caption_column", "text"],
            f"row 1: '../{images.name}/0.png' leads outside the table's folder"),
    }[case]()
    out = tmp_path / "out"
    code = run_cli("train", "flux-kontext-lora", "--pretrained_model_name_or_path", tiny_flux_kontext_dir,
                   "--output_dir", out, *args, *TRAIN, "--max_train_steps", "1")
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2
    assert len(errors) == 1 and named in errors[0] and "Traceback" not in err, err
    assert not out.exists()


def test_ctrl_c_saves_the_step_and_the_printed_command_continues(tiny_flux_kontext_dir: Path,
                                                                 pairs: tuple[Path, Path], tmp_path: Path) -> None:
    from test_run_safety import Trainer

    out = tmp_path / "out"
    trainer = Trainer([str(a) for a in ("train", "flux-kontext-lora", "--pretrained_model_name_or_path",
                                        tiny_flux_kontext_dir, "--output_dir", out, "--instance_data_dir", pairs[0],
                                        "--conditioning_data_dir", pairs[1], *TRAIN, "--max_train_steps", "1000")])
    trainer.wait_for(lambda: (read_status(out) or {}).get("step", 0) >= 2, "step 2")
    trainer.send(signal.SIGINT)
    assert trainer.finish() == 128 + signal.SIGINT
    step = read_status(out)["step"]
    assert (out / f"checkpoint-{step}").is_dir()
    command = shlex.split(trainer.stderr.split("continue with:\n")[1].splitlines()[0])
    assert command[:3] == ["dreamstep", "train", "flux-kontext-lora"]
    assert run_cli(*command[1:], "--max_train_steps", step + 1) == 0
    assert read_status(out)["state"] == "finished"


def _pairs_run(model: Path, pairs: tuple[Path, Path], out: Path, *extra: object) -> dict[str, torch.Tensor]:
    assert run_cli("train", "flux-kontext-lora", "--pretrained_model_name_or_path", model, "--output_dir", out,
                   "--instance_data_dir", pairs[0], "--conditioning_data_dir", pairs[1], *TRAIN,
                   "--learning_rate", "1e-3", "--gradient_checkpointing", "--max_train_steps", "2", *extra) == 0
    return load_file(out / "pytorch_lora_weights.safetensors")


def test_swapping_every_block_trains_the_same_lora(tiny_flux_kontext_dir: Path, pairs: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    kept = _pairs_run(tiny_flux_kontext_dir, pairs, tmp_path / "kept")
    swapped = _pairs_run(tiny_flux_kontext_dir, pairs, tmp_path / "swapped", "--blocks_to_swap", "2")
    for key in kept:
        torch.testing.assert_close(swapped[key], kept[key], atol=1e-6, rtol=0)


def test_a_lora_trained_on_an_int8_base_loads_on_the_unquantized_base(tiny_flux_kontext_dir: Path,
                                                                      pairs: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    pytest.importorskip("torchao", reason="the quantized modes need the 'quant' extra")
    trained = _pairs_run(tiny_flux_kontext_dir, pairs, tmp_path / "int8", "--base_quantization", "int8")
    assert any(v.abs().sum() > 0 for k, v in trained.items() if "lora_B" in k)
    pipe = FluxKontextPipeline.from_pretrained(tiny_flux_kontext_dir)
    pipe.load_lora_weights(tmp_path / "int8" / "pytorch_lora_weights.safetensors")


def test_the_memory_plan_prices_the_condition_tokens(tiny_flux_kontext_dir: Path, pairs: tuple[Path, Path],
                                                     tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def training_pass(*condition: object) -> float:
        capsys.readouterr()
        assert run_cli("train", "flux-kontext-lora", "--pretrained_model_name_or_path", tiny_flux_kontext_dir,
                       "--output_dir", tmp_path / "out", "--instance_data_dir", pairs[0], *condition,
                       "--resolution", "256", "--dry_run") == 0
        (line,) = [x for x in capsys.readouterr().out.splitlines() if "training pass: 256px" in x]
        return float(line.split()[-2])

    text_to_image = training_pass()
    edit = training_pass("--conditioning_data_dir", pairs[1])
    assert edit > 1.3 * text_to_image, (edit, text_to_image)  # twice the image tokens through every block
    assert not (tmp_path / "out").exists()


def test_a_base_that_is_not_kontext_gets_one_warning_naming_the_kontext_base(
        tiny_flux_dev_dir: Path, tiny_flux_kontext_dir: Path, pairs: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    for base in (tiny_flux_dev_dir, tiny_flux_kontext_dir):
        assert run_cli("train", "flux-kontext-lora", "--pretrained_model_name_or_path", base, "--output_dir",
                       tmp_path / "out", "--instance_data_dir", pairs[0], "--conditioning_data_dir", pairs[1], *TRAIN,
                       "--dry_run") == 0
        warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
        assert warnings == ([f"warning: --pretrained_model_name_or_path {base} is a FluxPipeline, not FLUX.1 Kontext "
                             "(FluxKontextPipeline): its LoRA learns editing from scratch; train on "
                             "black-forest-labs/FLUX.1-Kontext-dev"] if base == tiny_flux_dev_dir else [])


def test_a_pair_trains_in_its_aspect_ratio_bucket(tiny_flux_kontext_dir: Path, tmp_path: Path) -> None:
    """Wide pairs in a bucketed TOML: both images of a pair land in the target's bucket, not a square."""
    images, conditioning = write_control_pairs(tmp_path / "pairs", count=2)
    for folder in (images, conditioning):
        for path in folder.glob("*.png"):
            Image.open(path).resize((128, 64)).save(path)
    toml = tmp_path / "dataset.toml"
    toml.write_text(f"[general]\ncaption_extension = '.txt'\n[[datasets]]\nresolution = 64\nenable_bucket = true\n"
                    "min_bucket_reso = 16\nmax_bucket_reso = 128\nbucket_reso_steps = 16\n[[datasets.subsets]]\n"
                    f"image_dir = '{images.as_posix()}'\nconditioning_data_dir = '{conditioning.as_posix()}'\n")
    out = tmp_path / "out"
    assert run_cli("train", "flux-kontext-lora", "--pretrained_model_name_or_path", tiny_flux_kontext_dir,
                   "--output_dir", out, "--dataset_config", toml, *TRAIN, "--max_train_steps", "1") == 0
    shapes = {tuple(load_file(p)["latents"].shape) for p in (out / "cache" / "latents").rglob("*.safetensors")}
    (shape,) = shapes  # targets and conditions alike
    assert shape[2] > shape[1]  # wider than tall, as the pairs


def test_a_before_identical_to_its_after_is_named_and_a_1x1_before_or_after_is_refused(
        tiny_flux_kontext_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    images, conditioning = write_control_pairs(tmp_path / "pairs", count=2)
    (conditioning / "0.png").write_bytes((images / "0.png").read_bytes())
    args = ("train", "flux-kontext-lora", "--pretrained_model_name_or_path", tiny_flux_kontext_dir,
            "--instance_data_dir", images, "--conditioning_data_dir", conditioning, *TRAIN, "--max_train_steps", "1")
    assert run_cli(*args, "--output_dir", tmp_path / "dry", "--dry_run") == 0
    named = [r.getMessage() for r in caplog.records if "teaches no change" in r.getMessage()]
    assert named == [f"{conditioning / '0.png'}: the same image as 0.png, its pair; the pair teaches no change "
                     "(an edit or a control)"]
    Image.new("RGB", (1, 1)).save(conditioning / "1.png")
    capsys.readouterr()
    assert run_cli(*args, "--output_dir", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {conditioning / '1.png'}: conditioning image is 1x1, smaller than 16 pixels") and \
        err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    Image.new("RGB", (64, 64)).save(conditioning / "1.png")
    Image.new("RGB", (1, 1)).save(images / "1.png")
    assert run_cli(*args, "--output_dir", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {images / '1.png'}: image is 1x1, smaller than 16 pixels") and \
        err.count("\n") == 1
    assert not (tmp_path / "out").exists()
