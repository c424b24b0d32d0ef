"""Which layers of the Krea 2 transformer a LoRA adapts (``--lora_layers``): diffusers' script's default, presets
and module-name suffixes."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from dreamstep.errors import UserError

# "attention" is what train_dreambooth_lora_krea2.py adapts without --lora_layers (to_q, to_k, to_v, to_out.0).
_ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
KREA2_LORA_PRESETS: dict[str, tuple[str, ...] | None] = {
    "attention": _ATTENTION,
    "attention+ff": _ATTENTION + ("attn.to_gate", "ff.gate", "ff.up", "ff.down"),
    "all-linear": None,  # every nn.Linear inside the single-stream blocks
}
BLOCKS = ("transformer_blocks.",)


def krea2_lora_targets(transformer: nn.Module, layers: Sequence[str]) -> list[str]:
    """Full module names to adapt in the single-stream blocks, from one preset name or module-name suffixes."""
    if len(layers) == 1 and layers[0] in KREA2_LORA_PRESETS:
        suffixes = KREA2_LORA_PRESETS[layers[0]]
    else:
        suffixes = tuple(s.strip() for item in layers for s in item.split(",") if s.strip())
    linears = [name for name, module in transformer.named_modules()
               if isinstance(module, nn.Linear) and name.startswith(BLOCKS)]
    if suffixes is None:
        return linears
    unmatched = [s for s in suffixes if not any(n == s or n.endswith("." + s) for n in linears)]
    if unmatched:
        raise UserError(f"--lora_layers: '{unmatched[0]}' matches no linear layer of the Krea 2 transformer's blocks; "
                        f"use a preset ({', '.join(KREA2_LORA_PRESETS)}) or module names such as to_q,to_k,ff.up")
    return [name for name in linears if any(name == s or name.endswith("." + s) for s in suffixes)]
