"""sd-scripts' sample-prompt files (``--sample_prompts``): one prompt per line with its options, ``a cat --n blurry
--w 1024 --h 1024 --s 30 --l 7.5 --d 42``; '#' starts a comment line. Each trainer allows the options its sampler
has (SDXL: ``--ss`` sampler; FLUX: ``--g`` distilled guidance) and its own defaults; every line is checked before
training starts."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dreamstep.errors import UserError, did_you_mean
from dreamstep.png_text import JSON_KEY, png_info

if TYPE_CHECKING:
    from PIL import Image


@dataclass
class SamplePrompt:
    """One line of a prompt file (the defaults are SDXL's; FLUX's come with its reader)."""

    prompt: str
    negative_prompt: str = ""
    width: int = 1024
    height: int = 1024
    steps: int = 30
    scale: float = 7.5
    seed: int | None = None
    sampler: str | None = None
    guidance: float | None = None
    extra: dict[str, str] = field(default_factory=dict)


# Option letter -> (attribute, type); a trainer allows a subset.
OPTIONS = {"w": ("width", int), "h": ("height", int), "s": ("steps", int), "l": ("scale", float),
           "d": ("seed", int), "n": ("negative_prompt", str), "ss": ("sampler", str), "g": ("guidance", float)}
SDXL_OPTIONS = ("n", "w", "h", "s", "l", "d", "ss")
FLUX_OPTIONS = ("n", "w", "h", "s", "d", "l", "g")


def parse_prompt_line(line: str, where: str, defaults: dict[str, Any], allowed: tuple[str, ...]) -> SamplePrompt:
    """Parse one prompt line; ``defaults`` are the trainer's values of the options a line leaves out."""
    parts = line.split(" --")
    if not parts[0].strip() or parts[0].lstrip().startswith("--"):
        raise UserError(f"{where}: the line has no prompt before its options; write the prompt first, e.g. "
                        "'a cat --w 1024 --s 30'")
    sample = replace(SamplePrompt(prompt=parts[0].strip()), **defaults)
    for part in parts[1:]:
        match = re.match(r"(\w+)\s*(.*)$", part.strip(), re.DOTALL)
        if match is None or match.group(1) not in allowed:
            name = match.group(1) if match else part
            listed = ", ".join(f"--{o}" for o in allowed)
            raise UserError(f"{where}: unknown prompt option '--{name}'{did_you_mean(name, allowed)}; use {listed}")
        attribute, kind = OPTIONS[match.group(1)]
        try:
            value = kind(match.group(2).strip())
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise UserError(f"{where}: --{match.group(1)} '{match.group(2).strip()}' is not {what}") from None
        _check_range(match.group(1), value, where)
        setattr(sample, attribute, value)
    if sample.width % 8 or sample.height % 8:
        raise UserError(f"{where}: --w and --h must be multiples of 8 (got {sample.width}x{sample.height})")
    return sample


# The least each numeric option may be (the seed also below 2**64, as torch takes it).
_LEAST = {"w": 8, "h": 8, "s": 1, "l": 0.0, "g": 0.0, "d": 0}


def _check_range(option: str, value: Any, where: str) -> None:
    if option not in _LEAST:
        return
    if not math.isfinite(value) or value < _LEAST[option] or (option == "d" and value >= 2**64):
        least = "0 to 2**64 - 1" if option == "d" else f"at least {_LEAST[option]}, a finite number"
        raise UserError(f"{where}: --{option} {value} is out of range; give {least}")


def read_prompt_lines(path: str) -> list[tuple[str, str]]:
    """(where, line) of each prompt line of a file (``where``: file:line, for errors)."""
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
    except OSError as e:
        raise UserError(f"--sample_prompts {path}: cannot read it ({e.strerror}); check the path") from None
    except UnicodeDecodeError:
        raise UserError(f"--sample_prompts {path}: not UTF-8 text (a UTF-16 or other encoding?); save it as "
                        "UTF-8") from None
    found = [(f"{path}:{i}", line) for i, line in enumerate(lines, 1)
             if line.strip() and not line.lstrip().startswith("#")]
    if not found:
        raise UserError(f"--sample_prompts {path}: no prompts in the file")
    return found


def save_samples(images: list[Image.Image], folder: Path, name: str, global_step: int) -> list[Path]:
    """Write a trainer's sample images as sd-scripts names them (``<name>_<step>_<index>.png``), each carrying its
    parameters and the step in its PNG text; return the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate(images):
        path = folder / f"{name}_{global_step:06d}_{i:02d}.png"
        image.save(path, pnginfo=png_info({**image.info[JSON_KEY], "step": global_step}))
        paths.append(path)
    return paths
