"""Which layers of the FLUX.1 transformer a LoRA adapts (``--lora_layers``): presets and module-name suffixes."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from dreamstep.errors import UserError

# Module-name suffixes per preset, matched against the transformer blocks' nn.Linear layers.
# "attention" is the set diffusers' first FLUX DreamBooth LoRA script adapted (to_q/k/v, to_out.0); "attention+ff"
# the wider set its later versions adapt by default.
_ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
_ATTENTION_FF = _ATTENTION + (
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    "proj_mlp", "proj_out",
)
FLUX_LORA_PRESETS: dict[str, tuple[str, ...] | None] = {
    "attention": _ATTENTION,
    "attention+ff": _ATTENTION_FF,
    "all-linear": None,  # every nn.Linear inside the double and single blocks, modulation included
}
_FLUX_BLOCKS = ("transformer_blocks.", "single_transformer_blocks.")


def flux_lora_targets(transformer: nn.Module, layers: Sequence[str]) -> list[str]:
    """Full module names to adapt, from one preset name or a list of module-name suffixes.

    Only layers inside the double and single blocks are considered, so a suffix like ``proj_out``
    never catches the final output projection.
    """
    if len(layers) == 1 and layers[0] in FLUX_LORA_PRESETS:
        suffixes = FLUX_LORA_PRESETS[layers[0]]
    else:
        suffixes = tuple(s for item in layers for s in item.split(",") if s)
    linears = [name for name, module in transformer.named_modules()
               if isinstance(module, nn.Linear) and name.startswith(_FLUX_BLOCKS)]
    if suffixes is None:
        return linears
    chosen = [name for name in linears if any(name == s or name.endswith("." + s) for s in suffixes)]
    unmatched = [s for s in suffixes if not any(n == s or n.endswith("." + s) for n in linears)]
    if unmatched:
        presets = ", ".join(FLUX_LORA_PRESETS)
        raise UserError(f"--lora_layers: '{unmatched[0]}' matches no linear layer of the FLUX transformer; "
                        f"use a preset ({presets}) or module names such as attn.to_q,ff.net.2")
    return chosen
