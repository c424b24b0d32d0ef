"""`--blocks_to_swap` and `--compile` on the FLUX trainers with the tiny model: swapping every block
gives the same loss history and LoRA as keeping them resident, and a swapped run resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, run_cli
from safetensors.torch import load_file


def _losses(run: Path, step: int) -> list[list[float]]:
    return json.loads((run / f"checkpoint-{step}" / "trainer_state.json").read_text())["extra"]["loss_history"]


def test_swapped_blocks_give_the_same_losses_and_lora_and_resume(tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    common = ("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir,
              "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
              "--report_to", "none", "--train_batch_size", "2", "--learning_rate", "1e-2",
              "--lora_layers", "all-linear", "--gradient_checkpointing", "--checkpointing_steps", "2")
    resident, swapped = tmp_path / "resident", tmp_path / "swapped"
    assert run_cli(*common, "--output_dir", resident, "--max_train_steps", "4") == 0
    # The tiny transformer has one double and one single block: both are swapped. Stop half-way, resume.
    assert run_cli(*common, "--output_dir", swapped, "--max_train_steps", "2", "--blocks_to_swap", "2") == 0
    assert run_cli(*common, "--output_dir", swapped, "--max_train_steps", "4", "--blocks_to_swap", "2",
                   "--resume_from_checkpoint", "latest") == 0
    assert [step for step, _ in _losses(swapped, 4)] == [1, 2, 3, 4]
    torch.testing.assert_close(_losses(swapped, 4), _losses(resident, 4), rtol=0, atol=1e-7)
    expected = load_file(resident / "pytorch_lora_weights.safetensors")
    got = load_file(swapped / "pytorch_lora_weights.safetensors")
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-7)
    assert (expected["transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight"] != 0).any()


@pytest.mark.parametrize("flags, message", [
    (("--blocks_to_swap", "2"), "--blocks_to_swap needs --gradient_checkpointing"),
    (("--blocks_to_swap", "-1", "--gradient_checkpointing"), "--blocks_to_swap must be"),
    (("--blocks_to_swap", "3", "--gradient_checkpointing"), "--blocks_to_swap 3: the model has 2 blocks; choose 0 to"),
    (("--cpu_offload_checkpointing",), "--cpu_offload_checkpointing needs --gradient_checkpointing"),
])
def test_bad_blocks_to_swap_is_one_line(flags: tuple[str, ...], message: str, tiny_flux_dev_dir: Path,
                                        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir,
                   "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
                   "--report_to", "none", "--output_dir", tmp_path / "out", *flags)
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code != 0 and last_line.startswith("error: ") and message in last_line, last_line
    assert not (tmp_path / "out").exists()
