"""Notices of dependencies (their log records) that dreamstep hides because they tell the user nothing, or
nothing that dreamstep does not say better itself."""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator, Mapping

# Start-up and loading notices of dependencies that say nothing about the user's run, by logger.
KNOWN_NOTICES: dict[str, tuple[str, ...]] = {
    # dreamstep uses no transformers image processor, so the missing torchvision does not matter.
    "transformers.utils.import_utils": ("requires torchvision",),
    # torchao's optional GPU kernels and its enum registration, when torchao is installed at all.
    "torchao": ("Failed to load",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",
                            "Calling register_constant() on Enum subclasses is deprecated"),
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
    # bitsandbytes on a CPU with bf16 instructions looks for a kernel downloaded from the hub, then uses its own.
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
    # A LoRA for the transformer (or UNet) alone has no text-encoder keys: nothing is missing.
    "diffusers.loaders.peft": ("No LoRA keys associated to",),
    "diffusers.loaders.lora_pipeline": ("No LoRA keys associated to",),
    "diffusers.loaders.lora_base": ("No LoRA keys associated to",),
    # Offline (HF_HUB_OFFLINE), a hub id is read from the local cache; when it is not there, our error says so.
    "diffusers.pipelines.pipeline_utils": ("offline mode is enabled",),
    # from_single_file casts a loaded model to its dtype and warns even when no module is to stay fp32 ("[]").
    "diffusers.models.modeling_utils": ("that should be kept in float32: []",),
    "diffusers.loaders.single_file": ("`local_files_only` is True but no local configs were found",),
}
# The same, for notices given as Python warnings (diffusers' own modules use a deprecated import path).
KNOWN_WARNINGS = ("Importing and using `FluxPosEmbed`", "Already found a `peft_config` attribute")
# The pipelines and tokenizers warn when a text is cut to the encoder's length. For training captions, the
# run summary names each cut caption file and its token count instead, once, before training.
CAPTION_CUT: dict[str, tuple[str, ...]] = {
    "diffusers.pipelines.flux.pipeline_flux": ("The following part of your input was truncated",),
    "diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl": (
        "The following part of your input was truncated",),
    "transformers.tokenization_utils_base": ("Token indices sequence length is longer",),
}


class HideMessages(logging.Filter):
    """Drops log records whose message contains one of ``fragments``."""

    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def hide_known_notices() -> None:
    """Hide :data:`KNOWN_NOTICES` and :data:`KNOWN_WARNINGS` for the rest of the process."""
    for name, fragments in KNOWN_NOTICES.items():
        logging.getLogger(name).addFilter(HideMessages(*fragments))
    for message in KNOWN_WARNINGS:
        # warnings matches the start of a message; a fragment may stand anywhere in it
        warnings.filterwarnings("ignore", message=".*" + re.escape(message))


def hide_transformers_progress_bars() -> None:
    """transformers' own "Loading weights" and "Writing model shards" bars, one per model, nested inside
    diffusers' "Loading pipeline components" bar and our own; downloads keep huggingface_hub's bars. Imports
    transformers' logging (half a second): for the commands that load models."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


@contextlib.contextmanager
def hidden(notices: Mapping[str, tuple[str, ...]]) -> Iterator[None]:
    """Hide ``notices`` (logger name -> message fragments) inside the block."""
    filters = [(logging.getLogger(name), HideMessages(*fragments)) for name, fragments in notices.items()]
    for logger, hider in filters:
        logger.addFilter(hider)
    try:
        yield
    finally:
        for logger, hider in filters:
            logger.removeFilter(hider)
