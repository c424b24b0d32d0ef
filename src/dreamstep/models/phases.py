"""The phases of a training run and which components are on the device in each, in sd-scripts' order:

1. ``encode images``: the VAE encodes every cached latent (training and held-out images) while the text
   encoders wait in host memory;
2. ``encode text``: the text encoders encode every caption, class prompt and validation (sample) prompt while the
   VAE waits in host memory. T5-XXL and the VAE's pass at full resolution are never on the device together. In
   both, the transformer / UNet is not on the device: not loaded yet, or, for an SDXL single-file checkpoint
   (read whole), waiting in host memory.
3. ``load``: the encoders wait in host memory (or are dropped) and the transformer / UNet loads into host memory
   and moves, or, for a 4-bit base that is not swapped, straight onto the device (diffusers' bitsandbytes loader
   quantizes where it loads; a swapped 4-bit base is quantized in host memory, and the swapper places its parts).
4. ``train``: the base, and only the encoders the loop itself needs (a text encoder that trains, the VAE for
   latents that are not cached).
5. ``validate``: what trains, plus the VAE when validation makes images (their prompts' embeddings were
   encoded in phase 1); the validation loss brings nothing back.

With prior preservation and class images still to make, a ``class images`` phase comes first: the class prompt is
encoded with the text encoders on the device (as in ``encode text``), which then wait in host memory while the
transformer / UNet, loaded as the run trains it (quantized, its ``--blocks_to_swap`` blocks swapped), denoises
beside the VAE (:mod:`dreamstep.models.class_images`); everything is dropped before the run's own phases.

The trainers place their modules by :func:`resident_components`, and the memory plan prices each phase by it.
"""

from __future__ import annotations

from dreamstep.models.family import ModelFamily

PHASES = ("encode images", "encode text", "load", "train", "validate")
CLASS_IMAGES = "class images"
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
ENCODERS = (*TEXT_ENCODERS, "vae")


def run_phases(class_images: bool) -> tuple[str, ...]:
    """The phases of a run, in order; ``class_images``: prior preservation with class images to generate."""
    return ((CLASS_IMAGES,) if class_images else ()) + PHASES


def loop_encoders(family: ModelFamily, *, text_encoders_train: bool, vae_in_the_loop: bool,
                  t5_trains: bool = False) -> tuple[str, ...]:
    """The encoders a training step itself runs: the family's text encoders that train
    (:meth:`~dreamstep.models.family.ModelFamily.loop_text_encoders`; ``t5_trains``: its long text encoder too,
    flux-kohya's ``train_t5xxl``); the VAE encodes in the loop when latents are not cached."""
    texts = family.loop_text_encoders(long_encoder_trains=t5_trains)
    return (texts if text_encoders_train else ()) + (("vae",) if vae_in_the_loop else ())


def resident_components(base: str, phase: str, *, in_the_loop: tuple[str, ...], validation_images: bool,
                        base_loads_on_device: bool = False) -> tuple[str, ...]:
    """The components on the device in ``phase`` (pipeline names: ``base``, the denoiser (transformer / unet),
    text_encoder, text_encoder_2, vae); ``in_the_loop`` from :func:`loop_encoders`."""
    if phase == "encode images":
        return ("vae",)
    if phase == CLASS_IMAGES:
        return (base, "vae")
    if phase == "encode text":
        return TEXT_ENCODERS
    if phase == "load":
        return (base,) if base_loads_on_device else ()
    resident = [base, *in_the_loop]
    if phase == "validate" and validation_images:
        resident.append("vae")
    return tuple(name for name in (base, *ENCODERS) if name in resident)
