"""The text chunks of the PNGs dreamstep writes (generated images, training sample grids): ``parameters`` in
AUTOMATIC1111's layout (read by A1111, ComfyUI, Civitai and most image viewers) and ``dreamstep`` as JSON (every
setting, machine-readable). Kept below the packages that write PNGs (generation, models, engine) so each
imports it from beneath.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PIL import Image
from PIL.PngImagePlugin import PngInfo

PARAMETERS_KEY = "parameters"
JSON_KEY = "dreamstep"


def _a1111_value(value: Any) -> str:
    """A1111 quotes a value that holds its separators (``,`` ``:`` ``"``) as a JSON string."""
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ',:"') else text


def a1111_parameters(params: dict[str, Any]) -> str:
    """The A1111 ``parameters`` text: prompt, ``Negative prompt:`` line, then ``Key: value, ...``."""
    lines = [params["prompt"]]
    if params.get("negative_prompt"):
        lines.append(f"Negative prompt: {params['negative_prompt']}")
    fields: dict[str, Any] = {
        "Steps": params["steps"], "Sampler": params["sampler"], "CFG scale": params["guidance_scale"],
        "Seed": params["seed"], "Size": f"{params['width']}x{params['height']}",
        "Model": Path(str(params["model"])).name,
    }
    if params.get("loras"):
        fields["Lora"] = ", ".join(f"{Path(lora['path']).stem}:{lora['weight']:g}" for lora in params["loras"])
        fields["Lora merged"] = params["merge"]
    if params.get("controlnet"):
        fields["ControlNet"] = Path(str(params["controlnet"])).name
        fields["ControlNet weight"] = params["controlnet_conditioning_scale"]
    fields["Version"] = f"dreamstep {params['dreamstep_version']}"
    lines.append(", ".join(f"{key}: {_a1111_value(value)}" for key, value in fields.items()))
    return "\n".join(lines)


def png_info(params: dict[str, Any]) -> PngInfo:
    """Text chunks for one image (tEXt, or iTXt where the text is not Latin-1)."""
    info = PngInfo()
    info.add_text(PARAMETERS_KEY, a1111_parameters(params))
    info.add_text(JSON_KEY, json.dumps(params, ensure_ascii=False))
    return info


def grid_png_info(step: int, cells: list[dict[str, Any]]) -> PngInfo:
    """Text chunks for a grid of training samples: each cell's A1111 ``parameters`` (a blank line apart)
    and, as JSON, the training step with every cell's parameters."""
    info = PngInfo()
    info.add_text(PARAMETERS_KEY, "\n\n".join(a1111_parameters(cell) for cell in cells))
    info.add_text(JSON_KEY, json.dumps({"step": step, "images": cells}, ensure_ascii=False))
    return info


def sample_parameters(pipeline: Any, **settings: Any) -> dict[str, Any]:
    """The parameters of one training sample, in the layout of a generated image's (model, sampler,
    version filled in from ``pipeline``), for the grid's label and PNG text."""
    from dreamstep import __version__

    return {"model": pipeline.config.get("_name_or_path", ""), "sampler": type(pipeline.scheduler).__name__,
            "negative_prompt": None, **settings, "dreamstep_version": __version__}


def read_parameters(path: str | Path) -> tuple[str, dict[str, Any]]:
    """The A1111 text and the JSON parameters stored in a PNG written by :func:`save_png`."""
    with Image.open(path) as image:
        text = dict(image.text)
    return text[PARAMETERS_KEY], json.loads(text[JSON_KEY])
