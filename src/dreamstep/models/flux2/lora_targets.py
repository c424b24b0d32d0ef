"""Which layers of the FLUX.2 transformer a LoRA adapts (``--lora_layers``): presets and module-name suffixes."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from dreamstep.errors import UserError

# diffusers' FLUX.2 scripts adapt by default the double blocks' image attention (to_q/k/v, to_out.0) and the single
# blocks' fused input (to_qkv_mlp_proj) and output (attn.to_out): "attention". (Their list names the single blocks'
# to_out for blocks 0-23, which is every block of [klein] 4B and 9B; [dev] has 48 and the preset takes all.)
_ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.to_qkv_mlp_proj", "attn.to_out")
_ATTENTION_FF = _ATTENTION + ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                              "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out")
FLUX2_LORA_PRESETS: dict[str, tuple[str, ...] | None] = {
    "attention": _ATTENTION,
    "attention+ff": _ATTENTION_FF,
    "all-linear": None,  # every nn.Linear inside the double and single blocks
}
_BLOCKS = ("transformer_blocks.", "single_transformer_blocks.")


def flux2_lora_targets(transformer: nn.Module, layers: Sequence[str]) -> list[str]:
    """Full module names to adapt, from one preset name or module-name suffixes (comma-separated items allowed),
    among the Linears inside the double and single blocks (``proj_out`` never catches the final projection)."""
    if len(layers) == 1 and layers[0] in FLUX2_LORA_PRESETS:
        suffixes = FLUX2_LORA_PRESETS[layers[0]]
    else:
        suffixes = tuple(s.strip() for item in layers for s in item.split(",") if s.strip())
    linears = [name for name, module in transformer.named_modules()
               if isinstance(module, nn.Linear) and name.startswith(_BLOCKS)]
    if suffixes is None:
        return linears
    unmatched = [s for s in suffixes if not any(n == s or n.endswith("." + s) for n in linears)]
    if unmatched:
        raise UserError(f"--lora_layers: '{unmatched[0]}' matches no linear layer of the FLUX.2 transformer; use a "
                        f"preset ({', '.join(FLUX2_LORA_PRESETS)}) or module names such as attn.to_q,ff.linear_in")
    return [name for name in linears if any(name == s or name.endswith("." + s) for s in suffixes)]
