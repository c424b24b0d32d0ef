"""Fixtures for the dashboard tests: a finished tiny FLUX LoRA run trained once per session by the real
trainer, and a run in progress (see dashboard_testkit.GrowingRun)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dashboard_testkit import FINISHED_STEPS, ROBOT_DIR, GrowingRun

from dreamstep.cli import main


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny_flux_dev_dir: Path) -> Path:
    """``<tmp>/runs/robot``: 4 steps of flux-lora with validation grids at steps 2 and 4 and the final grid.
    Tests must not modify it (copy it first)."""
    out = tmp_path_factory.mktemp("runs") / "robot"
    code = main(["train", "flux-lora", "--pretrained_model_name_or_path", str(tiny_flux_dev_dir),
                 "--instance_data_dir", str(ROBOT_DIR), "--instance_prompt", "a photo of sks robot",
                 "--output_dir", str(out), "--resolution", "32", "--rank", "4", "--learning_rate", "1e-3",
                 "--max_train_steps", str(FINISHED_STEPS), "--validation_prompt", "sks robot on the beach",
                 "--validation_steps", "2", "--num_validation_images", "1", "--validation_inference_steps", "1",
                 "--seed", "3"])
    assert code == 0
    return out


@pytest.fixture
def growing_run(tmp_path: Path) -> GrowingRun:
    return GrowingRun(tmp_path / "runs" / "live")
