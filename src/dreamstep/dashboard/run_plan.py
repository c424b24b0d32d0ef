"""The memory plan of a job before it is queued, as its trainer will print it before loading: the same plan
inputs its recipe gives :func:`~dreamstep.models.plans.print_run_plan`, estimated on the meta device from the
run's own base (a local model folder's configs, a tiny model's included; the published configs for a hub id),
for ``--device_memory`` or the card this machine has; and, where it does not fit, the options that would.
No model weights are read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from dreamstep.config.memory import parse_bytes

__all__ = ["job_plan"]

_LOCK = threading.Lock()  # an estimator moves its meta modules between dtypes and modes: one plan at a time
_ESTIMATORS: OrderedDict[tuple, Any] = OrderedDict()


def plan_inputs(trainer: str, config: Any, check: Any) -> tuple[str, str | None, Any, dict[str, Any]]:
    """(arch, base source, PlanOptions, Estimator options) of ``train TRAINER`` with ``config``, as its recipe
    plans the run; ``check``: the dataset check of its data (a :class:`~dreamstep.dashboard.dataset_check.DatasetCheck`:
    the trainer's datasets, and its BucketDataset, which says whether the loop encodes random crops)."""
    from dreamstep.models import flux
    from dreamstep.models.loading import check_pipeline_source

    datasets, encodes = check.configs, check.dataset is not None and check.dataset.encodes_in_the_loop()
    if trainer == "sdxl-lora":
        from dreamstep.models import sdxl

        text_in_the_loop = not config.network_train_unet_only or not config.cache_text_encoder_outputs
        source = sdxl.config_source(config.pretrained_model_name_or_path, config.model_config)
        check_pipeline_source(source, "sdxl")
        return "sdxl", source, sdxl.plan_options(
            config, datasets, encoders_on_device=text_in_the_loop or not config.cache_latents or encodes,
            validation_images=bool(config.sample_prompts)), {}
    source = config.flux_base().source
    if source is not None:
        check_pipeline_source(source, "flux")
    if trainer == "flux-kohya":
        guidance_embeds = flux.transformer_config(config)["guidance_embeds"]  # the files' own config
        options = flux.kohya_plan_options(
            config, datasets, max_sequence_length=config.max_sequence_length(guidance_embeds),
            validation_images=bool(config.sample_prompts),
            encoders_on_device=config.train_clip or not config.cache_latents or encodes)
        return "flux", source, options, {"lora_layers": ["all-linear"]}
    if trainer == "flux-controlnet":
        options = flux.plan_options(config, rank=0, encoders_on_device=not config.cache_latents or encodes,
                                    validation_images=bool(config.validation_pairs()))
        return "flux-controlnet", source, options, {
            "controlnet_layers": (config.num_double_layers, config.num_single_layers)}
    if trainer == "flux-kontext-lora":
        paired = datasets[0].method == "controlnet"  # the condition's tokens beside the target's
        options = flux.plan_options(config, rank=config.rank, encoders_on_device=not config.cache_latents or encodes,
                                    validation_images=bool(config.validation_prompt),
                                    image_token_multiplier=2 if paired else 1)
        return "flux", source, options, {"lora_layers": config.lora_layers}
    options = flux.plan_options(config, rank=config.rank,
                                encoders_on_device=config.train_text_encoder or not config.cache_latents or encodes,
                                validation_images=bool(config.validation_prompt))
    return "flux", source, options, {"lora_layers": config.lora_layers}


def _estimator(arch: str, source: str | None, rank: int, **options: Any) -> Any:
    """The estimator of a base (its models built once on the meta device), the last few kept."""
    from dreamstep.models.plans import Estimator

    key = (arch, source, rank, repr(sorted(options.items())))
    if key not in _ESTIMATORS:
        _ESTIMATORS[key] = Estimator(arch, source, rank, **options)
        while len(_ESTIMATORS) > 4:
            _ESTIMATORS.popitem(last=False)
    _ESTIMATORS.move_to_end(key)
    return _ESTIMATORS[key]


def job_plan(trainer: str, config: Any, check: Any) -> dict[str, Any]:
    """The plan of a job as JSON (``check``: the dataset check of its data): the trainer's plan text, the peaks,
    the card and whether it fits, and the changes that would make it fit. A mistake in the options raises the
    trainer's UserError."""
    from dreamstep.errors import UserError
    from dreamstep.models import memory_plan as mp
    from dreamstep.models.plans import options_that_fit

    arch, source, options, extra = plan_inputs(trainer, config, check)
    memory, card = _card(config.device_memory)
    with _LOCK:
        estimator = _estimator(arch, source, options.rank, **extra)
        if not 0 <= options.blocks_to_swap < len(estimator.blocks):
            raise UserError(f"--blocks_to_swap {options.blocks_to_swap}: the model has {len(estimator.blocks)} "
                            f"blocks; choose 0 to {len(estimator.blocks) - 1}")
        plan = estimator(options)
        fits = None if memory is None else mp.fits(plan, memory)
        found = options_that_fit(estimator, options, memory) if fits is False else []
    text = mp.format_plan(plan, memory) + ("\n" + mp.suggestion_lines(found) if fits is False else "")
    busiest = max(plan.phases, key=lambda phase: phase.device_total)
    return {"base": source or "the published FLUX.1-dev configs", "card": card, "device_memory": memory,
            "peak": plan.total, "peak_phase": busiest.name, "host_peak": plan.host_total, "fits": fits,
            "would_fit": [{"flags": flags, "peak": p.total} for flags, p in found], "report": text}


def _card(device_memory: str | None) -> tuple[int | None, str]:
    """The memory the plan is checked against and the card it belongs to, in words."""
    from dreamstep.models.memory_plan import detected_device_memory

    if device_memory:
        return parse_bytes(device_memory, "--device_memory"), f"--device_memory {device_memory}"
    memory = detected_device_memory()
    if memory is None:
        return None, "no CUDA card found on this machine: give --device_memory (e.g. 12GB) to check a card"
    import torch

    return memory, f"{torch.cuda.get_device_name()} (detected)"
