"""The captioners, each loaded the way its publisher ships it and run in batches.

- Florence-2, BLIP and the instruction models (Qwen2.5-VL, Qwen3-VL; any image-text-to-text model whose
  processor has a chat template) run through transformers' own classes (``Florence2ForConditionalGeneration``,
  ``BlipForConditionalGeneration``, ``AutoModelForImageTextToText``) and processors, from a hub id or a
  ``save_pretrained`` folder. Florence-2 needs the transformers-native checkpoints (``florence-community/...``);
  the ``microsoft/Florence-2-*`` repositories hold remote code, which is not run.
- The WD14 tagger is in :mod:`.tagger` (onnxruntime, no torch).

One note for Qwen-VL without torchvision: transformers' Qwen-VL processors include a video processor that needs
torchvision, so loading one fails there; the error says to install the torchvision matching the torch build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from PIL import Image

from dreamstep.captioning.captioner import Captioner
from dreamstep.config.caption import DEFAULT_MODELS, FLORENCE_TASKS, CaptionConfig
from dreamstep.errors import UserError, cannot_load, refusing_pickled_code
from dreamstep.models.precision import choose_device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on a GPU that computes in it (the models were trained in it; half the memory), else fp32."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def load_transformers_captioner(config: CaptionConfig) -> Captioner:
    """Florence-2, BLIP or an instruction model, loaded on its device; a model that cannot be had is one
    UserError line."""
    device = choose_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    builders = {"florence2": _florence2, "blip": _blip, "qwen-vl": _instruction_model, "llava": _instruction_model}
    caption = builders[config.captioner](config, device, dtype)
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    return Captioner(config.captioner, caption, device=str(device), dtype=names[dtype])


def _from_pretrained(loader: Any, config: CaptionConfig, **kwargs: Any) -> Any:
    model_id = config.model_id
    try:
        with refusing_pickled_code(model_id, "--model"):
            # Never run a repository's own code, and never stop to ask whether to.
            return loader.from_pretrained(model_id, trust_remote_code=False, **kwargs)
    except ImportError as error:
        if "torchvision" in str(error).lower():
            raise UserError(f"--model {model_id}: its transformers processor needs torchvision, which is not "
                            "installed or does not import; install the torchvision release made for your torch "
                            "build (pip install torchvision from the same index as torch)") from None
        raise
    except OSError as error:
        raise cannot_load("--model", model_id, f"{config.captioner} captioner", error, "give a local folder") from None
    except ValueError as error:
        if "trust_remote_code" not in str(error):
            raise
        raise UserError(f"--model {model_id}: the model ships its own code, which dreamstep does not run; use a "
                        f"checkpoint transformers reads natively, such as {DEFAULT_MODELS[config.captioner]}") from None


def _check_model_type(config: CaptionConfig, expected: tuple[str, ...]) -> None:
    """A model of another kind would load half-initialised and caption nonsense: refuse it by its config."""
    from transformers import AutoConfig

    try:
        found = _from_pretrained(AutoConfig, config).model_type
    except ValueError:  # no config.json with a model type: a WD14 tagger's folder, a diffusers model, ...
        raise UserError(f"--model {config.model_id}: not a transformers {config.captioner} model (no config.json "
                        "with a model type there); give one like the default, or pick the matching --captioner") \
            from None
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
