"""Memory plans of LoRA and ControlNet runs of any family (see :mod:`dreamstep.models.memory_plan` for the method),
built from the model folder's configs on the meta device by the family's own members
(:class:`~dreamstep.models.family.ModelFamily`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any

import torch
from torch import nn

from dreamstep.config.memory import OPTIMIZER_STATE_BYTES, parse_bytes
from dreamstep.engine.logging import say_before_the_run
from dreamstep.models import memory_plan as mp
from dreamstep.models.blocks import HostCheckpointing, most_blocks_to_swap
from dreamstep.models.family import get_family
from dreamstep.models.memory_plan import Line, MemoryPlan, Phase, PlanOptions
from dreamstep.models.phases import CLASS_IMAGES, loop_encoders, resident_components, run_phases
from dreamstep.models.plan_cache import config_fingerprint, module_fingerprint, remembered
from dreamstep.models.vae import encode_posterior


def _with_lora(model: nn.Module, rank: int, targets: list[str]) -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model  # seconds to import, and a cached plan needs none

    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets), model)
    return model


# Captions are encoded this many at a time (parking.fill_caches), images one at a time.
ENCODE_BATCH = 8


def _text_encoder_pass(encoder: nn.Module, tokens: int) -> Callable[[], None]:
    def run() -> None:
        encoder(torch.zeros(ENCODE_BATCH, tokens, dtype=torch.long))

    return run


def _vae_pass(vae: nn.Module, resolution: int, decode: bool) -> Callable[[], None]:
    factor = 2 ** (len(vae.config.block_out_channels) - 1)

    def run() -> None:
        if decode:
            vae.decode(torch.empty(1, vae.config.latent_channels, resolution // factor, resolution // factor,
                                   dtype=vae.dtype))
        else:  # as the trainer encodes a batch's image: a copy of its row of the batch's fp32 pixels, cast to the
            # VAE's dtype; the posterior's fp32 mean and std
            pixels = torch.empty(1, vae.config.in_channels, resolution, resolution)
            encode_posterior(vae, pixels[[0]])

    return run


class Estimator:
    """Estimates plans of one run's models (built once on the meta device) for any :class:`PlanOptions`, phase by
    phase (:mod:`dreamstep.models.phases`): which components are on the device, what waits in host memory, and
    the peak of the pass that runs.

    ``family``: the family's name (``variant``: which of its released models to plan without a folder); what
    trains is a LoRA of ``rank`` on its denoiser (``lora_layers``: the trainer's ``--lora_layers``), or the module
    ``build_trainable(denoiser)`` returns, trained beside the frozen denoiser and labelled ``trainable_label`` in
    the plan (a ControlNet), or the adapter network ``lora_network(components)`` builds and hooks onto the
    components (the trainer's own network and target rules, e.g. flux-kohya's), held by the denoiser so its
    passes and counts include it."""

    def __init__(self, family: str, source: str | None, rank: int = 0, lora_layers: list[str] | None = None,
                 build_trainable: Callable[[nn.Module], nn.Module] | None = None, trainable_label: str = "",
                 device_type: str = "cuda", variant: str | None = None,
                 lora_network: Callable[[dict[str, nn.Module]], nn.Module] | None = None):
        self.family = get_family(family)
        self.device_type = device_type  # whose autocast policy the passes follow
        self.labels = self.family.component_labels
        self.base_name = self.family.denoiser
        self._folder, self._variant = mp.model_folder(source), variant
        self._rank, self._lora_layers = rank, list(lora_layers or [])
        self._build_trainable, self._lora_network = build_trainable, lora_network
        self.trainable_label = trainable_label if build_trainable is not None else f"LoRA rank {rank}"
        if build_trainable is None and lora_network is None:
            # A LoRA's modules follow from the configs, the rank and the layers: a plan read back from the cache
            # builds nothing.
            self.fingerprint = config_fingerprint(self._folder, self.family.name, variant, rank, self._lora_layers)
        else:
            self.fingerprint = module_fingerprint({**self.components, "trainable": self.trainable})

    @cached_property
    def _built(self) -> tuple[dict[str, nn.Module], nn.Module]:
        """Every component and what trains, on the meta device; built only when a figure is not in the cache."""
        components = self.family.meta_components(self._folder, self._variant)
        for module in components.values():
            module.requires_grad_(False)
        base = components[self.base_name]
        if self._build_trainable is not None:
            with torch.device("meta"), mp.default_dtype(torch.float32):
                return components, self._build_trainable(base)
        if self._lora_network is not None:
            with torch.device("meta"), mp.default_dtype(torch.float32):
                base.add_module("lora_network", self._lora_network(components))
            return components, base
        trainable = _with_lora(base, self._rank, self.family.lora_targets(base, self._lora_layers))
        for param in trainable.parameters():  # trainable weights are fp32 (models/precision.py)
            if param.requires_grad:
                param.data = param.data.float()
        return components, trainable

    @property
    def components(self) -> dict[str, nn.Module]:
        return self._built[0]

    @property
    def base(self) -> nn.Module:
        return self.components[self.base_name]

    @property
    def trainable(self) -> nn.Module:
        return self._built[1]

    def _remembered(self, what: str, arguments: tuple, measure: Callable[[], tuple[int, ...]]) -> tuple[int, ...]:
        return remembered(self.fingerprint, what, arguments, measure)

    def _quantized(self, mode: str) -> dict[nn.Parameter, str]:
        if mode == "none":
            return {}
        return {m.weight: mode for m in self.base.modules()
                if isinstance(m, nn.Linear) and not m.weight.requires_grad}

    def activations(self, resolution: int, batch: int, checkpointing: bool, text_tokens: int,
                    quantization: str = "none", half: torch.dtype | None = torch.bfloat16, train: bool = True,
                    image_token_multiplier: int = 1) -> int:
        """Peak bytes of one training step's pass (``train``: inputs, activations, gradients) or one inference
        forward of the transformer / UNet, with the trainer's dtypes."""
        return self.offloaded_pass(resolution, batch, checkpointing, False, text_tokens, quantization, half, train,
                                   image_token_multiplier)[0]

    @lru_cache(maxsize=16)
    def offloaded_pass(self, resolution: int, batch: int, checkpointing: bool, offload: bool, text_tokens: int,
                       quantization: str = "none", half: torch.dtype | None = torch.bfloat16, train: bool = True,
                       image_token_multiplier: int = 1) -> tuple[int, int]:
        """:meth:`activations`, with the checkpointed blocks' inputs in host memory when ``offload``
        (``--cpu_offload_checkpointing``): (peak device bytes, bytes of those inputs in host memory)."""
        arguments = (resolution, batch, checkpointing, offload, text_tokens, quantization, str(half), train,
                     image_token_multiplier, self.device_type)
        peak, host_bytes = self._remembered("training pass", arguments, lambda: self._measure_pass(
            resolution, batch, checkpointing, offload, text_tokens, quantization, half, train, image_token_multiplier))
        return peak, host_bytes

    def _measure_pass(self, resolution: int, batch: int, checkpointing: bool, offload: bool, text_tokens: int,
                      quantization: str, half: torch.dtype | None, train: bool,
                      image_token_multiplier: int) -> tuple[int, int]:
        models = [self.base] if self.trainable is self.base else [self.trainable, self.base]
        for param in self.base.parameters():  # frozen weights in the run's dtype (free on the meta device)
            if not param.requires_grad:
                param.data = param.data.to(half or torch.float32)
        host = HostCheckpointing(pinned=False)
        for model in models:
            if checkpointing:
                model.enable_gradient_checkpointing(**({"gradient_checkpointing_func": host} if offload else {}))
            else:
                model.disable_gradient_checkpointing()
            model.train(train)
        step = self.family.training_pass(self.base, resolution=resolution, batch=batch, text_tokens=text_tokens,
                                         train=train, image_token_multiplier=image_token_multiplier,
                                         trainable=self.trainable if self.trainable is not self.base else None)
        grad = torch.enable_grad() if train else torch.no_grad()
        with torch.device("meta"), grad:
            peak = mp.pass_peak(nn.ModuleList(models), step, autocast=half, device_type=self.device_type,
                                quantized=self._quantized(quantization))
        return peak, host.host_bytes

    @lru_cache(maxsize=16)
    def encoder_pass(self, name: str, resolution: int, text_tokens: int, decode: bool = False) -> int:
        """Peak bytes of encoding a batch of captions with text encoder ``name``, or one image with the VAE
        (``decode``: decoding one)."""
        def measure() -> tuple[int]:
            module = self.components[name]
            if name == "vae":
                run = _vae_pass(module, resolution, decode)
            else:
                run = _text_encoder_pass(module, text_tokens if name == self.family.long_text_encoder else 77)
            with torch.device("meta"), torch.no_grad():
                return (mp.pass_peak(module, run, autocast=None, device_type=self.device_type),)

        arguments = (name, resolution, text_tokens, decode, self.device_type)
        return self._remembered("encoder pass", arguments, measure)[0]

    def _weights(self, name: str, options: PlanOptions) -> Line:
        dtype_bytes = torch.finfo(options.weight_dtype).bits // 8
        if name == self.base_name:
            quant = options.base_quantization
        else:
            quant = options.text_encoder_quantization if name == self.family.long_text_encoder else "none"

        def count() -> tuple[int, int]:
            module = self.components[name]
            return (sum(p.numel() for p in module.parameters() if not p.requires_grad),
                    mp.weight_bytes(module, quant, dtype_bytes, frozen_only=True))

        frozen, nbytes = self._remembered("weights", (name, quant, dtype_bytes), count)
        return Line(f"{self.labels[name]} (frozen)", frozen, _label(quant, mp.dtype_name(options.weight_dtype)),
                    nbytes)

    def _base_lines(self, options: PlanOptions) -> tuple[list[Line], list[Line]]:
        """The frozen base's weights on the device and, with swapping, in host memory."""
        device = [self._weights(self.base_name, options)]
        if not options.blocks_to_swap:
            return device, []
        quant = options.base_quantization
        dtype_bytes = torch.finfo(options.weight_dtype).bits // 8

        def sizes() -> tuple[int, int, int]:
            swapped, resident = mp.swapped_blocks(self.base, options)
            # nf4's absmax is kept with the block's quantization state on the device.
            plain = quant if quant != "nf4" else "nf4-packed"
            return len(swapped), *(sum(mp.weight_bytes(b, plain, dtype_bytes, frozen_only=True) for b in blocks)
                                   for blocks in (swapped, resident))

        count, swapped, resident = self._remembered(
            "swapped blocks", (quant, dtype_bytes, options.blocks_to_swap, options.sd_scripts_swap), sizes)
        device.append(Line(f"  {count} blocks swapped out (2 of them on the device at a time)", 0, "",
                           resident - swapped))
        return device, [Line(f"{count} swapped blocks of the {self.base_name}", 0, _label(
            quant, mp.dtype_name(options.weight_dtype)), swapped)]

    def most_blocks_to_swap(self, sd_scripts_flux: bool) -> int:
        """:func:`~dreamstep.models.blocks.most_blocks_to_swap` of the base."""
        return self._remembered("most blocks to swap", (sd_scripts_flux,), lambda: (
            most_blocks_to_swap(self.base, sd_scripts_flux=sd_scripts_flux),))[0]

    def _trainable_lines(self, options: PlanOptions) -> list[Line]:
        trained = self._remembered("trainable", (), lambda: (
            sum(p.numel() for p in self.trainable.parameters() if p.requires_grad),))[0]
        state = OPTIMIZER_STATE_BYTES.get(options.optimizer, OPTIMIZER_STATE_BYTES["AdamW"])
        return [Line(f"{self.trainable_label}: fp32 weights + {options.optimizer} state", trained, "fp32",
                     trained * (4 + state))]

    def _phase(self, phase: str, options: PlanOptions, base: tuple[list[Line], list[Line]]) -> Phase:
        in_the_loop = loop_encoders(self.family, text_encoders_train=options.encoders_on_device,
                                    vae_in_the_loop=options.encoders_on_device, t5_trains=options.t5_trains)
        resident = resident_components(self.base_name, phase, in_the_loop=in_the_loop,
                                       validation_images=options.validation_images,
                                       base_loads_on_device=options.base_quantization == "nf4"
                                       and not options.blocks_to_swap)
        half = None if options.weight_dtype == torch.float32 else options.weight_dtype
        encoders = [name for name in self.labels if name != self.base_name]
        device = [self._weights(name, options) for name in encoders if name in resident]
        host = [self._weights(name, options) for name in encoders if name not in resident]
        resolution, tokens = options.resolution, options.max_sequence_length
        if phase.startswith("encode"):
            passes = {f"encoding with {self.labels[n]}": self.encoder_pass(n, resolution, tokens)
                      for n in encoders if n in resident}
            name, peak = max(passes.items(), key=lambda item: item[1])
            return Phase(phase, resident, device + [Line(f"the largest pass: {name}", 0, "", peak)], host)
        if phase == CLASS_IMAGES:
            return self._class_images_phase(options, base, device, host, half)
        if phase == "load":
            # The base loads into host memory and then moves, except a 4-bit base that is not swapped: diffusers'
            # bitsandbytes loader quantizes it on the device.
            whole = self._weights(self.base_name, options)
            return (Phase(phase, resident, [whole], host) if self.base_name in resident else
                    Phase(phase, resident, [], host + [whole]))
        base_device, base_host = base
        device = base_device + self._trainable_lines(options) + device
        host = host + base_host
        if phase == "train":
            checkpointing = "with" if options.gradient_checkpointing else "without"
            offload = options.gradient_checkpointing and options.cpu_offload_checkpointing
            peak, offloaded = self.offloaded_pass(resolution, options.batch_size, options.gradient_checkpointing,
                                                  offload, tokens, options.base_quantization, half,
                                                  image_token_multiplier=options.image_token_multiplier)
            device.append(Line(f"training pass: {resolution}px, batch {options.batch_size}, {checkpointing} "
                               "checkpointing (activations, gradients)", 0, "", peak))
            if offload:
                host = host + [Line("checkpointed block inputs (--cpu_offload_checkpointing)", 0, "", offloaded)]
            return Phase(phase, resident, device, host)
        passes = {f"{self.base_name} forward at {resolution}px": self.activations(
            resolution, 1, False, tokens, options.base_quantization, half, train=False,
            image_token_multiplier=options.image_token_multiplier)}
        if options.validation_images:
            passes[f"VAE decode at {resolution}px"] = self.encoder_pass("vae", resolution, tokens, decode=True)
        name, peak = max(passes.items(), key=lambda item: item[1])
        return Phase(phase, resident, device + [Line(f"the largest pass: {name}", 0, "", peak)], host)

    def _class_images_phase(self, options: PlanOptions, base: tuple[list[Line], list[Line]], vae: list[Line],
                            encoders: list[Line], half: torch.dtype | None) -> Phase:
        """The base as the run loads it (quantized, swapped) and the VAE on the device, the text encoders in host
        memory (the class prompt was encoded first, as in "encode text"), and the larger of the base's inference
        forward over the pipeline's batch and the VAE's decode, one image at a time (its slicing)."""
        batch, resolution = options.class_images_batch, options.resolution
        base_device, base_host = base
        passes = {f"{self.base_name} forward at {resolution}px, batch {batch}": self.activations(
            resolution, batch, False, options.max_sequence_length, options.base_quantization, half, train=False,
            image_token_multiplier=options.image_token_multiplier),
            f"VAE decode at {resolution}px, one image at a time": self.encoder_pass(
                "vae", resolution, options.max_sequence_length, decode=True)}
        name, peak = max(passes.items(), key=lambda item: item[1])
        return Phase(CLASS_IMAGES, (self.base_name, "vae"),
                     base_device + vae + [Line(f"the largest pass: {name}", 0, "", peak)], encoders + base_host)

    def __call__(self, options: PlanOptions) -> MemoryPlan:
        base = self._base_lines(options)
        return MemoryPlan(options, [self._phase(phase, options, base)
                                    for phase in run_phases(options.class_images_batch > 0)])


def _label(quant: str, dtype: str) -> str:
    return dtype if quant == "none" else quant


def plan_report(estimator: Estimator, options: PlanOptions, device_memory: int | None,
                measured: int | None = None) -> str:
    """The plan's table, and for a card it does not fit on, the option changes that would make it fit."""
    plan = estimator(options)
    text = mp.format_plan(plan, device_memory, measured)
    if device_memory is not None and not mp.fits(plan, device_memory):
        if options.class_images_batch > 1 and plan.phase(CLASS_IMAGES).device_total == plan.total:
            text += ("\n  the class images are the busiest phase: fewer at a time (--sample_batch_size) need less; "
                     "one at a time: " + mp._size(estimator(replace(options, class_images_batch=1)).phase(
                         CLASS_IMAGES).device_total).strip())
        text += "\n" + mp.suggestion_lines(options_that_fit(estimator, options, device_memory))
    return text


def options_that_fit(estimator: Estimator, options: PlanOptions, device_memory: int) -> list[tuple[str, MemoryPlan]]:
    """:func:`~dreamstep.models.memory_plan.options_that_fit` for ``estimator``'s model on this machine."""
    return mp.options_that_fit(estimator, options, device_memory,
                               max_blocks=estimator.most_blocks_to_swap(options.sd_scripts_swap),
                               cuda=torch.cuda.is_available(),
                               has_long_text_encoder=estimator.family.long_text_encoder is not None,
                               can_offload_checkpointing=estimator.family.long_text_encoder is not None)


@dataclass(frozen=True)
class RunPlan:
    """What a trainer plans its run with (its recipe's ``plan_inputs``; the dashboard plans a job with the same):
    the family, the base whose configs are read (``None``: a base of component files alone, planned from the
    published configs), the options, and what trains (:class:`Estimator`'s keyword arguments)."""

    family: str
    source: str | None
    options: PlanOptions
    trains: dict[str, Any] = field(default_factory=dict)

    def check_source(self) -> None:
        """The base must be a pipeline of the family (one line naming it, before anything is built)."""
        from dreamstep.models.sources import check_pipeline_source

        if self.source is not None:
            check_pipeline_source(self.source, self.family)

    def estimator(self) -> Estimator:
        return Estimator(self.family, self.source, self.options.rank, **self.trains)


def print_run_plan(run_plan: RunPlan, device_memory: str | None) -> None:
    """Print a training run's plan before its models load (``device_memory`` as the user wrote it, or
    ``None`` to detect the card). The run's ``train.log`` gets it too."""
    run_plan.check_source()
    memory = parse_bytes(device_memory, "--device_memory") if device_memory else mp.detected_device_memory()
    options = run_plan.options
    estimator = run_plan.estimator()
    say_before_the_run(plan_report(estimator, options, memory))
