"""Each of the seed's three dataset methods trains the SDXL LoRA, and the loss on its images falls."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open
from sdxl_testkit import (
    captions_for,
    fixed_noise_loss,
    load_pixels,
    run_cli,
    write_method,
)


@pytest.mark.parametrize("method", ["class_tokens", "captions", "finetune"])
def test_method_trains_and_loss_on_its_images_falls(method: str, tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    toml = write_method(tmp_path, method)
    out = tmp_path / "out"
    code = run_cli("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config", toml,
                   "--output_dir", out, "--network_dim", "8", "--network_alpha", "8", "--network_train_unet_only",
                   "--learning_rate", "2e-2", "--max_train_steps", "16", "--seed", "0", "--log_with", "none")
    assert code == 0
    pixels, captions = load_pixels(tmp_path / "butterfly"), captions_for(method)
    before = fixed_noise_loss(pixels, captions)
    after = fixed_noise_loss(pixels, captions, out / "last.safetensors")
    assert after < 0.97 * before, (before, after)
    with safe_open(out / "last.safetensors", "pt") as f:
        tags = f.metadata()["ss_tag_frequency"]
    assert ("sks dog" in tags) == (method == "class_tokens")
