"""The dashboard's dataset check and job plan for ``train flux2-lora``: the same recipe functions the trainer calls
(its datasets, its plan inputs) on the tiny FLUX.2 [klein]."""

from __future__ import annotations

from pathlib import Path

from dreamstep.dashboard.dataset_check import check_dataset
from dreamstep.dashboard.run_plan import job_plan
from dreamstep.dashboard.trainer_data import check_config
from dreamstep.models.tiny import write_tiny_model

ROBOT_DIR = Path(__file__).resolve().parents[2] / "examples" / "robot"


def test_the_dataset_check_and_the_job_plan_of_a_flux2_run(tmp_path: Path) -> None:
    klein = write_tiny_model("flux2-klein", tmp_path / "klein")
    check = check_dataset(ROBOT_DIR, resolution=32, instance_prompt="a photo of sks robot", trainer="flux2-lora")
    assert len(check.images) == 6 and not [image for image in check.images if image.problems]
    config = check_config("flux2-lora", ROBOT_DIR, resolution=32, instance_prompt="a photo of sks robot",
                          pretrained_model_name_or_path=klein, output_dir=tmp_path / "out", device_memory="4GB")
    plan = job_plan("flux2-lora", config, check)
    assert plan["fits"] is True and plan["base"] == str(klein)
    assert "text_encoder (Qwen3" in plan["report"] and "LoRA rank 4" in plan["report"]
