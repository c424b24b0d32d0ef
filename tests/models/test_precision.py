"""The seed-001 precision policy: frozen weights in half precision, trainable weights in fp32."""

from __future__ import annotations

import pytest
import torch

from dreamstep.cli import main
from dreamstep.engine.run import configure_gpu_precision
from dreamstep.errors import UserError
from dreamstep.models.precision import (
    autocast,
    cast_trainable_params_to_fp32,
    freeze,
    weight_dtype_for,
)


def test_weight_dtype_for() -> None:
    assert weight_dtype_for("bf16") == torch.bfloat16
    assert weight_dtype_for("fp16") == torch.float16
    assert weight_dtype_for("no") == torch.float32
    with pytest.raises(UserError, match="--mixed_precision 'bf61'.*did you mean 'bf16'"):
        weight_dtype_for("bf61")


def test_frozen_half_trainable_fp32_compute_half() -> None:
    base, adapter = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(base, adapter)
    freeze(base, None)
    model.to(weight_dtype_for("bf16"))
    assert cast_trainable_params_to_fp32(model) == 2
    assert base.weight.dtype == torch.bfloat16 and not base.weight.requires_grad
    assert adapter.weight.dtype == torch.float32 and adapter.weight.requires_grad
    with autocast("cpu", "bf16"):
        out = model(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert adapter.weight.grad.dtype == torch.float32 and base.weight.grad is None


@pytest.fixture
def tf32_flags():
    """The global TF32 switches, restored after the test."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_fp32_on_a_cuda_card_uses_tf32_and_warns_when_the_card_has_bf16(tf32_flags) -> None:
    """The CUDA branch, with a stand-in for the card's bf16 capability query (no GPU here)."""
    cuda = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = False
    warning = configure_gpu_precision(cuda, "no", allow_tf32=True, bf16_supported=lambda: True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert warning.startswith("warning: training in fp32 (TF32 matmuls") and "--mixed_precision bf16" in warning
    assert "\n" not in warning
    assert configure_gpu_precision(cuda, "no", allow_tf32=True, bf16_supported=lambda: False) is None  # a T4
    assert configure_gpu_precision(cuda, "bf16", allow_tf32=True, bf16_supported=lambda: True) is None
    warning = configure_gpu_precision(cuda, "no", allow_tf32=False, bf16_supported=lambda: True)
    assert not torch.backends.cuda.matmul.allow_tf32 and "full fp32 matmuls" in warning


def test_a_cpu_run_leaves_the_matmul_precision_alone(tf32_flags) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False

    def never_asked() -> bool:
        raise AssertionError("the bf16 capability of a CUDA card was queried for a CPU run")

    assert configure_gpu_precision(torch.device("cpu"), "no", allow_tf32=True, bf16_supported=never_asked) is None
    assert not torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize("trainer", ["flux-lora", "flux-controlnet", "sdxl-lora"])
def test_help_says_what_fp32_computes_in_on_a_gpu(trainer: str, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", trainer, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--allow_tf32" in text and "TF32 tensor cores" in text and "TF32 matmuls on a GPU" in text
    assert "--logging_steps" in text
