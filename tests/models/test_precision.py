"""The seed-001 precision policy: frozen weights in half precision, trainable weights in fp32."""

from __future__ import annotations

import pytest
import torch

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
