"""Options of ``dreamstep caption`` (torch-free: ``--help`` and bad values answer before any model loads)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from dreamstep.config.schema import normalize_extension, option
from dreamstep.errors import UserError

CAPTIONERS = ("florence2", "qwen-vl", "llava", "blip", "wd14")
INSTRUCTION_CAPTIONERS = ("qwen-vl", "llava")  # prompted through their chat template (--prompt)
DEFAULT_MODELS = {
    "florence2": "florence-community/Florence-2-large",
    "qwen-vl": "Qwen/Qwen2.5-VL-3B-Instruct",
    "llava": "llava-hf/llava-1.5-7b-hf",
    "blip": "Salesforce/blip-image-captioning-large",
    "wd14": "SmilingWolf/wd-swinv2-tagger-v3",
}
# FLUX learns from plain sentences; the prompt asks for one paragraph without preamble, since the trainers read
# the first line of a caption file.
DEFAULT_PROMPT = ("Describe this image in one detailed paragraph of plain sentences: the subject, its appearance, "
                  "the setting, the lighting and the style. Start directly with the description.")
FLORENCE_TASKS = {"caption": "<CAPTION>", "detailed_caption": "<DETAILED_CAPTION>",
                  "more_detailed_caption": "<MORE_DETAILED_CAPTION>"}


@dataclass
class CaptionConfig:
    source: Path = option(help="an image folder (or a folder of sd-scripts' <repeats>_<name> folders), or a "
                               "dataset TOML: every subset's image_dir is captioned with its caption_extension")
    captioner: Optional[Literal["florence2", "qwen-vl", "llava", "blip", "wd14"]] = option(
        None, "florence2: detailed sentences, fast; qwen-vl (or llava): an instruction model that follows --prompt "
              "(natural sentences, the FLUX style); blip: short captions, fastest; wd14: booru tags for anime SDXL "
              "models (default: the kind of a local --model folder, else florence2)")
    model: Optional[str] = option(
        None, "hub id or local folder of the captioner (default: " +
              "; ".join(f"{k}: {v}" for k, v in DEFAULT_MODELS.items()) + ")")
    prompt: Optional[str] = option(None, "qwen-vl, llava: what to ask the model (default: one detailed paragraph "
                                         "of plain sentences)")
    florence_task: Literal["caption", "detailed_caption", "more_detailed_caption"] = option(
        "detailed_caption", "florence2: how long a caption")
    caption_extension: Optional[str] = option(
        None, "caption file extension (default .txt; for a dataset TOML, each subset's caption_extension)")
    metadata_jsonl: bool = option(False, "write the captions into FOLDER/metadata.jsonl (file_name, text: the "
                                         "Hugging Face image-folder layout) instead of caption files")
    overwrite: bool = option(False, "replace captions that exist (default: images with a caption are skipped)")
    append: bool = option(False, "add the new caption after an existing one (tags: only the new tags)")
    prefix: str = option("", "text put before every new caption, e.g. a trigger word: --prefix 'sks dog, '")
    dry_run: bool = option(False, "caption and print what would be written where, writing nothing")
    batch_size: int = option(8, "images per batch through the model", bounds="[1, inf)")
    max_new_tokens: int = option(256, "longest caption in tokens (sentence captioners)", bounds="[1, inf)")
    num_beams: int = option(1, "beam search width (sentence captioners; 3 is Florence-2's own choice, slower)",
                            bounds="[1, inf)")
    general_threshold: float = option(0.35, "wd14: lowest score of a general tag", bounds="[0, 1]")
    character_threshold: float = option(0.85, "wd14: lowest score of a character tag", bounds="[0, 1]")
    rating_tag: bool = option(False, "wd14: put the most likely rating tag (general, sensitive, ...) first")
    underscores: bool = option(False, "wd14: keep the underscores of tags (long_hair instead of long hair)")
    exclude_tags: list[str] = option([], "wd14: tags never written (comma-separated or repeated)")
    device: Optional[str] = option(None, "cuda, cuda:1, cpu, ... (default: the GPU when there is one)")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = option(
        "auto", "weights' precision (auto: bf16 on a GPU that has it, else fp32)")

    def __post_init__(self) -> None:
        if self.overwrite and self.append:
            raise UserError("--overwrite and --append contradict each other: --overwrite replaces an existing "
                            "caption, --append keeps it and adds to it; give one")
        if self.captioner is None:
            self.captioner = detected_captioner(self.model) or "florence2"
        if self.prompt is not None and self.captioner not in INSTRUCTION_CAPTIONERS:
            raise UserError(f"--prompt is used by --captioner qwen-vl or llava only (this is {self.captioner}); "
                            "remove it")
        if self.prompt is not None and not self.prompt.strip():
            raise UserError("--prompt is empty; give the question to ask, or leave the flag out")
        self.caption_extension = normalize_extension(self.caption_extension)
        if self.caption_extension is not None and self.metadata_jsonl:
            raise UserError("--caption_extension has no effect with --metadata_jsonl (captions go into "
                            "metadata.jsonl); give one of them")
        self.exclude_tags = [t.strip() for v in self.exclude_tags for t in v.split(",") if t.strip()]

    @property
    def model_id(self) -> str:
        return self.model or DEFAULT_MODELS[self.captioner]

    @property
    def question(self) -> str:
        return self.prompt or DEFAULT_PROMPT


# config.json model types of the captioners, for a --model folder given without --captioner.
_KINDS = {"florence2": "florence2", "blip": "blip", "qwen2_vl": "qwen-vl", "qwen2_5_vl": "qwen-vl",
          "llava": "llava", "llava_next": "llava"}


def detected_captioner(model: str | None) -> str | None:
    """The captioner a local ``--model`` folder is: a WD14 tagger (model.onnx and selected_tags.csv), else by its
    config.json's model type; ``None`` for a hub id or a folder that does not tell."""
    folder = Path(model).expanduser() if model is not None else None
    if folder is None or not folder.is_dir():
        return None
    if (folder / "model.onnx").is_file() and (folder / "selected_tags.csv").is_file():
        return "wd14"
    try:
        found = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return _KINDS.get(found.get("model_type")) if isinstance(found, dict) else None
