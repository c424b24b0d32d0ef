"""Which layers of the Z-Image transformer a LoRA adapts (``--lora_layers``): diffusers' script's default, presets
and module-name suffixes."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from dreamstep.errors import UserError

# Module-name suffixes per preset, matched against the Linear layers of the main blocks and the refiners.
# "attention" is what train_dreambooth_lora_z_image.py adapts without --lora_layers (to_q, to_k, to_v, to_out.0).
_ATTENTION = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")
Z_IMAGE_LORA_PRESETS: dict[str, tuple[str, ...] | None] = {
    "attention": _ATTENTION,
    "attention+ff": _ATTENTION + ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),
    "all-linear": None,  # every nn.Linear inside the blocks, the modulation included
}
BLOCKS = ("layers.", "noise_refiner.", "context_refiner.")


def z_image_lora_targets(transformer: nn.Module, layers: Sequence[str]) -> list[str]:
    """Full module names to adapt, from one preset name or module-name suffixes (``to_q``, ``attention.to_k``,
    comma-separated as the script's ``--lora_layers``), inside the blocks only."""
    if len(layers) == 1 and layers[0] in Z_IMAGE_LORA_PRESETS:
        suffixes = Z_IMAGE_LORA_PRESETS[layers[0]]
    else:
        suffixes = tuple(s.strip() for item in layers for s in item.split(",") if s.strip())
    linears = [name for name, module in transformer.named_modules()
               if isinstance(module, nn.Linear) and name.startswith(BLOCKS)]
    if suffixes is None:
        return linears
    unmatched = [s for s in suffixes if not any(n == s or n.endswith("." + s) for n in linears)]
    if unmatched:
        raise UserError(f"--lora_layers: '{unmatched[0]}' matches no linear layer of the Z-Image transformer; use "
                        f"a preset ({', '.join(Z_IMAGE_LORA_PRESETS)}) or module names such as "
                        "to_q,to_k,to_v,to_out.0,feed_forward.w1")
    return [name for name in linears if any(name == s or name.endswith("." + s) for s in suffixes)]
