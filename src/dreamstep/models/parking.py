"""Frozen encoders parked off the training device while the loop runs, and the caches filled first
(the phases of a run: :mod:`dreamstep.models.phases`).

Once every caption and image of a run is encoded into the caches, the text encoders (T5-XXL alone is
9.5 GB in bf16) and the VAE have nothing to do until validation or the end of the run. They wait in CPU
memory and come back to the device only inside :meth:`ParkedModules.on_device`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from dreamstep.models.family import ModelFamily
from dreamstep.models.phases import ENCODERS, loop_encoders

# Where parked modules wait. Tests point it at the meta device, where any use of a parked module fails.
PARKING_DEVICE = torch.device("cpu")


def move(module: nn.Module, device: torch.device) -> None:
    module.to(device)


def is_on(module: nn.Module, device: torch.device) -> bool:
    """Whether ``module``'s weights are on ``device`` ("cuda" matches any CUDA device)."""
    found = next(module.parameters()).device
    return found.type == device.type and (device.index is None or found.index == device.index)


def place(module: nn.Module, device: torch.device) -> None:
    """:func:`move` ``module`` to ``device`` unless it is there already."""
    if not is_on(module, device):
        move(module, device)


class ParkedModules:
    """Modules that live on :data:`PARKING_DEVICE` except inside :meth:`on_device`."""

    def __init__(self, modules: dict[str, nn.Module], device: torch.device):
        self.modules = modules
        self.device = device

    def park(self, names: Iterable[str] | None = None) -> None:
        chosen = [self.modules[name] for name in (self.modules if names is None else names) if name in self.modules]
        for module in chosen:
            place(module, PARKING_DEVICE)
        if chosen and self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back so the loop's activations can use them

    @contextlib.contextmanager
    def on_device(self, *names: str) -> Iterator[None]:
        """Bring the named parked modules (default: all) to the training device for the block; validation images
        need only the VAE (their prompts' embeddings are cached)."""
        chosen = [name for name in (names or self.modules) if name in self.modules]
        for name in chosen:
            place(self.modules[name], self.device)
        try:
            yield
        finally:
            self.park(chosen)

    def describe(self) -> str:
        return ", ".join(self.modules) if self.modules else "none"


def park_encoders(family: ModelFamily, components: Any, device: torch.device, *, text_encoders_train: bool,
                  latents_cached: bool, t5_trains: bool = False) -> ParkedModules:
    """Move the encoders of ``components`` that the loop does not use (:func:`~dreamstep.models.phases.loop_encoders`)
    off ``device``, and bring those it uses there. Call after the "encode" phases (:func:`encode_run`), before the
    transformer / UNet loads."""
    stays = loop_encoders(family, text_encoders_train=text_encoders_train, vae_in_the_loop=not latents_cached,
                          t5_trains=t5_trains)
    encoders = ParkedModules({name: getattr(components, name) for name in _present(components)
                              if name not in stays}, device)
    encoders.park()
    for name in stays:
        place(getattr(components, name), device)
    return encoders


def hold_on_device(components: Any, device: torch.device, *names: str) -> None:
    """Of the encoders of ``components``, only ``names`` on ``device``; the others wait in host memory (moved out
    first, so that the device never holds both)."""
    for name in _present(components):
        if name not in names:
            place(getattr(components, name), PARKING_DEVICE)
    for name in _present(components):
        if name in names:
            place(getattr(components, name), device)


def _present(components: Any) -> list[str]:
    """The encoders ``components`` has (FLUX.2 has one text encoder)."""
    return [name for name in ENCODERS if getattr(components, name, None) is not None]


def free_device_memory(device: torch.device) -> None:
    """Let go of what a finished phase left on the device (class images: the whole pipeline), once the caller
    dropped its references."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fill_caches(conditioner: Any, dataset: Any, epochs: int, batch_size: int = 8) -> None:
    """Encode, before the loop, every caption (with a text cache) and every image placement (with a latent
    cache) that the run's ``epochs`` of ``dataset`` will use, so that the encoders need not be on the device
    while it trains. ``conditioner`` is a FLUX or SDXL conditioner: ``prompts(captions)``,
    ``latents(batch)`` and the two caches."""
    fill_texts(conditioner, dataset, epochs, batch_size)
    fill_latents(conditioner, dataset, epochs)


def _wanted(dataset: Any, epochs: int) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """The distinct captions of the run's ``epochs`` of ``dataset``, and each image placement's key with the
    first (index, epoch) that uses it."""
    captions: dict[str, None] = {}
    images: dict[str, tuple[int, int]] = {}
    for epoch in range(epochs):
        for index in range(len(dataset)):
            caption, image_key, conditioning_key = dataset.caption_and_keys(index, epoch)
            captions.setdefault(caption)
            for key in (image_key, conditioning_key):
                if key is not None:
                    images.setdefault(key, (index, epoch))
    return list(captions), images


def fill_texts(conditioner: Any, dataset: Any, epochs: int, batch_size: int = 8) -> None:
    """The caption half of :func:`fill_caches`."""
    texts = _wanted(dataset, epochs)[0] if conditioner.text_cache is not None else []
    for start in range(0, len(texts), batch_size):
        conditioner.prompts(texts[start:start + batch_size])


def fill_latents(conditioner: Any, dataset: Any, epochs: int) -> None:
    """The image half of :func:`fill_caches`."""
    from tqdm.auto import tqdm

    from dreamstep.data.dataset import collate

    cache = conditioner.latent_cache
    if cache is None:
        return
    images = _wanted(dataset, epochs)[1]
    missing = list(dict.fromkeys(sample for key, sample in images.items() if not cache.path(key).is_file()))
    for sample in tqdm(missing, desc="caching latents", unit="img", disable=not missing):
        batch = collate([dataset[sample]])
        conditioner.latents(batch)
        if "conditioning_keys" in batch:
            conditioner.latents(batch, prefix="conditioning_")


def encode_run(conditioner: Any, dataset: Any, held_out: Any | None, epochs: int) -> None:
    """The "encode images" and "encode text" phases (:mod:`~dreamstep.models.phases`): every cached latent, then
    every caption, of the run's ``epochs`` and of the held-out images the validation loss reads, so that nothing
    needs an encoder later. The VAE encodes while the text encoders wait in host memory, then the text encoders
    encode while it waits there; they stay on the device for the validation prompts, until
    :func:`park_encoders`."""
    parts = [(dataset, epochs)] + ([(held_out, 1)] if held_out is not None else [])
    if conditioner.latent_cache is not None:
        hold_on_device(conditioner.pipeline, conditioner.device, "vae")
        for part, part_epochs in parts:
            fill_latents(conditioner, part, part_epochs)
    hold_on_device(conditioner.pipeline, conditioner.device, "text_encoder", "text_encoder_2")
    for part, part_epochs in parts:
        fill_texts(conditioner, part, part_epochs)
