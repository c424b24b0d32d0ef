"""What ``dreamstep eval`` scores: LoRA files, ``checkpoint-N`` folders, ControlNet folders, and run folders
(each expanded into its checkpoints and final weights), each with the training step it holds when that
can be told (a checkpoint's name, sd-scripts' ``ss_steps`` metadata or ``-stepNNNNNNNN`` suffix, a run's
``max_train_steps``). :func:`lora_file_for` gives the commands that read one LoRA (generate, lora info,
convert) the same reading of a checkpoint or run folder."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dreamstep.config.schema import load_toml
from dreamstep.engine.checkpoint import WEIGHTS_FILE, check_weights_file, list_checkpoints
from dreamstep.errors import UserError
from dreamstep.files import atomic_path
from dreamstep.lora.io import read_lora_file, sniff_container

LORA_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".bin")
CONTROLNET_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_FINAL = "pytorch_lora_weights.safetensors"  # flux-lora's final file; sd-scripts' is --output_name
_STEP_SUFFIX = re.compile(r"-step(\d+)$")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class Candidate:
    """One set of weights to score. ``kind``: ``lora`` (a LoRA file), ``controlnet`` (a ``save_pretrained``
    folder) or ``controlnet-checkpoint`` (a checkpoint's ControlNet state dict with its run's config);
    ``step``: the training step, ``None`` when unknown; ``source``: what the user named (``path`` may be a
    converted copy)."""

    label: str
    path: Path
    kind: str
    step: int | None
    config_dir: Path | None = None
    source: Path | None = None


def _run_config(folder: Path) -> dict:
    file = folder / "config.toml"
    return load_toml(file) if file.is_file() else {}


def _lora_step(path: Path) -> int | None:
    match = _STEP_SUFFIX.search(path.stem)
    if match:
        return int(match.group(1))
    if path.suffix == ".safetensors" and sniff_container(path) == "safetensors":
        with safe_open(str(path), "pt") as f:
            steps = (f.metadata() or {}).get("ss_steps")
        if steps and steps.isdigit():
            return int(steps)
    final = _run_config(path.parent).get("max_train_steps")
    return int(final) if isinstance(final, int) and path.stem in ("pytorch_lora_weights", "last") else None


def _checkpoint(folder: Path, work_dir: Path) -> Candidate:
    step = int(_CHECKPOINT.match(folder.name).group(1))
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise UserError(f"{folder}: no {WEIGHTS_FILE}; give a checkpoint folder that a dreamstep trainer wrote")
    check_weights_file(folder)
    config = _run_config(folder.parent)
    label = f"{folder.parent.name}/{folder.name}"
    if "num_double_layers" in config or "controlnet_weights_dtype" in config:
        return Candidate(label, weights, "controlnet-checkpoint", step, folder.parent)
    if config.get("lora_type", "lora") != "lora":  # flux-lora's LyCORIS network: its state dict is the file
        return Candidate(label, weights, "lora", step)
    if "rank" in config:  # flux-lora: peft-named LoRA weights, alpha in the run's config
        converted = flux_checkpoint_as_lora(weights, config, work_dir / f"{label.replace('/', '_')}.safetensors")
        return Candidate(label, converted, "lora", step, source=folder)
    return Candidate(label, weights, "lora", step)  # sdxl-lora: the network state dict is a Kohya LoRA


def flux_checkpoint_as_lora(weights: Path, config: dict, out: Path) -> Path:
    """A flux-lora checkpoint's LoRA weights as a diffusers-layout file, with alpha/rank folded into lora_B
    (the checkpoint keeps peft's names; the run's config.toml holds rank and alpha)."""
    rank = int(config["rank"])
    alpha = float(config.get("lora_alpha", rank) or rank)
    state = load_file(str(weights))
    folded = {k: (v.float() * (alpha / rank) if ".lora_B." in k else v.float()).contiguous() for k, v in state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        save_file(folded, str(tmp))
    return out


def _controlnet_folder(folder: Path) -> Candidate:
    final = _run_config(folder).get("max_train_steps")
    return Candidate(folder.name, folder, "controlnet", final if isinstance(final, int) else None)


def _run_folder(folder: Path, work_dir: Path) -> list[Candidate]:
    found = [_checkpoint(c, work_dir) for c in list_checkpoints(folder)]
    if (folder / CONTROLNET_WEIGHTS).is_file():
        found.append(_controlnet_folder(folder))
    for file in _final_loras(folder):
        found.append(Candidate(f"{folder.name}/{file.name}", file, "lora", _lora_step(file)))
    if not found:
        raise UserError(f"{folder}: no LoRA files, checkpoint-N folders or ControlNet weights in this folder")
    return found


def find_candidates(paths: list[str], work_dir: Path) -> list[Candidate]:
    """Every path as candidates, in the order given (a run folder adds its checkpoints, then its finals).
    Converted checkpoint files go to ``work_dir``."""
    found: list[Candidate] = []
    for text in paths:
        path = Path(text).expanduser()
        if not path.exists():
            raise UserError(f"{path}: not found; give LoRA files, checkpoint-N folders, ControlNet folders or run "
                            "folders")
        if path.is_file():
            if path.suffix.lower() not in LORA_SUFFIXES:
                raise UserError(f"{path}: not a LoRA file (expected {', '.join(LORA_SUFFIXES)})")
            read_lora_file(path)  # a damaged file is one error line now, not after the base model loads
            found.append(Candidate(path.name, path, "lora", _lora_step(path)))
        elif _CHECKPOINT.match(path.name):
            found.append(_checkpoint(path, work_dir))
        elif (path / "config.toml").is_file():
            found += _run_folder(path, work_dir)
        elif (path / CONTROLNET_WEIGHTS).is_file():
            found.append(_controlnet_folder(path))
        else:
            raise UserError(f"{path}: a folder without checkpoint weights, ControlNet weights or a run's config.toml")
    return found



def lora_file_for(path: Path, work_dir: Path, flag: str) -> Path:
    """The LoRA file behind ``path`` for a command that reads one LoRA (``flag`` names its argument): a
    file as it is; a ``checkpoint-N`` folder's LoRA (a flux-lora checkpoint written as a LoRA file into
    ``work_dir``); a run folder's final LoRA file. A folder with no LoRA is one error naming it."""
    if not path.is_dir():
        return path
    if _CHECKPOINT.match(path.name):
        candidate = _checkpoint(path, work_dir)
        if candidate.kind == "lora":
            return candidate.path
    elif (path / "config.toml").is_file():
        finals = sorted(_final_loras(path), key=lambda f: (f.name != DIFFUSERS_FINAL,
                                                           bool(_STEP_SUFFIX.search(f.stem)), f.name))
        if finals:
            return finals[0]
    raise UserError(f"{flag} {path}: a folder without a LoRA; give a LoRA file, a checkpoint-N folder of a LoRA "
                    "run, or a LoRA run's folder")


def _final_loras(folder: Path) -> list[Path]:
    """A run folder's own LoRA files (a Kohya copy of the diffusers file left out: the same weights)."""
    return [f for f in sorted(folder.glob("*.safetensors"))
            if f.name != CONTROLNET_WEIGHTS and not f.name.endswith("_kohya.safetensors")]
