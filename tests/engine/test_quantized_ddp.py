"""DDP over a frozen quantized base (``--base_quantization int8|fp8``, torchao) under two processes (gloo, CPU):
``accelerator.prepare`` wraps it, and the LoRA's gradients are averaged across the processes."""

from __future__ import annotations

from pathlib import Path

import torch
from launch_testkit import accelerate_launch

WORKER = Path(__file__).with_name("quantized_ddp_worker.py")


def test_two_processes_train_a_lora_on_each_base(tmp_path: Path) -> None:
    out = tmp_path / "result.pt"
    accelerate_launch(WORKER, out, "none", "int8", "fp8", hf_home=tmp_path / "hf", timeout=240)
    result = torch.load(out, weights_only=True)
    assert sorted(result) == ["fp8", "int8", "none"]
    for mode, lora in result.items():
        # Each process stepped on its own batch: the same weights after the step mean the gradients were averaged.
        assert lora.shape[0] == 2 and torch.equal(lora[0], lora[1]), mode
