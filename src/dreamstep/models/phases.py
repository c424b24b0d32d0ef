"""The phases of a training run and which components are on the device in each, in sd-scripts' order:

1. ``encode``: the text encoders and the VAE encode every caption, class prompt, validation (sample) prompt and
   cached latent while the transformer / UNet is not on the device: not loaded yet, or, for an SDXL single-file
   checkpoint (read whole), waiting in host memory.
2. ``load``: the encoders wait in host memory (or are dropped) and the transformer / UNet loads. diffusers'
   bitsandbytes loader puts a 4-bit base on the device whole (an SDXL single file's already while it encodes);
   other bases load into host memory first.
3. ``train``: the base, and only the encoders the loop itself needs (a text encoder that trains, the VAE for
   latents that are not cached).
4. ``validate``: what trains, plus the VAE when validation makes images (their prompts' embeddings were
   encoded in phase 1); the validation loss brings nothing back.

The trainers place their modules by :func:`resident_components`, and the memory plan prices each phase by it.
"""

from __future__ import annotations

PHASES = ("encode", "load", "train", "validate")
ENCODERS = ("text_encoder", "text_encoder_2", "vae")


def base_name(family: str) -> str:
    return "unet" if family == "sdxl" else "transformer"


def loop_encoders(family: str, *, text_encoders_train: bool, vae_in_the_loop: bool) -> tuple[str, ...]:
    """The encoders a training step itself runs: FLUX trains only CLIP (T5's outputs are always cached), SDXL
    both of its text encoders; the VAE encodes in the loop when latents are not cached."""
    texts = ("text_encoder",) if family != "sdxl" else ("text_encoder", "text_encoder_2")
    return (texts if text_encoders_train else ()) + (("vae",) if vae_in_the_loop else ())


def resident_components(family: str, phase: str, *, in_the_loop: tuple[str, ...], validation_images: bool,
                        base_loads_on_device: bool = False) -> tuple[str, ...]:
    """The components on the device in ``phase`` (pipeline names: transformer / unet, text_encoder,
    text_encoder_2, vae); ``in_the_loop`` from :func:`loop_encoders`."""
    base = base_name(family)
    if phase == "encode":
        return ENCODERS
    if phase == "load":
        return (base,) if base_loads_on_device else ()
    resident = [base, *in_the_loop]
    if phase == "validate" and validation_images:
        resident.append("vae")
    return tuple(name for name in (base, *ENCODERS) if name in resident)
