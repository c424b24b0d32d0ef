"""Class images for prior preservation, made within the run's memory plan (the "class images" phase of
:mod:`dreamstep.models.phases`), whatever the family:

1. the class prompt is encoded once, with the text encoders on the device and the VAE in host memory (as in the
   run's "encode text" phase); the text encoders then wait in host memory;
2. the denoiser loads as the run trains it (quantized as asked; with ``--blocks_to_swap``, in host memory with the
   run's :class:`~dreamstep.models.blocks.BlockSwapper` placing its swapped blocks one at a time) and denoises from
   those embeddings beside the VAE, which decodes one image at a time;
3. the caller drops every reference and :func:`~dreamstep.models.parking.free_device_memory` runs before the run
   loads anything of its own.

The whole pipeline is never on the device at once, and nothing is held at full precision that the run itself
quantizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from dreamstep.data.images import IMAGE_EXTENSIONS
from dreamstep.files import atomic_path, check_folder_can_be_made
from dreamstep.models import parking
from dreamstep.models.blocks import BlockSwapper


def missing_class_images(class_dir: str | Path, wanted: int) -> int:
    """How many images ``class_dir`` lacks to hold ``wanted`` (0 when it holds enough). A folder still to fill
    that could not be made (a file on its path, a read-only parent) is refused here, at the door, as the
    trainers ask this before their run starts."""
    folder = Path(class_dir)
    if not folder.is_dir() and wanted > 0:
        check_folder_can_be_made(folder, "--class_data_dir")
    found = [p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS] if folder.is_dir() else []
    return max(0, wanted - len(found))


def fill_class_folder(class_dir: str | Path, wanted: int, make: Callable[[int, torch.Generator], list[Image.Image]],
                      *, batch_size: int, seed: int) -> int:
    """Fill ``class_dir`` up to ``wanted`` images, ``make(count, generator)`` making at most ``batch_size`` at a
    time (the generator seeded ``seed`` + the index of the batch's first image); return how many were made. Each
    file is written whole (temporary name, then rename)."""
    from tqdm.auto import tqdm

    folder = Path(class_dir)
    folder.mkdir(parents=True, exist_ok=True)
    missing = missing_class_images(folder, wanted)
    first = wanted - missing
    made = 0
    with tqdm(total=missing, desc="generating class images", unit="img", disable=not missing) as bar:
        while made < missing:
            count = min(batch_size, missing - made)
            for image in make(count, torch.Generator("cpu").manual_seed(seed + first + made)):
                with atomic_path(folder / f"class-{first + made:05d}.png") as partial:
                    image.save(partial, format="PNG")
                made += 1
                bar.update(1)
    return made


def make_class_images(run: Any, make: Callable[[], None]) -> None:
    """The run's "class images" phase, on any number of processes: ``make()`` fills the class folder on the main
    process while the others wait, then the device is freed (step 3 above) before the run loads its own models."""
    if run.is_main_process:
        make()
    run.accelerator.wait_for_everyone()
    parking.free_device_memory(run.device)


def encode_class_prompt(components: Any, device: torch.device, text_encoders: tuple[str, ...],
                        encode: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Step 1: ``encode()`` with only the ``text_encoders`` of ``components`` on ``device``; they (and the VAE) wait
    in host memory afterwards. Returns the embeddings ``encode`` gave."""
    parking.hold_on_device(components, device, *text_encoders)
    embeddings = encode()
    parking.hold_on_device(components, device)
    return embeddings


@contextmanager
def denoising_within_plan(components: Any, denoiser: nn.Module, device: torch.device,
                          blocks_to_swap: int, *, sd_scripts_flux: bool = False) -> Iterator[None]:
    """Step 2, for the block: ``denoiser``, loaded as the run trains it (on ``device``; in host memory when
    ``blocks_to_swap``, its swapped blocks then placed one at a time by a :class:`BlockSwapper` and the rest moved
    to ``device``), and the VAE of ``components`` on ``device``, decoding one image at a time (its slicing, left
    on: the phase's components are dropped afterwards); the text encoders wait in host memory."""
    parking.hold_on_device(components, device, "vae")
    swapper = (BlockSwapper.for_model(denoiser, blocks_to_swap, device, sd_scripts_flux=sd_scripts_flux)
               if blocks_to_swap else None)
    if hasattr(components.vae, "enable_slicing"):
        components.vae.enable_slicing()
    with torch.no_grad():
        yield
    del swapper
