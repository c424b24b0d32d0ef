"""The captioners, each loaded the way its publisher ships it and run in batches.

- Florence-2, BLIP and the instruction models (Qwen2.5-VL, Qwen3-VL; any image-text-to-text model whose
  processor has a chat template) run through transformers' own classes (``Florence2ForConditionalGeneration``,
  ``BlipForConditionalGeneration``, ``AutoModelForImageTextToText``) and processors, from a hub id or a
  ``save_pretrained`` folder. Florence-2 needs the transformers-native checkpoints (``florence-community/...``);
  the ``microsoft/Florence-2-*`` repositories hold remote code, which is not run.
- The WD14 tagger runs its ``model.onnx`` with onnxruntime and reads ``selected_tags.csv`` beside it, SmilingWolf's
  published layout. onnxruntime was chosen over timm: timm imports torchvision, whose PyPI wheels do not import
  beside every torch build (the CPU build among them), while onnxruntime is one self-contained wheel (the package
  ``onnxruntime-gpu`` adds CUDA; the tagger then runs on the GPU). Its input is what sd-scripts and SmilingWolf's
  own demo feed: the image padded to a white square, resized to the model's input side, BGR, 0..255 floats, NHWC.

One note for Qwen-VL without torchvision: transformers' Qwen-VL processors include a video processor that needs
torchvision, so loading one fails there; the error says to install the torchvision matching the torch build.
"""

from __future__ import annotations

import csv
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from dreamstep.config.caption import FLORENCE_TASKS, CaptionConfig
from dreamstep.errors import UserError, refusing_pickled_code

# selected_tags.csv categories (Danbooru's): 9 rating, 0 general, 4 character.
_RATING, _GENERAL, _CHARACTER = "9", "0", "4"
_TAGGER_FILES = ("model.onnx", "selected_tags.csv")
_DEFAULT_TAGGER_SIDE = 448


@dataclass
class Captioner:
    """``caption(images) -> captions``; ``tags``: whether a caption is a comma-separated tag list."""

    name: str
    caption: Callable[[list[Image.Image]], list[str]]
    tags: bool = False
    device: str = "cpu"
    dtype: str = "fp32"


def pick_device(requested: str | None) -> torch.device:
    if requested:
        try:
            device = torch.device(requested)
        except RuntimeError:
            raise UserError(f"--device {requested}: not a device; use cuda, cuda:1 or cpu") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device {requested}: this torch build sees no CUDA GPU; use --device cpu")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on a GPU that computes in it (the models were trained in it; half the memory), else fp32."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def load_captioner(config: CaptionConfig) -> Captioner:
    """The captioner ``config`` names, loaded on its device; a model that cannot be had is one UserError line."""
    if config.captioner == "wd14":
        return _load_tagger(config)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    builders = {"florence2": _florence2, "blip": _blip, "qwen-vl": _instruction_model}
    caption = builders[config.captioner](config, device, dtype)
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    return Captioner(config.captioner, caption, device=str(device), dtype=names[dtype])


def _from_pretrained(loader: Any, config: CaptionConfig, **kwargs: Any) -> Any:
    model_id = config.model_id
    try:
        with refusing_pickled_code(model_id, "--model"):
            return loader.from_pretrained(model_id, **kwargs)
    except ImportError as error:
        if "torchvision" in str(error).lower():
            raise UserError(f"--model {model_id}: its transformers processor needs torchvision, which is not "
                            "installed or does not import; install the torchvision release made for your torch "
                            "build (pip install torchvision from the same index as torch)") from None
        raise
    except OSError as error:
        raise UserError(f"--model {model_id}: cannot load the {config.captioner} captioner "
                        f"({_reason(error)}); download it once with network access (unset HF_HUB_OFFLINE), "
                        "or give a local folder") from None


def _reason(error: Exception) -> str:
    text = str(error).strip()
    if "offline" in text.lower() or "connect" in text.lower() or "cache" in text.lower():
        return "it is not in the local Hugging Face cache and the hub is offline or unreachable"
    return text.splitlines()[0] if text else type(error).__name__


def _check_model_type(config: CaptionConfig, expected: tuple[str, ...]) -> None:
    """A model of another kind would load half-initialised and caption nonsense: refuse it by its config."""
    from transformers import AutoConfig

    found = _from_pretrained(AutoConfig, config).model_type
    if found not in expected:
        raise UserError(f"--model {config.model_id}: a '{found}' model, not a {config.captioner} captioner "
                        f"({' or '.join(expected)}); give one like the default, or pick the matching --captioner")


def _to(inputs: Any, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Processor outputs on ``device``, with the pixels in the model's precision."""
    return {k: (v.to(device, dtype=dtype) if v.is_floating_point() else v.to(device)) if torch.is_tensor(v) else v
            for k, v in inputs.items()}


def _florence2(config: CaptionConfig, device: torch.device, dtype: torch.dtype) -> Callable:
    from transformers import AutoProcessor, Florence2ForConditionalGeneration

    _check_model_type(config, ("florence2",))
    model = _from_pretrained(Florence2ForConditionalGeneration, config, dtype=dtype).to(device).eval()
    processor = _from_pretrained(AutoProcessor, config)
    task = FLORENCE_TASKS[config.florence_task]

    @torch.inference_mode()
    def caption(images: list[Image.Image]) -> list[str]:
        inputs = _to(processor(text=[task] * len(images), images=images, return_tensors="pt"), device, dtype)
        out = model.generate(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"],
                             attention_mask=inputs.get("attention_mask"), max_new_tokens=config.max_new_tokens,
                             num_beams=config.num_beams, do_sample=False)
        return processor.batch_decode(out, skip_special_tokens=True)

    return caption


def _blip(config: CaptionConfig, device: torch.device, dtype: torch.dtype) -> Callable:
    from transformers import AutoProcessor, BlipForConditionalGeneration

    _check_model_type(config, ("blip",))
    model = _from_pretrained(BlipForConditionalGeneration, config, dtype=dtype).to(device).eval()
    processor = _from_pretrained(AutoProcessor, config)

    @torch.inference_mode()
    def caption(images: list[Image.Image]) -> list[str]:
        inputs = _to(processor(images=images, return_tensors="pt"), device, dtype)
        out = model.generate(**inputs, max_new_tokens=config.max_new_tokens, num_beams=config.num_beams,
                             do_sample=False)
        return processor.batch_decode(out, skip_special_tokens=True)

    return caption


def _instruction_model(config: CaptionConfig, device: torch.device, dtype: torch.dtype) -> Callable:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = _from_pretrained(AutoProcessor, config)
    if getattr(processor, "chat_template", None) is None:
        raise UserError(f"--model {config.model_id}: its processor has no chat template, so it is not an "
                        "instruction model --captioner qwen-vl can prompt; give an -Instruct model")
    model = _from_pretrained(AutoModelForImageTextToText, config, dtype=dtype).to(device).eval()
    processor.tokenizer.padding_side = "left"  # batched generation continues every prompt from its last token
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": config.question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)

    @torch.inference_mode()
    def caption(images: list[Image.Image]) -> list[str]:
        inputs = _to(processor(text=[prompt] * len(images), images=images, padding=True, return_tensors="pt"),
                     device, dtype)
        out = model.generate(**inputs, max_new_tokens=config.max_new_tokens, num_beams=config.num_beams,
                             do_sample=False)
        return processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    return caption


# ---------------------------------------------------------------- WD14 tagger (onnxruntime)

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
        raise UserError(f"--model {model_id}: cannot load the wd14 tagger ({_reason(error)}); download it once "
                        "with network access (unset HF_HUB_OFFLINE), or give a local folder") from None
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


def _load_tagger(config: CaptionConfig) -> Captioner:
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
