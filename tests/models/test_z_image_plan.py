"""``plan z-image``: the released Z-Image on the meta device (6.15B transformer, Qwen3-4B, FLUX.1's VAE) planned
phase by phase with the trainer's pass, and what quantization and swapping save."""

from __future__ import annotations

import pytest
import torch

from dreamstep.cli import main
from dreamstep.models.family import get_family
from dreamstep.models.memory_plan import PlanOptions
from dreamstep.models.plans import Estimator

GIB = 2**30


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_full_size_components_on_the_meta_device() -> None:
    parts = get_family("z-image").meta_components(None)
    assert round(_count(parts["transformer"]) / 1e9, 2) == 6.15
    assert (len(parts["transformer"].layers), len(parts["transformer"].noise_refiner),
            len(parts["transformer"].context_refiner)) == (30, 2, 2)
    assert round(_count(parts["text_encoder"]) / 1e9, 2) == 4.02  # Qwen3-4B without its LM head
    assert round(_count(parts["vae"]) / 1e6) == 84
    assert all(p.device.type == "meta" for m in parts.values() for p in m.parameters())


def test_quantizing_and_swapping_lower_the_training_peak() -> None:
    estimator = Estimator("z-image", None, rank=16)
    peaks = {}
    for name, options in {
        "bf16": PlanOptions(resolution=512, rank=16),
        "int8": PlanOptions(resolution=512, rank=16, base_quantization="int8", text_encoder_quantization="int8"),
        "int8 + swap": PlanOptions(resolution=512, rank=16, base_quantization="int8",
                                   text_encoder_quantization="int8", blocks_to_swap=16),
    }.items():
        plan = estimator(options)
        peaks[name] = plan.total
    # The 6.15B transformer in bf16 is 11.5 GiB before anything else; int8 halves it.
    assert 11.5 * GIB < peaks["bf16"] < 14 * GIB
    assert peaks["int8 + swap"] < peaks["int8"] < 10 * GIB < peaks["bf16"]


@pytest.mark.parametrize("argv", [["--resolution", "512"]])
def test_plan_command_plans_z_image(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "z-image", "--device_memory", "12GB", *argv]) == 0
    out = capsys.readouterr().out
    assert "text_encoder (Qwen3) (frozen)" in out and "6.15B" in out
    assert "does NOT fit" in out and "would fit: --base_quantization" in out
