"""The FLUX.2 memory plan: the released [klein] 4B at 1024², batch 1, rank 16 within the issue's targets
(bf16 <= 10 GiB, int8 <= 8 GiB), a [dev] folder planned with its Mistral 3 encoder, and ``plan flux2-klein`` on a
model folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import Mistral3ForConditionalGeneration, Qwen3ForCausalLM

from dreamstep.cli import main
from dreamstep.models.flux2 import published
from dreamstep.models.flux2.family import FAMILY
from dreamstep.models.memory_plan import PlanOptions
from dreamstep.models.plans import Estimator
from dreamstep.models.tiny import write_tiny_model

GIB = 2**30


@pytest.mark.parametrize(("quantization", "limit"), [("none", 10 * GIB), ("int8", 8 * GIB)])
def test_klein_4b_fits_the_issue_targets(quantization: str, limit: int) -> None:
    estimator = Estimator("flux2", None, rank=16)
    plan = estimator(PlanOptions(resolution=1024, batch_size=1, rank=16, base_quantization=quantization,
                                 text_encoder_quantization=quantization))
    assert plan.total <= limit, plan.total / GIB
    assert sum(p.numel() for p in estimator.base.parameters() if not p.requires_grad) > 3.8e9  # the 4B transformer


def test_a_dev_folder_is_planned_with_mistral(tmp_path: Path) -> None:
    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "text_encoder" / "config.json").write_text(json.dumps(published.MISTRAL_SMALL_3_1))
    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": "Flux2Pipeline", "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"]}))
    dev = FAMILY.meta_components(tmp_path)
    assert isinstance(dev["text_encoder"], Mistral3ForConditionalGeneration)
    assert dev["transformer"].config.num_single_layers == 48 and dev["transformer"].config.guidance_embeds
    assert isinstance(FAMILY.meta_components(None)["text_encoder"], Qwen3ForCausalLM)


def test_plan_reads_a_klein_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_tiny_model("flux2-klein", tmp_path / "klein")
    assert main(["plan", "flux2-klein", "--pretrained_model_name_or_path", str(folder), "--resolution", "64",
                 "--device_memory", "4GB"]) == 0
    out = capsys.readouterr().out
    assert "text_encoder (Qwen3" in out and "LoRA rank 16" in out and ": fits" in out


@pytest.mark.parametrize(("variant", "billions"), [("flux2", 32.2), ("flux2-klein", 3.9)])
def test_plan_without_a_folder_plans_the_variant_asked_for(variant: str, billions: float) -> None:
    """``plan flux2`` is [dev] (32B transformer, Mistral 3), ``plan flux2-klein`` [klein] 4B."""
    components = FAMILY.meta_components(None, variant)
    assert round(sum(p.numel() for p in components["transformer"].parameters()) / 1e9, 1) == billions
    encoder = components["text_encoder"]
    assert isinstance(encoder, Mistral3ForConditionalGeneration if variant == "flux2" else Qwen3ForCausalLM)
