"""LoRAs for generation: ``--lora FILE[:WEIGHT]`` specs, read in any format dreamstep converts (Kohya,
diffusers/PEFT, the MindSpore port's ``.ckpt``), loaded into a diffusers pipeline as named adapters with
their weights, and optionally fused into the base weights (what sd-scripts' ``sdxl_minimal_inference.py`` does).
LyCORIS files (LoKr, LoHa, DoRA, LoCon) are applied by LyCORIS' own modules, merged or on the forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dreamstep.errors import UserError
from dreamstep.lora.convert import load_lora_as_diffusers, read_lora
from dreamstep.lora.formats import model_keys, pipeline_configs
from dreamstep.lora.io import read_lora_file
from dreamstep.lora.lycoris_files import read_lycoris
from dreamstep.lora.lycoris_network import apply_lycoris, file_names, is_lycoris

_COMPONENTS = ("transformer", "unet", "text_encoder", "text_encoder_2")
_APPLIED = "_dreamstep_lycoris_modules"  # the pipeline attribute holding LyCORIS modules on the forward


@dataclass(frozen=True)
class LoraSpec:
    """One ``--lora`` value: the file and the weight its delta is scaled by."""

    path: Path
    weight: float = 1.0


def parse_lora_spec(text: str) -> LoraSpec:
    """``FILE`` or ``FILE:WEIGHT`` (FILE may also be a checkpoint or run folder: see
    :func:`~dreamstep.evaluation.candidates.lora_file_for`). A path that exists as given wins, so a file name
    with a colon (or a Windows drive letter) is never split."""
    if Path(text).expanduser().exists():
        return LoraSpec(Path(text).expanduser())
    path, sep, weight_text = text.rpartition(":")
    if not sep or not path or "/" in weight_text or "\\" in weight_text:
        raise UserError(f"--lora {text}: file not found; give an existing LoRA file, optionally as FILE:WEIGHT")
    try:
        weight = float(weight_text)
    except ValueError:
        raise UserError(f"--lora {text}: weight '{weight_text}' is not a number; write FILE:WEIGHT, "
                        "e.g. style.safetensors:0.8") from None
    if not math.isfinite(weight):
        raise UserError(f"--lora {text}: weight must be a finite number, e.g. 0.8")
    file = Path(path).expanduser()
    if not file.exists():
        raise UserError(f"--lora {text}: file {file} not found; check the path")
    return LoraSpec(file, weight)


def adapter_names(specs: list[LoraSpec]) -> list[str]:
    """One adapter name per LoRA (``lora0``, ``lora1``, ...): unique even when two files share a name."""
    return [f"lora{i}" for i in range(len(specs))]


def check_lora(path: Path, model: str) -> None:
    """Read a LoRA or LyCORIS file as generate and eval will, so a bad one is one line before the model loads."""
    if is_lycoris(read_lora_file(path).tensors):
        read_lycoris(path, model)
    else:
        read_lora(path, model)


def _apply_lycoris(pipe: Any, spec: LoraSpec, model: str, merge: bool) -> None:
    lora_file = read_lora_file(spec.path)
    components = {name: getattr(pipe, name) for name in _COMPONENTS if getattr(pipe, name, None) is not None}
    names = file_names(model_keys(model, pipeline_configs(pipe)), components)
    modules = apply_lycoris(lora_file.tensors, names, spec.weight, merge, f"--lora {spec.path}")
    on_forward = [m for m in modules if m.org_module[0].forward == m.forward]  # not merged
    setattr(pipe, _APPLIED, [*getattr(pipe, _APPLIED, []), *on_forward])


def remove_loras(pipe: Any) -> None:
    """Undo :func:`apply_loras` without merge: diffusers' adapters unloaded, LyCORIS modules off the forward."""
    for module in reversed(getattr(pipe, _APPLIED, [])):
        module.restore()
    setattr(pipe, _APPLIED, [])
    pipe.unload_lora_weights()


def apply_loras(pipe: Any, specs: list[LoraSpec], model: str, merge: bool) -> None:
    """Load every LoRA into ``pipe`` as a named adapter and activate them all with their weights; with
    ``merge``, fold them into the base weights and drop the adapters (no per-step LoRA cost). LyCORIS files
    go through LyCORIS (:func:`~dreamstep.lora.lycoris_network.apply_lycoris`)."""
    lycoris = [spec for spec in specs if is_lycoris(read_lora_file(spec.path).tensors)]
    for spec in lycoris:
        _apply_lycoris(pipe, spec, model, merge)
    specs = [spec for spec in specs if spec not in lycoris]
    if not specs:
        return
    configs = pipeline_configs(pipe)
    names = adapter_names(specs)
    for spec, name in zip(specs, names):
        state_dict, _ = load_lora_as_diffusers(spec.path, model, configs)
        try:
            pipe.load_lora_weights(state_dict, adapter_name=name)
        except (ValueError, KeyError, RuntimeError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"--lora {spec.path}: diffusers could not load it into this model ({reason}); "
                            "check that the LoRA was made for this base model") from e
    pipe.set_adapters(names, adapter_weights=[spec.weight for spec in specs])
    if merge:
        pipe.fuse_lora(adapter_names=names)
        pipe.unload_lora_weights()
