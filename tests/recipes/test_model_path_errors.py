"""A wrong base model is one line naming the flag and what was found there, before anything loads or is written,
in every trainer, generate, eval and plan: a path that does not exist, the other family's folder, a hub id that is
not in the cache while HF_HUB_OFFLINE is set (conftest sets it), an SDXL single file whose configs would come from
the hub, and a folder whose config.json is not JSON."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, run_cli, write_control_pairs
from sdxl_testkit import write_method


def _commands(tmp_path: Path, lora: Path) -> dict[str, tuple[str, tuple[object, ...]]]:
    """Each command's arguments around its base-model flag, with valid data: (family, args before, flag, after)."""
    images, controls = write_control_pairs(tmp_path / "pairs")
    kohya = write_method(tmp_path / "kohya", "captions")
    out = tmp_path / "out"
    flux_train = ("--output_dir", out, "--max_train_steps", "1", "--resolution", "32")
    return {
        "train flux-lora": ("flux", ("train", "flux-lora", "--instance_data_dir", ROBOT_DIR, "--instance_prompt",
                                     ROBOT_PROMPT, *flux_train, "--pretrained_model_name_or_path")),
        "train flux-kohya": ("flux", ("train", "flux-kohya", "--dataset_config", kohya, "--output_dir", out,
                                      "--max_train_steps", "1", "--pretrained_model_name_or_path")),
        "train flux-controlnet": ("flux", ("train", "flux-controlnet", "--train_data_dir", images,
                                           "--conditioning_data_dir", controls, *flux_train,
                                           "--pretrained_model_name_or_path")),
        "train flux-kontext-lora": ("flux", ("train", "flux-kontext-lora", "--instance_data_dir", images,
                                             "--conditioning_data_dir", controls, "--instance_prompt", "make it blue",
                                             *flux_train, "--pretrained_model_name_or_path")),
        "train sdxl-lora": ("sdxl", ("train", "sdxl-lora", "--dataset_config", kohya, "--output_dir", out,
                                     "--max_train_steps", "1", "--pretrained_model_name_or_path")),
        "generate flux": ("flux", ("generate", "flux", "--prompt", "a", "--output_dir", out, "--model")),
        "generate sdxl": ("sdxl", ("generate", "sdxl", "--prompt", "a", "--output_dir", out, "--model")),
        "eval flux": ("flux", ("eval", "flux", "--prompt", "a", "--metrics", "clip_t", "--weights", lora,
                               "--output_dir", out, "--model")),
        "eval sdxl": ("sdxl", ("eval", "sdxl", "--prompt", "a", "--metrics", "clip_t", "--weights", lora,
                               "--output_dir", out, "--model")),
        "plan flux": ("flux", ("plan", "flux", "--pretrained_model_name_or_path")),
        "plan sdxl": ("sdxl", ("plan", "sdxl", "--pretrained_model_name_or_path")),
    }


def _bad_models(family: str, tmp_path: Path, tiny_flux_dir: Path, tiny_sdxl_dir: Path) -> dict[str, tuple[Path | str,
                                                                                                          str]]:
    """Each wrong model of ``family``'s commands, and what its line must say."""
    own, other = (tiny_flux_dir, tiny_sdxl_dir) if family == "flux" else (tiny_sdxl_dir, tiny_flux_dir)
    broken = tmp_path / "broken"
    shutil.copytree(own, broken)
    part = "transformer" if family == "flux" else "unet"
    (broken / part / "config.json").write_text("{not json")
    missing = tmp_path / "no" / "model"
    return {"missing": (missing, str(missing)),
            "other family": (other, "FluxPipeline" if family == "sdxl" else "StableDiffusionXLPipeline"),
            "bad config.json": (broken, f"{part}/config.json is not a readable JSON file")}


@pytest.mark.parametrize("command", ["train flux-lora", "train flux-kohya", "train flux-controlnet",
                                     "train flux-kontext-lora", "train sdxl-lora", "generate flux", "generate sdxl",
                                     "eval flux", "eval sdxl", "plan flux", "plan sdxl"])
def test_a_wrong_model_is_one_line_naming_the_flag(command: str, tiny_flux_dir: Path, tiny_sdxl_dir: Path,
                                                   tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lora = tmp_path / "lora.safetensors"  # never read: the model is checked first
    lora.write_bytes(b"")
    family, args = _commands(tmp_path, lora)[command]
    flag = str(args[-1])
    cases = _bad_models(family, tmp_path, tiny_flux_dir, tiny_sdxl_dir)
    if not command.startswith("plan"):  # plan reads a hub id's published shapes, which needs no download
        cases["hub id offline"] = ("nobody-xyz/no-such-model", "not in the Hugging Face cache while HF_HUB_OFFLINE")
    if family == "sdxl" and not command.startswith("plan"):  # its configs would come from the hub
        lone = tmp_path / "lone" / "model.safetensors"
        lone.parent.mkdir()
        shutil.copy(tiny_sdxl_dir / "tiny_sdxl.safetensors", lone)
        cases["lone single file offline"] = (lone, "lone single file (no --model_config, no model_index.json beside "
                                                   "it): diffusers takes its configs and tokenizers from stabilityai/")
    for case, (model, said) in cases.items():
        assert run_cli(*args, model) == 2, case
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flag}") and said in err and err.count("\n") == 1, (case, err)
        assert not (tmp_path / "out").exists(), case
