"""``dreamstep generate qwen-image`` and ``generate qwen-image-edit`` through the family's generation members: the
tiny models sample, a LoRA in diffusers' layout changes the image, an edit takes one to three
references, and a base of the other kind is one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dreamstep.cli import main
from dreamstep.lora.inject import add_lora, save_flux_lora
from dreamstep.models.qwen_image.lora_targets import qwen_image_lora_targets
from dreamstep.models.qwen_image.tiny import build_tiny_qwen_image
from dreamstep.models.tiny import write_tiny_model

ROBOT = Path(__file__).resolve().parents[2] / "examples" / "robot" / "robot_0.png"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen-generate")
    pipe = build_tiny_qwen_image(seed=0)
    # attention+ff: a 2-block model's attention-only names are FLUX.1's double blocks' too (a full-size file's
    # blocks past 19 tell it apart); its MLP names are Qwen-Image's alone.
    add_lora(pipe.transformer, qwen_image_lora_targets(pipe.transformer, ["attention+ff"]), rank=4, alpha=4)
    with torch.no_grad():
        for name, param in pipe.transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return {"qwen-image": write_tiny_model("qwen-image", root / "tiny"),
            "qwen-image-edit": write_tiny_model("qwen-image-edit", root / "tiny-edit"),
            "diffusers": save_flux_lora(root / "lora", pipe.transformer)}


def _generate(variant: str, model: Path, out: Path, *extra: object) -> np.ndarray:
    assert main(["generate", variant, "--model", str(model), "--prompt", "a photo of sks robot", "--steps", "2",
                 "--width", "32", "--height", "32", "--seed", "0", "--output_dir", str(out),
                 *map(str, extra)]) == 0
    (image,) = sorted(out.glob("*.png"))
    return np.asarray(Image.open(image), dtype=np.float32)


def test_a_lora_changes_the_image(models: dict[str, Path], tmp_path: Path) -> None:
    base = _generate("qwen-image", models["qwen-image"], tmp_path / "base")
    with_lora = _generate("qwen-image", models["qwen-image"], tmp_path / "lora", "--lora", models["diffusers"])
    assert np.abs(with_lora - base).max() > 2


def test_an_edit_takes_its_references(models: dict[str, Path], tmp_path: Path) -> None:
    one = _generate("qwen-image-edit", models["qwen-image-edit"], tmp_path / "one", "--image", ROBOT)
    two = _generate("qwen-image-edit", models["qwen-image-edit"], tmp_path / "two", "--image", ROBOT, ROBOT)
    assert one.shape == two.shape == (32, 32, 3) and np.abs(one - two).max() > 0


@pytest.mark.parametrize(("variant", "base", "message"), [
    ("qwen-image-edit", "qwen-image", "use generate qwen-image for it"),
    ("qwen-image", "qwen-image-edit", "use generate qwen-image-edit for it"),
])
def test_a_base_of_the_other_kind_is_one_line(variant: str, base: str, message: str, models: dict[str, Path],
                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--image", str(ROBOT)] if variant == "qwen-image-edit" else []
    assert main(["generate", variant, "--model", str(models[base]), "--prompt", "x", "--output_dir",
                 str(tmp_path), *extra]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], errors
