"""``dreamstep train qwen-image-edit-lora`` on the tiny Qwen-Image-Edit-Plus: before/after pairs from two folders
train; the LoRA loads in the Edit pipeline's ``load_lora_weights`` and changes its edit; the instruction embeddings
are cached per instruction and reference image; bad input is one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from flux_testkit import run_cli, write_control_pairs
from PIL import Image
from qwen_image_testkit import tiny_model

from dreamstep.lora.comfyui_files import COMFYUI_WEIGHT_NAME, LORA_WEIGHT_NAME
from dreamstep.models.qwen_image.vl_processor import image_text_processor


@pytest.fixture(scope="module")
def tiny_edit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model("qwen-image-edit", tmp_path_factory.mktemp("qwen-edit"))


@pytest.fixture(scope="module")
def trained(tiny_edit: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pairs")
    targets, references = write_control_pairs(root)
    out = root / "out"
    assert run_cli("train", "qwen-image-edit-lora", "--pretrained_model_name_or_path", tiny_edit,
                   "--instance_data_dir", targets, "--conditioning_data_dir", references, "--output_dir", out,
                   "--resolution", 32, "--train_batch_size", 2, "--max_train_steps", 20, "--learning_rate", 2e-3,
                   "--rank", 8, "--report_to", "none", "--checkpointing_steps", 0) == 0
    return out, references


def _edit(pipe: QwenImageEditPlusPipeline, reference: Image.Image) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe(image=[reference], prompt="an orange ball", num_inference_steps=2, height=32, width=32,
                true_cfg_scale=1.0, output_type="np", generator=torch.Generator().manual_seed(0)).images[0]


def test_outputs_and_one_cached_embedding_per_instruction_and_reference(trained: tuple[Path, Path]) -> None:
    out, references = trained
    assert (out / LORA_WEIGHT_NAME).is_file() and (out / COMFYUI_WEIGHT_NAME).is_file()
    assert len(list((out / "cache" / "text").rglob("*.safetensors"))) == len(list(references.glob("*.png")))


def test_the_lora_loads_in_the_edit_pipeline_and_changes_the_edit(trained: tuple[Path, Path], tiny_edit: Path) -> None:
    out, references = trained
    reference = Image.open(next(references.glob("*.png"))).convert("RGB")
    pipe = QwenImageEditPlusPipeline.from_pretrained(tiny_edit, processor=image_text_processor(str(tiny_edit)))
    before = _edit(pipe, reference)
    pipe.load_lora_weights(out / LORA_WEIGHT_NAME)
    assert np.abs(_edit(pipe, reference) - before).max() > 1e-3


@pytest.mark.parametrize(("extra", "message"), [
    (["--conditioning_data_dir", None], "--instance_data_dir: Qwen-Image-Edit trains on pairs"),
    (["--base", "qwen-image"], "not Qwen-Image-Edit; train it with dreamstep train qwen-image-lora"),
    (["--max_sequence_length", "256"], "--max_sequence_length"),
])
def test_bad_input_is_one_line(extra: list, message: str, tiny_edit: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    targets, references = write_control_pairs(tmp_path)
    base = tiny_model("qwen-image", tmp_path) if extra[0] == "--base" else tiny_edit
    args = ["--pretrained_model_name_or_path", base, "--instance_data_dir", targets, "--output_dir", tmp_path / "out",
            "--resolution", 32, "--max_train_steps", 1, "--report_to", "none"]
    if extra[0] != "--conditioning_data_dir":
        args += ["--conditioning_data_dir", references]
    if extra[0] == "--max_sequence_length":
        args += extra
    assert run_cli("train", "qwen-image-edit-lora", *args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
