"""The WD14 tagger: SmilingWolf's ``model.onnx`` run with onnxruntime, with ``selected_tags.csv`` beside it.

onnxruntime was chosen over timm: timm imports torchvision, whose PyPI wheels do not import beside every torch
build (the CPU build among them), while onnxruntime is one self-contained wheel (``onnxruntime-gpu`` adds CUDA;
the tagger then runs on the GPU), and the tagger then needs no torch at all. Its input is what sd-scripts and
SmilingWolf's own demo feed the ONNX models: the image padded to a white square, resized to the model's input
side, BGR, 0..255 floats, NHWC; its output is one sigmoid score per row of the tag list.
"""

from __future__ import annotations

import csv
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from dreamstep.captioning.captioner import Captioner
from dreamstep.config.caption import CaptionConfig
from dreamstep.errors import UserError, cannot_load

# selected_tags.csv categories (Danbooru's): 9 rating, 0 general, 4 character.
_RATING, _GENERAL, _CHARACTER = "9", "0", "4"
_TAGGER_FILES = ("model.onnx", "selected_tags.csv")
_DEFAULT_TAGGER_SIDE = 448


def _tagger_files(config: CaptionConfig) -> tuple[Path, Path]:
    """model.onnx and selected_tags.csv from a local folder, or from the hub (cached)."""
    model_id = config.model_id
    folder = Path(model_id).expanduser()
    if folder.is_dir():
        missing = [name for name in _TAGGER_FILES if not (folder / name).is_file()]
        if missing:
            raise UserError(f"--model {model_id}: no {' or '.join(missing)} in the folder; a WD14 tagger folder "
                            f"holds {' and '.join(_TAGGER_FILES)}")
        return folder / _TAGGER_FILES[0], folder / _TAGGER_FILES[1]
    if folder.exists():
        raise UserError(f"--model {model_id}: a file; give the tagger's folder (with {' and '.join(_TAGGER_FILES)}) "
                        "or its hub id")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        paths = [Path(hf_hub_download(model_id, name)) for name in _TAGGER_FILES]
    except (OSError, ValueError, HfHubHTTPError) as error:
        raise cannot_load("--model", model_id, "wd14 tagger", error, "give a local folder") from None
    return paths[0], paths[1]


@dataclass(frozen=True)
class TagList:
    names: list[str]
    categories: list[str]


def read_tag_list(path: Path, underscores: bool) -> TagList:
    """selected_tags.csv (``tag_id,name,category,count``): row i names output i of the model."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"name", "category"} <= set(rows[0]):
        raise UserError(f"{path}: not a WD14 tag list (expected the columns tag_id,name,category,count)")
    names = [row["name"] for row in rows]
    if not underscores:
        # Short tags keep their underscores: they are emoticons such as ^_^ (sd-scripts' rule).
        names = [n.replace("_", " ") if len(n) > 3 else n for n in names]
    return TagList(names, [row["category"] for row in rows])


def pad_square_resize(image: Image.Image, side: int) -> np.ndarray:
    """The tagger's input for one RGB image: padded to a white square (centred), resized to ``side``,
    as float32 BGR in 0..255, HWC."""
    width, height = image.size
    square = max(width, height)
    canvas = Image.new("RGB", (square, square), (255, 255, 255))
    canvas.paste(image, ((square - width) // 2, (square - height) // 2))
    resample = Image.Resampling.BOX if square > side else Image.Resampling.LANCZOS
    pixels = np.asarray(canvas.resize((side, side), resample), dtype=np.float32)
    return np.ascontiguousarray(pixels[:, :, ::-1])


def select_tags(scores: np.ndarray, tags: TagList, config: CaptionConfig) -> str:
    """Character tags, then general tags, each by falling score, over their thresholds; the likeliest rating
    first with ``--rating_tag``."""
    chosen = []
    for category, threshold in ((_CHARACTER, config.character_threshold), (_GENERAL, config.general_threshold)):
        found = [(scores[i], tags.names[i]) for i, c in enumerate(tags.categories)
                 if c == category and scores[i] >= threshold]
        chosen += [name for _, name in sorted(found, key=lambda pair: -pair[0])]
    ratings = [i for i, c in enumerate(tags.categories) if c == _RATING]
    if config.rating_tag and ratings:
        chosen.insert(0, tags.names[max(ratings, key=lambda i: scores[i])])
    excluded = set(config.exclude_tags)
    return ", ".join(name for name in chosen if name not in excluded)


def load_tagger(config: CaptionConfig) -> Captioner:
    if importlib.util.find_spec("onnxruntime") is None:
        raise UserError("--captioner wd14 needs onnxruntime: pip install 'dreamstep[caption]' (or onnxruntime-gpu "
                        "for the GPU)")
    import onnxruntime

    model_path, tags_path = _tagger_files(config)
    tags = read_tag_list(tags_path, config.underscores)
    available = onnxruntime.get_available_providers()
    on_gpu = "CUDAExecutionProvider" in available and (config.device or "cuda").startswith("cuda")
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if on_gpu else ["CPUExecutionProvider"]
    try:
        session = onnxruntime.InferenceSession(str(model_path), providers=providers)
    except Exception as error:  # onnxruntime raises its own exception types for files it cannot read
        raise UserError(f"--model {config.model_id}: {model_path} is not a model onnxruntime can run "
                        f"({str(error).splitlines()[0]})") from None
    model_input = session.get_inputs()[0]
    side = model_input.shape[1] if isinstance(model_input.shape[1], int) else _DEFAULT_TAGGER_SIDE
    fixed_batch = model_input.shape[0] if isinstance(model_input.shape[0], int) and model_input.shape[0] > 0 else None

    def caption(images: list[Image.Image]) -> list[str]:
        batch = np.stack([pad_square_resize(image, side) for image in images])
        chunks = [batch] if fixed_batch is None else [batch[i:i + fixed_batch] for i in range(0, len(batch),
                                                                                             fixed_batch)]
        scores = np.concatenate([session.run(None, {model_input.name: chunk})[0] for chunk in chunks])
        if scores.shape[1] != len(tags.names):
            raise UserError(f"--model {config.model_id}: the model scores {scores.shape[1]} tags but "
                            f"{tags_path.name} lists {len(tags.names)}; the two files are from different taggers")
        return [select_tags(row, tags, config) for row in scores]

    return Captioner("wd14", caption, tags=True, device="cuda" if on_gpu else "cpu", dtype="fp32")
