"""FLUX.1 from the component files ComfyUI, Forge and sd-scripts users have: the transformer
(``flux1-dev.safetensors``, Black Forest Labs' layout, or a diffusers-layout file, or a ``.gguf`` quantization),
``ae.safetensors``, ``clip_l.safetensors`` and ``t5xxl_fp16.safetensors`` / ``t5xxl_fp8_e4m3fn.safetensors``.

Each file is identified from its header alone (no tensor is read), so a file given to the wrong flag, a LoRA, an
SDXL checkpoint or a truncated download gets one line naming the flag and what the file is before anything loads.
Loading is diffusers' (``from_single_file``, GGUF through ``GGUFQuantizationConfig``) and transformers'
(``from_pretrained`` over the file, whose keys are already transformers' own).

The configs come from a local diffusers folder (``--model_config``, or the transformer file's folder when it holds
``model_index.json``), else from the published FLUX.1-dev / -schnell configs (dev when the file has a guidance
embedding), which fit only full-size files.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dreamstep.errors import UserError
from dreamstep.models import published_configs
from dreamstep.models.flux.lora_keys import (
    FLUX_DOUBLE_BLOCK,
    FLUX_FUSED_ROWS,
    FLUX_GLOBAL,
    FLUX_GUIDANCE,
    FLUX_SINGLE_BLOCK,
)

# The prefix ComfyUI's and Forge's full checkpoints put before the transformer's keys.
COMFY_PREFIX = "model.diffusion_model."
FILE_SUFFIXES = (".safetensors", ".gguf")
# sd-scripts' tokenizers of FLUX.1 (its flux_utils), read from the Hugging Face cache when no folder has them.
TOKENIZER_IDS = {"tokenizer": "openai/clip-vit-large-patch14", "tokenizer_2": "google/t5-v1_1-xxl"}
_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
# The width diffusers' convert_flux_transformer_checkpoint_to_diffusers assumes (FLUX.1's).
_DIFFUSERS_CONVERTER_WIDTH = 3072


@dataclass(frozen=True)
class FluxFiles:
    """The component files of a FLUX.1 base, by sd-scripts' flag names; ``None``: from the config folder."""

    transformer: Path | None = None
    clip_l: Path | None = None
    t5xxl: Path | None = None
    ae: Path | None = None

    def given(self) -> dict[str, Path]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def identity(self, part: str) -> str:
        """Cache-key text of one part's file: its path, size and modification time (replaced weights miss)."""
        file = getattr(self, part)
        if file is None:
            return ""
        stat = file.stat()
        return f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


# What each flag wants, and the flag of each part (the transformer is the model path, as in sd-scripts).
FLAGS = {"transformer": "--pretrained_model_name_or_path", "clip_l": "--clip_l", "t5xxl": "--t5xxl", "ae": "--ae"}
_WANTED = {"transformer": "a FLUX.1 transformer (flux1-dev.safetensors)", "clip_l": "a CLIP-L text encoder "
           "(clip_l.safetensors)", "t5xxl": "a T5-XXL encoder (t5xxl_fp16.safetensors)",
           "ae": "the FLUX.1 autoencoder (ae.safetensors)"}


@dataclass(frozen=True)
class FileHeader:
    """A component file's tensor names, shapes and storage dtypes (safetensors names: F16, BF16, F8_E4M3...)."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]

    @property
    def fp8(self) -> bool:
        """Whether the big weights are stored as 8-bit floats (as sd-scripts' and ComfyUI's fp8 copies are)."""
        return any(dtype in _FP8_DTYPES for dtype in self.dtypes.values())

    def kind(self) -> str:
        """What the file holds, in words."""
        return _kind(self.shapes)


def read_header(path: Path, flag: str) -> FileHeader:
    """The header of a .safetensors or .gguf file; a missing, truncated or foreign file as one line naming ``flag``."""
    if not path.is_file():
        raise UserError(f"{flag} {path} does not exist; check the path")
    if path.suffix not in FILE_SUFFIXES:
        raise UserError(f"{flag} {path} is not a .safetensors or .gguf file; give the component file itself")
    if path.suffix == ".gguf":
        return _gguf_header(path, flag)
    try:
        with safe_open(str(path), framework="pt") as f:
            slices = {key: f.get_slice(key) for key in f.keys()}  # noqa: SIM118 (a file, not a dict)
            shapes = {key: tuple(piece.get_shape()) for key, piece in slices.items()}
            dtypes = {key: piece.get_dtype() for key, piece in slices.items()}
    except (SafetensorError, OSError) as e:
        raise UserError(f"{flag} {path} cannot be read as safetensors ({e}): a truncated or damaged download? "
                        "re-download it") from e
    return FileHeader(path, shapes, dtypes)


def _gguf_header(path: Path, flag: str) -> FileHeader:
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise UserError(f"{flag} {path} is a GGUF file, which needs the gguf package: pip install gguf") from e
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:  # a damaged header: gguf indexes or keys past its data
        raise UserError(f"{flag} {path} cannot be read as GGUF ({e}): a truncated or damaged download? "
                        "re-download it") from e
    # GGUF lists a tensor's dimensions innermost first; torch's order is the reverse.
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    return FileHeader(path, shapes, {t.name: t.tensor_type.name for t in reader.tensors})


def _kind(shapes: Mapping[str, tuple[int, ...]]) -> str:
    keys = list(shapes)
    if any(".lora_" in k or "lora_down" in k or ".hada_" in k or ".lokr_" in k for k in keys):
        return "a LoRA"
    if any(k.startswith(("double_blocks.", COMFY_PREFIX + "double_blocks.")) for k in keys):
        return "a FLUX.1 transformer"
    if "single_transformer_blocks.0.proj_out.weight" in shapes:
        return "a FLUX.1 transformer in diffusers' layout"
    if any(k.startswith((COMFY_PREFIX + "input_blocks.", "conditioner.embedders.")) for k in keys):
        return "an SDXL (or SD) checkpoint"
    if "decoder.conv_in.weight" in shapes:
        channels = shapes["decoder.conv_in.weight"][1]
        layout = "LDM" if "encoder.down.0.block.0.conv1.weight" in shapes else "diffusers"
        return f"a {channels}-channel VAE in the {layout} layout"
    clip_q = [k for k in keys if k.endswith("encoder.layers.0.self_attn.q_proj.weight")]
    if clip_q:
        return f"a CLIP text encoder of width {shapes[clip_q[0]][0]}"
    if "encoder.block.0.layer.0.SelfAttention.q.weight" in shapes:
        return "a T5 encoder"
    return f"not a FLUX.1 component (first key: {keys[0] if keys else 'none'})"


def _fits(part: str, header: FileHeader) -> bool:
    kind = header.kind()
    return {"transformer": kind.startswith("a FLUX.1 transformer"), "clip_l": kind.startswith("a CLIP text encoder"),
            "t5xxl": kind == "a T5 encoder", "ae": kind == "a 16-channel VAE in the LDM layout"}[part]


def check_files(files: FluxFiles) -> dict[str, FileHeader]:
    """Each given file's header, checked to be the part its flag wants (one line naming the flag otherwise)."""
    headers = {}
    for part, path in files.given().items():
        header = read_header(path, FLAGS[part])
        if not _fits(part, header):
            raise UserError(f"{FLAGS[part]} {path} is {header.kind()}, not {_WANTED[part]}; give that file")
        headers[part] = header
    return headers


def guidance_embeds(header: FileHeader) -> bool:
    """FLUX.1-dev (guidance-distilled) has a guidance embedding; schnell has none."""
    return any(k.removeprefix(COMFY_PREFIX).startswith(("guidance_in.", "time_text_embed.guidance_embedder."))
               for k in header.shapes)


def _blocks(header: FileHeader, prefix: str) -> int:
    found = {k.removeprefix(COMFY_PREFIX).split(".")[1] for k in header.shapes
             if k.removeprefix(COMFY_PREFIX).startswith(prefix)}
    return len(found)


def published_transformer_config(header: FileHeader) -> dict[str, Any] | None:
    """The published FLUX.1-dev or -schnell transformer config if the file is one of those models' (block counts
    and width as published), else ``None``."""
    config = {**published_configs.FLUX_DEV_TRANSFORMER, "guidance_embeds": guidance_embeds(header)}
    bfl = any(k.removeprefix(COMFY_PREFIX).startswith("double_blocks.") for k in header.shapes)
    double, single = ("double_blocks.", "single_blocks.") if bfl else ("transformer_blocks.",
                                                                      "single_transformer_blocks.")
    width_key = "img_in.weight" if bfl else "x_embedder.weight"
    width = next((shape[0] for k, shape in header.shapes.items() if k.removeprefix(COMFY_PREFIX) == width_key), None)
    fits = (_blocks(header, double) == config["num_layers"] and _blocks(header, single) == config["num_single_layers"]
            and width == config["num_attention_heads"] * config["attention_head_dim"])
    return config if fits else None


_ENCODER_CONFIGS = {"text_encoder": {"model_type": "clip_text_model", **published_configs.CLIP_L_TEXT},
                    "text_encoder_2": {"model_type": "t5", **published_configs.T5_XXL_ENCODER}}


@contextmanager
def config_folder(source: str | None, header: FileHeader | None) -> Iterator[str]:
    """Where the loaders read the parts' configs (``transformer/``, ``vae/``, ``text_encoder/``,
    ``text_encoder_2/``): ``source``, or a temporary folder of the published configs fitting the transformer file
    ``header`` (FLUX.1-dev's without one); one line naming --model_config when the file is no published model."""
    if source is not None:
        if header is not None:
            _check_guidance(source, header)
        yield source
        return
    transformer = (published_transformer_config(header) if header is not None
                   else dict(published_configs.FLUX_DEV_TRANSFORMER))
    if transformer is None:
        raise UserError(f"{header.path} is not FLUX.1-dev or -schnell as published (its block counts or width "
                        "differ); give --model_config a diffusers FLUX folder with its configs")
    configs = {"transformer": {"_class_name": "FluxTransformer2DModel", **transformer},
               "vae": {"_class_name": "AutoencoderKL", **published_configs.FLUX_VAE}, **_ENCODER_CONFIGS}
    with tempfile.TemporaryDirectory(prefix="dreamstep-flux-config-") as folder:
        for name, config in configs.items():
            (Path(folder) / name).mkdir()
            (Path(folder) / name / "config.json").write_text(json.dumps(config), encoding="utf-8")
        yield folder


def _check_guidance(source: str, header: FileHeader) -> None:
    from diffusers import FluxTransformer2DModel

    try:
        config = FluxTransformer2DModel.load_config(source, subfolder="transformer")
    except (OSError, ValueError):
        return  # the loader names what is missing
    file_dev, config_dev = guidance_embeds(header), bool(config.get("guidance_embeds"))
    if file_dev != config_dev:
        names = {True: "FLUX.1-dev (guidance embedding)", False: "FLUX.1-schnell (no guidance embedding)"}
        raise UserError(f"{header.path} is {names[file_dev]} but the configs of {source} are {names[config_dev]}; "
                        "give --model_config a folder of the same model")


@contextmanager
def transformers_folder(file: Path, config_json: str) -> Iterator[Path]:
    """A temporary folder in which transformers' ``from_pretrained`` finds ``config_json`` and the component file
    as its weights: the file is linked, never copied."""
    with tempfile.TemporaryDirectory(prefix="dreamstep-encoder-") as folder:
        (Path(folder) / "config.json").write_text(config_json, encoding="utf-8")
        os.symlink(file.resolve(), Path(folder) / "model.safetensors")
        yield Path(folder)


# ------------------------------------------------ writing: the BFL layout of a diffusers transformer (tiny files)

# Norms and the final modulation, BFL name inside the block -> diffusers name (the linear layers are in
# dreamstep.lora.formats' tables).
_DOUBLE_NORMS = {"img_attn.norm.query_norm.scale": "attn.norm_q.weight",
                 "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
                 "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
                 "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight"}
_SINGLE_NORMS = {"norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight"}


def transformer_to_bfl(state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A diffusers FLUX transformer's state dict in Black Forest Labs' layout (what ``flux1-dev.safetensors`` holds
    and diffusers' ``from_single_file`` reads), for writing test files; raises on a key it does not place."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(bfl: str, names: tuple[str, ...]) -> None:
        for kind in ("weight", "bias"):
            parts = [f"{n}.{kind}" for n in names]
            if all(p in state_dict for p in parts):
                out[f"{bfl}.{kind}"] = torch.cat([state_dict[p] for p in parts])
                used.update(parts)

    globals_ = {**FLUX_GLOBAL, **(FLUX_GUIDANCE if config["guidance_embeds"] else {})}
    for bfl, name in globals_.items():
        take(bfl, (name,))
    for i in range(config["num_layers"]):
        for bfl, names in FLUX_DOUBLE_BLOCK.items():
            take(f"double_blocks.{i}.{bfl}", tuple(f"transformer_blocks.{i}.{n}" for n in names))
        for bfl, name in _DOUBLE_NORMS.items():
            out[f"double_blocks.{i}.{bfl}"] = state_dict[f"transformer_blocks.{i}.{name}"]
            used.add(f"transformer_blocks.{i}.{name}")
    for i in range(config["num_single_layers"]):
        for bfl, names in FLUX_SINGLE_BLOCK.items():
            take(f"single_blocks.{i}.{bfl}", tuple(f"single_transformer_blocks.{i}.{n}" for n in names))
        for bfl, name in _SINGLE_NORMS.items():
            out[f"single_blocks.{i}.{bfl}"] = state_dict[f"single_transformer_blocks.{i}.{name}"]
            used.add(f"single_transformer_blocks.{i}.{name}")
    # The final adaLN modulation: diffusers orders its output (scale, shift), BFL (shift, scale).
    for kind in ("weight", "bias"):
        scale, shift = state_dict[f"norm_out.linear.{kind}"].chunk(2)
        out[f"final_layer.adaLN_modulation.1.{kind}"] = torch.cat([shift, scale])
        used.add(f"norm_out.linear.{kind}")
    left = sorted(set(state_dict) - used)
    if left:
        raise KeyError(f"no BFL name for {left[0]} ({len(left)} keys)")
    return out


def transformer_from_bfl(checkpoint: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`transformer_to_bfl` for any width: diffusers' own converter assumes FLUX.1's width
    (3072) and is used for files of that width; this one reads the narrower files tests and distillations have."""
    checkpoint = {k.removeprefix(COMFY_PREFIX): v for k, v in checkpoint.items()}
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    out: dict[str, torch.Tensor] = {}

    def give(bfl: str, names: tuple[str, ...], module: str = "") -> None:
        # A fused BFL linear's output rows are its parts', in units of the width (FLUX_FUSED_ROWS).
        rows = [r * hidden for r in FLUX_FUSED_ROWS.get(module, ())]
        for kind in ("weight", "bias"):
            if f"{bfl}.{kind}" in checkpoint:
                tensor = checkpoint.pop(f"{bfl}.{kind}")
                out.update(zip((f"{n}.{kind}" for n in names), tensor.split(rows) if rows else (tensor,)))

    globals_ = {**FLUX_GLOBAL, **(FLUX_GUIDANCE if config["guidance_embeds"] else {})}
    for bfl, name in globals_.items():
        give(bfl, (name,))
    for i in range(config["num_layers"]):
        for bfl, names in FLUX_DOUBLE_BLOCK.items():
            give(f"double_blocks.{i}.{bfl}", tuple(f"transformer_blocks.{i}.{n}" for n in names), bfl)
        for bfl, name in _DOUBLE_NORMS.items():
            out[f"transformer_blocks.{i}.{name}"] = checkpoint.pop(f"double_blocks.{i}.{bfl}")
    for i in range(config["num_single_layers"]):
        for bfl, names in FLUX_SINGLE_BLOCK.items():
            give(f"single_blocks.{i}.{bfl}", tuple(f"single_transformer_blocks.{i}.{n}" for n in names), bfl)
        for bfl, name in _SINGLE_NORMS.items():
            out[f"single_transformer_blocks.{i}.{name}"] = checkpoint.pop(f"single_blocks.{i}.{bfl}")
    for kind in ("weight", "bias"):
        shift, scale = checkpoint.pop(f"final_layer.adaLN_modulation.1.{kind}").chunk(2)
        out[f"norm_out.linear.{kind}"] = torch.cat([scale, shift])
    if checkpoint:
        raise KeyError(f"no diffusers name for {min(checkpoint)} ({len(checkpoint)} keys)")
    return out


# ------------------------------------------------ where each part of a base comes from


@dataclass(frozen=True)
class FluxBase:
    """A FLUX.1 base: ``source``, a diffusers folder or hub id that gives the configs, tokenizers, scheduler and
    every part without a file (``None``: the published configs, all four files given), and the component files."""

    source: str | None
    files: FluxFiles


def is_component_file(path: str | Path) -> bool:
    return str(path).endswith(FILE_SUFFIXES) or Path(path).expanduser().is_file()


def _path(value: str | Path | None) -> Path | None:
    return Path(value).expanduser() if value is not None else None


def resolve_base(pretrained_model_name_or_path: str, *, transformer_single_file: str | None = None,
                 clip_l: str | None = None, t5xxl: str | None = None, ae: str | None = None,
                 model_config: str | None = None) -> FluxBase:
    """The base the flags name, every file checked (one line naming the flag when one is wrong), before loading.

    ``pretrained_model_name_or_path`` is a diffusers folder / hub id, or the transformer file (sd-scripts'
    spelling); with a file, ``model_config`` (or the file's folder when it holds ``model_index.json``) gives what
    the files do not, else the published configs do and all four files are needed."""
    if is_component_file(pretrained_model_name_or_path):
        if transformer_single_file is not None:
            raise UserError("--pretrained_model_name_or_path is already a transformer file; remove "
                            "--transformer_single_file")
        transformer = _path(pretrained_model_name_or_path)
        folder = transformer.parent if (transformer.parent / "model_index.json").is_file() else None
        source = model_config or (str(folder) if folder is not None else None)
    else:
        if model_config is not None:
            raise UserError("--model_config only applies when --pretrained_model_name_or_path is a transformer "
                            "file; remove it (the folder or hub id has the configs)")
        transformer, source = _path(transformer_single_file), pretrained_model_name_or_path
    files = FluxFiles(transformer=transformer, clip_l=_path(clip_l), t5xxl=_path(t5xxl), ae=_path(ae))
    check_files(files)
    missing = [FLAGS[f.name] for f in fields(files) if getattr(files, f.name) is None]
    if source is None and missing:
        raise UserError(f"{files.transformer} comes without its other parts: give {', '.join(missing)} (the "
                        "component files), or --model_config a diffusers FLUX folder that has them")
    return FluxBase(source, files)


def base_of(config: Any) -> FluxBase:
    """Where a FLUX trainer's base parts come from (a folder or hub id, the component files), every file checked,
    and what the transformer file's storage tells the config (its ``take_base_file``): once per config, as the
    recipes ask for it at every load. A recipe asks first, before it writes anything."""
    if "_flux_base" not in config.__dict__:
        base = resolve_base(config.pretrained_model_name_or_path,
                            transformer_single_file=getattr(config, "transformer_single_file", None),
                            model_config=config.model_config, **config.component_files())
        header = read_header(base.files.transformer, FLAGS["transformer"]) if base.files.transformer else None
        config.take_base_file(str(base.files.transformer) if base.files.transformer else None,
                              stored_fp8=header is not None and header.fp8)
        config.__dict__["_flux_base"] = base
    return config.__dict__["_flux_base"]


def storage_quantization(header: FileHeader, base_quantization: str) -> str:
    """The base quantization a transformer file trains with: as asked, or for a file stored in fp8 (sd-scripts'
    and ComfyUI's fp8 copies) "fp8", so that it stays the fp8 base it is (sd-scripts' --fp8_base)."""
    return "fp8" if base_quantization == "none" and header.fp8 else base_quantization


def needs_own_conversion(header: FileHeader, config: Mapping[str, Any]) -> bool:
    """Whether a BFL-layout file is narrower or wider than FLUX.1 (3072), the only width diffusers' converter reads."""
    bfl = any(k.removeprefix(COMFY_PREFIX).startswith("double_blocks.") for k in header.shapes)
    return bfl and config["num_attention_heads"] * config["attention_head_dim"] != _DIFFUSERS_CONVERTER_WIDTH
