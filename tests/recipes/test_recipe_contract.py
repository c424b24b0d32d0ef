"""What every trainer promises around its loop, through the real recipes on tiny models: the output folder
is the user's until they say otherwise, the optimizer is checked before a model loads, checkpoints are
pruned, step files are announced, and the flags that shape training reach the step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, run_cli
from sdxl_testkit import write_method

FLUX_ARGS = ("train", "flux-lora", "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT,
             "--resolution", "32", "--report_to", "none")
SDXL_ARGS = ("train", "sdxl-lora", "--network_dim", "4", "--network_alpha", "4", "--seed", "5", "--log_with", "none")


def test_a_non_empty_output_dir_is_refused_until_overwrite_is_given(tiny_flux_dir: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = (*FLUX_ARGS, "--pretrained_model_name_or_path", tiny_flux_dir, "--output_dir", out,
            "--max_train_steps", "1", "--checkpointing_steps", "0")
    assert run_cli(*args) == 2
    assert "is not empty" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert run_cli(*args, "--overwrite_output_dir") == 0
    assert (out / "pytorch_lora_weights.safetensors").is_file() and (out / "notes.txt").read_text() == "mine"


def test_checkpoints_total_limit_keeps_the_newest(tiny_flux_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli(*FLUX_ARGS, "--pretrained_model_name_or_path", tiny_flux_dir, "--output_dir", out,
                   "--max_train_steps", "3", "--checkpointing_steps", "1", "--checkpoints_total_limit", "2") == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


@pytest.mark.parametrize(("flag", "value", "named"), [("--optimizer", "adamw9", "--optimizer"),
                                                      ("--lr_scheduler", "cosin", "--lr_scheduler")])
def test_a_bad_optimizer_or_schedule_is_named_before_the_model_loads(flag: str, value: str, named: str,
                                                                     tmp_path: Path, capsys) -> None:
    # The base model does not exist: only a check made before loading it can name the flag.
    code = run_cli(*FLUX_ARGS, "--pretrained_model_name_or_path", tmp_path / "no-model", "--output_dir",
                   tmp_path / "out", flag, value)
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}: ") and f"'{value}'" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_sdxl_step_files_are_announced_saved_as_pt_and_timesteps_stay_in_range(
        tiny_sdxl_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.Tensor] = []
    forward = UNet2DConditionModel.forward

    def recording_forward(self, sample, timestep, *args, **kwargs):
        if sample.device.type != "meta":  # the memory plan measures activations on the meta device
            seen.append(torch.as_tensor(timestep).flatten().clone())
        return forward(self, sample, timestep, *args, **kwargs)

    monkeypatch.setattr(UNet2DConditionModel, "forward", recording_forward)
    out = tmp_path / "out"
    assert run_cli(*SDXL_ARGS, "--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config",
                   write_method(tmp_path, "captions"), "--output_dir", out, "--max_train_steps", "3",
                   "--save_every_n_steps", "1", "--save_model_as", "pt", "--min_timestep", "500",
                   "--max_timestep", "510") == 0
    printed = capsys.readouterr().out
    assert f"saved {out / 'last-step00000001.pt'}" in printed and f"saved {out / 'last-step00000002.pt'}" in printed
    assert "validation images" not in printed
    final = torch.load(out / "last.pt", weights_only=True)
    assert final.keys() == torch.load(out / "last-step00000001.pt", weights_only=True).keys()
    assert not list(out.glob("*.safetensors"))
    timesteps = torch.cat(seen)
    assert len(timesteps) == 3 * 2  # 3 steps of batch 2, and nothing else ran the UNet
    assert ((timesteps >= 500) & (timesteps < 510)).all()


def test_a_second_precision_in_one_process_is_one_clear_line(tiny_flux_dir: Path, tmp_path: Path, capsys) -> None:
    # accelerate allows one mixed precision per process; the first run sets fp16 (and stops: no GPU here).
    args = (*FLUX_ARGS, "--pretrained_model_name_or_path", tiny_flux_dir, "--max_train_steps", "1")
    assert run_cli(*args, "--output_dir", tmp_path / "a", "--mixed_precision", "fp16") == 2
    assert run_cli(*args, "--output_dir", tmp_path / "b", "--mixed_precision", "no") == 2
    assert "this process already trained in another precision; run this training in a new process" in \
        capsys.readouterr().err
