"""LoRAs for generation: ``--lora FILE[:WEIGHT]`` specs, read in any format dreamstep converts (Kohya,
diffusers/PEFT, the MindSpore port's ``.ckpt``), loaded into a diffusers pipeline as named adapters with
their weights, and optionally fused into the base weights (what sd-scripts' ``sdxl_minimal_inference.py`` does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dreamstep.errors import UserError
from dreamstep.lora.convert import load_lora_as_diffusers
from dreamstep.lora.formats import pipeline_configs


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


def apply_loras(pipe: Any, specs: list[LoraSpec], model: str, merge: bool) -> None:
    """Load every LoRA into ``pipe`` as a named adapter and activate them all with their weights; with
    ``merge``, fold them into the base weights and drop the adapters (no per-step LoRA cost)."""
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
