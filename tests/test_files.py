"""What dreamstep writes honours the umask (safetensors alone would write 0600, unreadable by the account a
ComfyUI or A1111 server runs under)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dreamstep.evaluation.candidates import flux_checkpoint_as_lora
from dreamstep.files import default_file_mode
from dreamstep.lora.io import write_lora_file


@pytest.fixture
def group_readable_umask():
    previous = os.umask(0o027)
    yield
    os.umask(previous)


@pytest.mark.parametrize("name, container", [("a.safetensors", "safetensors"), ("a.ckpt", "torch")])
def test_lora_files_get_the_umask_mode(tmp_path: Path, group_readable_umask, name: str, container: str) -> None:
    path = tmp_path / name
    write_lora_file(path, {"lora_unet_x.lora_down.weight": torch.zeros(2, 2)}, {}, container)
    assert default_file_mode() == 0o640
    assert path.stat().st_mode & 0o777 == 0o640


def test_a_tiny_model_folder_is_readable_by_others(tiny_flux_dir: Path) -> None:
    wrong = {p.name: oct(p.stat().st_mode & 0o777) for p in tiny_flux_dir.rglob("*")
             if p.is_file() and p.stat().st_mode & 0o777 != default_file_mode()}
    assert wrong == {}


def test_the_tiny_evaluator_folders_are_readable_by_others(tiny_evaluators: dict[str, Path]) -> None:
    wrong = {str(p): oct(p.stat().st_mode & 0o777) for folder in tiny_evaluators.values() for p in folder.rglob("*")
             if p.is_file() and p.stat().st_mode & 0o777 != default_file_mode()}
    assert wrong == {}


def test_a_checkpoint_converted_for_eval_gets_the_umask_mode(tmp_path: Path, group_readable_umask) -> None:
    weights = tmp_path / "trainable_weights.safetensors"
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(4, 8),
               "transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(8, 4)}, str(weights))
    out = flux_checkpoint_as_lora(weights, {"rank": 4, "lora_alpha": 2}, tmp_path / "converted" / "step-2.safetensors")
    assert out.stat().st_mode & 0o777 == 0o640
    assert load_file(out)["transformer_blocks.0.attn.to_q.lora_B.weight"].max() == 0.5
