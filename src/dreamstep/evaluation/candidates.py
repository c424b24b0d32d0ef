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
from dreamstep.engine.ema import chosen_weights, has_average
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
    ``step``: the training step, ``None`` when unknown; ``config_dir``: the run folder the weights come from (its
    ``config.toml``); ``source``: what the user named (``path`` may be a converted copy)."""

    label: str
    path: Path
    kind: str
    step: int | None
    config_dir: Path | None = None
    source: Path | None = None


def training_folder(run: Path, output_dir: str) -> Path:
    """The folder a run trained from, where the relative paths of its ``config.toml`` start: the run folder less
    ``output_dir`` when that is a relative path the run folder ends with, else the current folder."""
    out = Path(output_dir)
    parts = run.resolve().parts
    if out.is_absolute() or ".." in out.parts or not out.parts or parts[-len(out.parts):] != out.parts:
        return Path.cwd()
    return Path(*parts[:-len(out.parts)])


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
    finals = ("pytorch_lora_weights", "last", "pytorch_lora_weights_ema", "last_ema")
    return int(final) if isinstance(final, int) and path.stem in finals else None


def _checkpoint(folder: Path, work_dir: Path, ema: str) -> Candidate:
    step = int(_CHECKPOINT.match(folder.name).group(1))
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise UserError(f"{folder}: no {WEIGHTS_FILE}; give a checkpoint folder that a dreamstep trainer wrote")
    check_weights_file(folder)
    config = _run_config(folder.parent)
    run = folder.parent if config else None
    name = f"{folder.parent.name}_{folder.name}"
    weights, kept = _checkpoint_weights(folder, config, ema, work_dir / f"{name}_weights.safetensors")
    label = f"{folder.parent.name}/{folder.name}" + (f" ({kept})" if kept else "")
    if "num_double_layers" in config or "controlnet_weights_dtype" in config:
        return Candidate(label, weights, "controlnet-checkpoint", step, run, source=folder)
    if config.get("lora_type", "lora") != "lora":  # flux-lora's LyCORIS network: its state dict is the file
        return Candidate(label, weights, "lora", step, run, source=folder)
    if "rank" in config:  # flux-lora: peft-named LoRA weights, alpha in the run's config
        converted = flux_checkpoint_as_lora(weights, config, work_dir / f"{name}.safetensors")
        return Candidate(label, converted, "lora", step, run, source=folder)
    # sdxl-lora: the network state dict is a Kohya LoRA
    return Candidate(label, weights, "lora", step, run, source=folder)


def _checkpoint_weights(folder: Path, config: dict, ema: str, out: Path) -> tuple[Path, str | None]:
    """The checkpoint's weights file, and for a run that kept an EMA beside its weights (--ema_decay) a copy of the
    ones ``ema`` chooses, with which they are: "ema", "raw", or for "auto" the EMA when the run validated with it
    (--ema_validation, the default), so that the best step the run named is the one read."""
    weights = folder / WEIGHTS_FILE
    with safe_open(str(weights), "pt") as f:
        kept_average = has_average(f.keys())
    if not kept_average:
        if ema == "ema":
            raise UserError(f"{folder}: the run kept no EMA (it trained without --ema_decay); remove "
                            "--checkpoint_weights ema")
        return weights, None
    average = _reads_average(config, ema)
    try:
        state = chosen_weights(load_file(str(weights)), average)
    except UserError as e:
        raise UserError(f"{folder}: {e}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        save_file(state, str(tmp))
    return out, "ema" if average else "raw"


def _reads_average(config: dict, ema: str) -> bool:
    """Whether ``--checkpoint_weights ema`` picks a run's EMA over its raw weights: "ema", or "auto" for a run
    that validated with its EMA (--ema_validation, the default), so that the best step the run named is read."""
    return ema == "ema" or (ema == "auto" and config.get("ema_validation", True) is not False)


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


def _controlnet_folder(folder: Path, ema: str = "auto") -> Candidate:
    """A ``save_pretrained`` folder; a flux-controlnet run's own (its config.toml beside) names the run, and of a
    run that kept an EMA (``ema/`` beside) ``ema`` picks the weights as for its checkpoints."""
    config = _run_config(folder)
    final = config.get("max_train_steps")
    run = folder if (folder / "config.toml").is_file() else None
    path, label = folder, folder.name
    if run is not None and (folder / "ema" / CONTROLNET_WEIGHTS).is_file():
        average = _reads_average(config, ema)
        path, label = (folder / "ema", f"{label} (ema)") if average else (folder, f"{label} (raw)")
    return Candidate(label, path, "controlnet", final if isinstance(final, int) else None, run, source=folder)


def _run_folder(folder: Path, work_dir: Path, ema: str) -> list[Candidate]:
    found = [_checkpoint(c, work_dir, ema) for c in list_checkpoints(folder)]
    if (folder / CONTROLNET_WEIGHTS).is_file():
        found.append(_controlnet_folder(folder, ema))
    for file in _chosen_finals(_final_loras(folder), _run_config(folder), ema):
        found.append(Candidate(f"{folder.name}/{file.name}", file, "lora", _lora_step(file), folder))
    if not found:
        raise UserError(f"{folder}: no LoRA files, checkpoint-N folders or ControlNet weights in this folder")
    return found


def _chosen_finals(files: list[Path], config: dict, ema: str) -> list[Path]:
    """A run's final LoRA files less the twin ``ema`` does not choose, where the run saved its EMA beside its raw
    weights (``<name>_ema`` beside ``<name>``): as for its checkpoints, so the final file scored is the kind of
    weights the run validated."""
    names = {f.stem for f in files}
    twins = {f.stem[:-len("_ema")] for f in files if f.stem.endswith("_ema") and f.stem[:-len("_ema")] in names}
    if not twins:
        return files
    dropped = twins if _reads_average(config, ema) else {f"{twin}_ema" for twin in twins}
    return [f for f in files if f.stem not in dropped]


def find_candidates(paths: list[str], work_dir: Path, ema: str = "auto") -> list[Candidate]:
    """Every path as candidates, in the order given (a run folder adds its checkpoints, then its finals).
    Converted checkpoint files go to ``work_dir``; ``ema``: which weights of checkpoints kept with an EMA."""
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
            run = path.parent if (path.parent / "config.toml").is_file() else None
            found.append(Candidate(path.name, path, "lora", _lora_step(path), run))
        elif _CHECKPOINT.match(path.name):
            found.append(_checkpoint(path, work_dir, ema))
        elif (path / "config.toml").is_file():
            found += _run_folder(path, work_dir, ema)
        elif (path / CONTROLNET_WEIGHTS).is_file():
            found.append(_controlnet_folder(path))
        else:
            raise UserError(f"{path}: a folder without checkpoint weights, ControlNet weights or a run's config.toml")
    return found



def lora_file_for(path: Path, work_dir: Path, flag: str, ema: str = "auto") -> Path:
    """The LoRA file behind ``path`` for a command that reads one LoRA (``flag`` names its argument): a
    file as it is; a ``checkpoint-N`` folder's LoRA (a flux-lora checkpoint written as a LoRA file into
    ``work_dir``; ``ema``: which weights of one kept with an EMA); a run folder's final LoRA file. A folder with
    no LoRA is one error naming it."""
    if not path.is_dir():
        return path
    if _CHECKPOINT.match(path.name):
        candidate = _checkpoint(path, work_dir, ema)
        if candidate.kind == "lora":
            return candidate.path
    elif (path / "config.toml").is_file():
        finals = sorted(_final_loras(path), key=lambda f: (f.name != DIFFUSERS_FINAL,
                                                           bool(_STEP_SUFFIX.search(f.stem)), f.name))
        if finals:
            return finals[0]
    raise UserError(f"{flag} {path}: a folder without a LoRA; give a LoRA file, a checkpoint-N folder of a LoRA "
                    "run, or a LoRA run's folder")


def controlnet_source(text: str, work_dir: Path, ema: str = "auto") -> str | Candidate:
    """What ``--controlnet text`` names: a ``checkpoint-N`` folder of a flux-controlnet run as its candidate (its
    weights, written into ``work_dir`` when ``ema`` picks from an EMA, and its run), else a folder in the
    ``save_pretrained`` layout (of a run that kept an EMA, ``ema`` picks ``ema/`` or the run's own, as eval does)."""
    path = Path(text).expanduser()
    if (path / "config.toml").is_file() and (path / CONTROLNET_WEIGHTS).is_file():
        return str(_controlnet_folder(path, ema).path)
    if not (path.is_dir() and _CHECKPOINT.match(path.name) and (path / WEIGHTS_FILE).is_file()):
        return text
    candidate = _checkpoint(path, work_dir, ema)
    if candidate.kind != "controlnet-checkpoint":
        raise UserError(f"--controlnet {text}: a checkpoint of a LoRA run, not of a ControlNet; give it to --lora")
    return candidate


def _final_loras(folder: Path) -> list[Path]:
    """A run folder's own LoRA files (a Kohya or ComfyUI copy of the diffusers file left out: the same weights)."""
    return [f for f in sorted(folder.glob("*.safetensors"))
            if f.name != CONTROLNET_WEIGHTS and not f.name.endswith(("_kohya.safetensors", "_comfyui.safetensors"))]
