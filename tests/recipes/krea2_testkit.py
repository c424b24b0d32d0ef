"""Helpers for the Krea 2 recipe tests: the one-step run of the option-contract test."""

from __future__ import annotations

from pathlib import Path

from dreamstep.models.tiny import write_tiny_model

ROBOT_DIR = Path(__file__).resolve().parents[2] / "examples" / "robot"
ROBOT_PROMPT = "a photo of sks robot"


def smallest_run(trainer: str, root: Path) -> dict[str, str]:
    """The options of a one-step run of ``train krea2-lora`` on the tiny Krea 2 (built under ``root``)."""
    model = write_tiny_model("krea2", root / "tiny-krea2", seed=0)
    return {"pretrained_model_name_or_path": str(model), "output_dir": str(root / "out"), "max_train_steps": "1",
            "resolution": "32", "report_to": "none", "checkpointing_steps": "0", "max_sequence_length": "16",
            "instance_data_dir": str(ROBOT_DIR), "instance_prompt": ROBOT_PROMPT}
