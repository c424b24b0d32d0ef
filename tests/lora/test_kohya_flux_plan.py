"""The memory plan of flux-kohya counts the parameters the run's network trains: the plan builds the run's own
network (``networks.lora_flux``'s target rules, ``--network_args`` included) on the meta-built models."""

from __future__ import annotations

from pathlib import Path

import pytest
from diffusers import FluxPipeline

from dreamstep.config.flux_network_args import FluxNetworkOptions
from dreamstep.lora.kohya_flux_network import FluxNetworkPlan
from dreamstep.models.plans import Estimator


@pytest.mark.parametrize(("args", "clip", "t5"), [
    ((), False, False),
    (("train_blocks=single",), False, False),
    (("train_double_block_indices=0", "img_attn_dim=2", "in_dims=[2,0,0,0,0]"), False, False),
    ((), True, False),
    (("train_t5xxl=True",), True, True),
])
def test_the_plan_counts_what_the_network_trains(tiny_flux_dev_dir: Path, args: tuple[str, ...], clip: bool,
                                                  t5: bool) -> None:
    options, _ = FluxNetworkOptions.from_flags(8, 4.0, None, args)
    built = FluxNetworkPlan(options, clip=clip, t5=t5)
    pipeline = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    network = built({"transformer": pipeline.transformer, "text_encoder": pipeline.text_encoder,
                     "text_encoder_2": pipeline.text_encoder_2})
    trained = sum(p.numel() for p in network.parameters() if p.requires_grad)
    estimator = Estimator("flux", str(tiny_flux_dev_dir), 8, lora_network=built)
    planned = sum(p.numel() for p in estimator.trainable.parameters() if p.requires_grad)
    assert trained > 0
    assert planned == trained
