"""Which layers of the Qwen-Image transformer a LoRA adapts (``--lora_layers``): presets and module-name suffixes."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from dreamstep.errors import UserError

# "attention" is what diffusers' train_dreambooth_lora_qwen_image.py adapts by default (to_k, to_q, to_v,
# to_out.0); "attention+ff" adds the text stream's projections and both streams' MLPs.
_ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
_ATTENTION_FF = _ATTENTION + (
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
)
QWEN_IMAGE_LORA_PRESETS: dict[str, tuple[str, ...] | None] = {
    "attention": _ATTENTION,
    "attention+ff": _ATTENTION_FF,
    "all-linear": None,  # every nn.Linear inside the blocks, the modulation (img_mod.1, txt_mod.1) included
}


def qwen_image_lora_targets(transformer: nn.Module, layers: Sequence[str]) -> list[str]:
    """Full module names to adapt, from one preset name or a list of module-name suffixes (the script's
    comma-separated ``--lora_layers to_k,to_q,to_v``), among the linear layers of ``transformer_blocks``."""
    if len(layers) == 1 and layers[0] in QWEN_IMAGE_LORA_PRESETS:
        suffixes = QWEN_IMAGE_LORA_PRESETS[layers[0]]
    else:
        suffixes = tuple(s.strip() for item in layers for s in item.split(",") if s.strip())
    linears = [name for name, module in transformer.named_modules()
               if isinstance(module, nn.Linear) and name.startswith("transformer_blocks.")]
    if suffixes is None:
        return linears
    unmatched = [s for s in suffixes if not any(n == s or n.endswith("." + s) for n in linears)]
    if unmatched:
        raise UserError(f"--lora_layers: '{unmatched[0]}' matches no linear layer of the Qwen-Image transformer; "
                        f"use a preset ({', '.join(QWEN_IMAGE_LORA_PRESETS)}) or module names such as "
                        "to_q,to_k,to_v,to_out.0,img_mlp.net.2")
    return [name for name in linears if any(name == s or name.endswith("." + s) for s in suffixes)]
