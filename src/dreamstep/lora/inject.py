"""Adding LoRA adapters to the FLUX transformer and the CLIP text encoder through peft, and saving
them in the diffusers/PEFT layout that ``FluxPipeline.load_lora_weights`` reads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from peft.utils.other import get_pattern_key
from torch import nn

from dreamstep.errors import UserError
from dreamstep.lora.formats import DIFFUSERS_SUFFIXES
from dreamstep.lora.io import write_lora_file
from dreamstep.lora.layouts import LoraWeights, canonical_name, diffusers_file_contents

CLIP_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


def add_lora(model: nn.Module, targets: list[str] | tuple[str, ...], rank: int, alpha: float,
             dropout: float = 0.0) -> None:
    """Inject a gaussian-initialised LoRA (B = 0, so the model is unchanged at step 0) as adapter 'default'.

    peft's own injection, not the model's ``add_adapter``: transformers 5.24 refuses ``add_adapter`` below
    peft 0.22 (not yet released), and the result is the same layers either way. The flag set after it is
    the one both libraries' ``add_adapter`` set, so their adapter methods (scaling, unloading) see the LoRA.
    """
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, init_lora_weights="gaussian",
                        target_modules=list(targets))
    inject_adapter_in_model(config, model, adapter_name="default")
    model._hf_peft_config_loaded = True


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA weights of ``model`` in peft's naming, detached (for checkpoints)."""
    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def load_trainable_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put weights saved by :func:`trainable_state` back; every key must land."""
    result = set_peft_model_state_dict(model, state)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise UserError(f"checkpoint LoRA key '{unexpected[0]}' does not fit this model; "
                        f"resume with the same --lora_layers and --rank as the checkpoint")


class TrainableState:
    """The LoRA weights of several models as one state dict, keyed ``<name>.<peft key>`` (what checkpoints
    hold); ``None`` models are left out."""

    def __init__(self, models: dict[str, nn.Module | None]):
        self.models = {name: model for name, model in models.items() if model is not None}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{k}": v for name, model in self.models.items() for k, v in trainable_state(model).items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, model in self.models.items():
            prefix = f"{name}."
            load_trainable_state(model, {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
def lora_modules(model: nn.Module, component: str) -> dict[str, LoraWeights]:
    """The LoRA of ``model`` as diffusers-named modules ``<component>.<module>`` with each one's alpha
    (PEFT's ``lora_alpha``, or its ``alpha_pattern`` entry), detached, on the CPU."""
    config = model.peft_config["default"]
    state = get_peft_model_state_dict(model)
    down_s, up_s = DIFFUSERS_SUFFIXES
    modules = {}
    for key, down in state.items():
        if key.endswith(down_s):
            module = key.removesuffix(down_s)
            alpha = config.alpha_pattern.get(get_pattern_key(list(config.alpha_pattern), module), config.lora_alpha)
            modules[canonical_name(f"{component}.{module}", "diffusers")] = LoraWeights(
                down.detach().cpu(), state[module + up_s].detach().cpu(), float(alpha))
    return modules


def save_flux_lora(out_dir: str | Path, transformer: nn.Module, text_encoder: nn.Module | None = None,
                   weight_name: str = "pytorch_lora_weights.safetensors",
                   dtype: torch.dtype = torch.float32) -> Path:
    """Write ``out_dir/weight_name`` in the diffusers layout so that diffusers and ComfyUI apply the
    trained alpha / rank (see :func:`~dreamstep.lora.convert.diffusers_file_contents`)."""
    modules = lora_modules(transformer, "transformer")
    if text_encoder is not None:
        modules |= lora_modules(text_encoder, "text_encoder")
    modules = {k: LoraWeights(m.down.to(dtype).contiguous(), m.up.to(dtype).contiguous(), m.alpha)
               for k, m in modules.items()}
    tensors, metadata = diffusers_file_contents(modules)
    path = Path(out_dir) / weight_name
    path.parent.mkdir(parents=True, exist_ok=True)
    write_lora_file(path, tensors, metadata, "safetensors")  # atomic: a crash never leaves half a file
    return path
