"""Load FLUX.1 and SDXL components from a diffusers folder, a hub id or a single-file checkpoint.

The loading itself is diffusers' (``from_pretrained`` / ``from_single_file``); this module decides
which one applies, checks the input first so that a wrong path gets one line that names it and the
fix, and turns loader failures (missing files, no network) into such lines too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from diffusers.loaders.single_file_utils import load_single_file_checkpoint
from diffusers.utils import deprecation_utils
from huggingface_hub import constants as hf_constants
from safetensors import SafetensorError
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from dreamstep.errors import UserError, refusing_pickled_code
from dreamstep.models import published_configs, quantization
from dreamstep.models.flux import files as flux_files
from dreamstep.models.flux.files import FluxFiles
from dreamstep.models.quantized_cache import load_or_quantize, source_identity
from dreamstep.models.sources import (
    FluxComponents,
    SDXLComponents,
    check_checkpoint_file,
    check_sdxl_safetensors,
    folder_or_hub_id,
    is_single_file,
)

# Newer diffusers name the loaders' dtype argument `dtype` and warn on the older `torch_dtype`.
_DTYPE_KWARG = "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"
# Loader failures that mean "these files cannot be loaded" rather than a bug in dreamstep.
_LOAD_ERRORS = (OSError, ValueError, SafetensorError)


def _components(pipe: Any, cls: type) -> Any:
    components = cls(**{name: getattr(pipe, name) for name in cls.__dataclass_fields__})
    for name in cls.__dataclass_fields__:
        if isinstance(getattr(components, name), torch.nn.Module):
            quantization.keep_only_quantized_weights(getattr(components, name))
    return components


def _load_error(source: str, error: Exception) -> UserError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if Path(source).exists():
        return UserError(f"could not load '{source}': {reason}")
    if hf_constants.HF_HUB_OFFLINE:
        return UserError(f"could not load '{source}' from the Hugging Face hub: it is not (fully) in the local "
                         "cache and HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it, or give a local "
                         "folder")
    return UserError(f"could not load '{source}' from the Hugging Face hub ({reason}); check the "
                     "id and your network (HF_HUB_OFFLINE must be unset to download), or give a local folder")


def load_flux(pretrained_model_name_or_path: str | Path | None, *, revision: str | None = None,
              variant: str | None = None, transformer_single_file: str | Path | None = None,
              files: FluxFiles | None = None, weight_dtype: torch.dtype = torch.float32,
              quantize: dict[str, str] | None = None, transformer: bool = True) -> FluxComponents:
    """Load a FLUX.1 pipeline's components, all in ``weight_dtype``.

    ``files`` replace the folder's parts with component files (:mod:`~dreamstep.models.flux.files`: the
    transformer as ``flux1-dev.safetensors`` or a ``.gguf``, ``ae``, ``clip_l``, ``t5xxl``), configured by the
    folder (or hub id) ``pretrained_model_name_or_path``, or with ``None`` there by the published configs
    (all four files given). ``transformer_single_file`` is ``files.transformer``. ``quantize`` maps component
    names to a :mod:`~dreamstep.models.quantization` mode, e.g. ``{"transformer": "int8", "text_encoder_2":
    "fp8"}``. Without ``transformer`` the pipeline's transformer is left out (``None``): see
    :func:`load_flux_transformer`.
    """
    files = _with_transformer_file(files, transformer_single_file)
    source = (folder_or_hub_id(pretrained_model_name_or_path, FluxComponents, "FluxPipeline")
              if pretrained_model_name_or_path is not None else None)
    headers = flux_files.check_files(files)
    quantize = {name: mode for name, mode in (quantize or {}).items() if mode != "none"}
    overrides: dict[str, Any] = {}
    if not transformer:
        overrides["transformer"] = None
        quantize.pop("transformer", None)
    elif files.transformer is not None:
        overrides["transformer"] = load_flux_transformer(
            source, revision=revision, variant=variant, transformer_single_file=files.transformer,
            weight_dtype=weight_dtype, base_quantization=quantize.pop("transformer", "none"))
    with flux_files.config_folder(source, headers.get("transformer")) as configs:
        if files.ae is not None:
            overrides["vae"] = _single_file(AutoencoderKL, files.ae, "--ae", config=configs, subfolder="vae",
                                            **{_DTYPE_KWARG: weight_dtype})
        if files.clip_l is not None:
            overrides["text_encoder"] = _encoder_from_file(CLIPTextModel, files.clip_l, "--clip_l", configs,
                                                           "text_encoder", weight_dtype, "none")
        if files.t5xxl is not None:
            overrides["text_encoder_2"] = _encoder_from_file(T5EncoderModel, files.t5xxl, "--t5xxl", configs,
                                                             "text_encoder_2", weight_dtype,
                                                             quantize.pop("text_encoder_2", "none"))
    if source is None:
        return _components(_published_pipeline(overrides, headers.get("transformer")), FluxComponents)
    pipeline_quantization = quantization.pipeline_config(quantize, weight_dtype)
    if pipeline_quantization is not None:
        overrides["quantization_config"] = pipeline_quantization
    pipe = _from_pretrained(FluxPipeline, source, revision=revision, variant=variant,
                            **{_DTYPE_KWARG: weight_dtype}, **overrides)
    return _components(pipe, FluxComponents)


def _with_transformer_file(files: FluxFiles | None, transformer_single_file: str | Path | None) -> FluxFiles:
    files = files or FluxFiles()
    if transformer_single_file is None:
        return files
    return dataclasses.replace(files, transformer=Path(transformer_single_file).expanduser())


def _single_file(model_class: type, file: Path, flag: str, **kwargs: Any) -> Any:
    """diffusers' ``model_class.from_single_file``, its failures as one line naming ``flag`` and the file."""
    try:
        return model_class.from_single_file(str(file) if isinstance(file, Path) else file, **kwargs)
    except (*_LOAD_ERRORS, KeyError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{flag}: could not load {file} with these configs ({reason}); if the file is a "
                        "different size of model, give --model_config a diffusers folder of that model") from e


def _encoder_from_file(model_class: type, file: Path, flag: str, configs: str, subfolder: str,
                       weight_dtype: torch.dtype, mode: str) -> torch.nn.Module:
    """A text encoder from a file whose keys are transformers' own (ComfyUI's clip_l / t5xxl files), loaded by
    transformers' ``from_pretrained`` with the config of ``configs/subfolder``."""
    try:
        config = model_class.config_class.from_pretrained(configs, subfolder=subfolder)
        with flux_files.transformers_folder(file, config.to_json_string()) as folder:
            model, info = model_class.from_pretrained(
                folder, output_loading_info=True, **{_DTYPE_KWARG: weight_dtype},
                quantization_config=quantization.transformers_config(mode, weight_dtype))
    except (*_LOAD_ERRORS, RuntimeError) as e:
        raise UserError(f"{flag}: could not load {file} ({str(e).strip().splitlines()[0]}); give "
                        "--model_config a diffusers folder of the same model") from e
    problems = info["missing_keys"] or info["mismatched_keys"]
    if problems:
        raise UserError(f"{flag} {file} does not fit the {model_class.__name__} of these configs (e.g. "
                        f"{min(problems)}); give --model_config a diffusers folder of the same model")
    return model.eval()


def _published_pipeline(parts: dict[str, Any], transformer_header: Any) -> FluxPipeline:
    """A pipeline of component files alone: the published scheduler of the file's model (dev or schnell) and
    sd-scripts' tokenizers from the Hugging Face cache (or hub)."""
    dev = transformer_header is None or flux_files.guidance_embeds(transformer_header)
    scheduler = FlowMatchEulerDiscreteScheduler(**(published_configs.FLUX_DEV_SCHEDULER if dev else
                                                   published_configs.FLUX_SCHNELL_SCHEDULER))
    try:
        tokenizers = {"tokenizer": CLIPTokenizer.from_pretrained(flux_files.TOKENIZER_IDS["tokenizer"]),
                      "tokenizer_2": T5TokenizerFast.from_pretrained(flux_files.TOKENIZER_IDS["tokenizer_2"])}
    except (OSError, ValueError) as e:
        raise UserError(f"the tokenizers of {', '.join(flux_files.TOKENIZER_IDS.values())} are not in the Hugging "
                        "Face cache (offline?); give --model_config a diffusers FLUX folder (it has them)") from e
    return FluxPipeline(scheduler=scheduler, **tokenizers, **parts)


def _from_pretrained(pipeline_class: type, source: str, **kwargs: Any) -> Any:
    """``pipeline_class.from_pretrained(source)`` (a pipeline's or a model's), its failures as one line naming
    ``source``."""
    try:
        with refusing_pickled_code(source, "model"):
            return pipeline_class.from_pretrained(source, **kwargs)
    except _LOAD_ERRORS as e:
        raise _load_error(source, e) from e


def load_flux_transformer(pretrained_model_name_or_path: str | Path | None, *, revision: str | None = None,
                          variant: str | None = None, transformer_single_file: str | Path | None = None,
                          weight_dtype: torch.dtype = torch.float32, base_quantization: str = "none",
                          on_host: bool = False) -> torch.nn.Module:
    """The FLUX.1 transformer alone, in ``weight_dtype`` with its linear weights quantized as ``base_quantization``
    says, from the pipeline folder (or hub id) or ``transformer_single_file`` configured by it (``None``: by the
    published configs). It loads into host memory, except a 4-bit base from a folder without ``on_host``, which
    diffusers' bitsandbytes loader quantizes on the GPU (see :func:`host_placement`). A file stored in fp8 loads as
    the fp8 base (``base_quantization`` "fp8") unless another mode is asked for: its weights are never held in a
    wider dtype on the device."""
    source = (folder_or_hub_id(pretrained_model_name_or_path, FluxComponents, "FluxPipeline")
              if pretrained_model_name_or_path is not None else None)
    load_kwargs = {_DTYPE_KWARG: weight_dtype, **host_placement(base_quantization, on_host)}
    if transformer_single_file is not None:
        file = Path(transformer_single_file).expanduser()
        header = flux_files.check_files(FluxFiles(transformer=file))["transformer"]
        mode = flux_files.storage_quantization(header, base_quantization)

        def quantize() -> torch.nn.Module:
            with flux_files.config_folder(source, header) as configs:
                return _transformer_from_file(file, header, configs, weight_dtype, mode)

        # Not kept: safetensors cannot write the quantized layers diffusers' single-file loader builds (an invalid
        # storage error), and a GGUF or fp8 file loads as it is stored anyway.
        identity = None
    else:
        def quantize() -> torch.nn.Module:
            try:
                return FluxTransformer2DModel.from_pretrained(
                    source, subfolder="transformer", revision=revision, variant=variant,
                    quantization_config=quantization.diffusers_config(base_quantization, weight_dtype), **load_kwargs)
            except _LOAD_ERRORS as e:
                raise _load_error(source, e) from e

        mode, identity = base_quantization, source_identity(source, "transformer", revision, variant)
    transformer = load_or_quantize(FluxTransformer2DModel, identity, mode, weight_dtype, load_kwargs, quantize,
                                   "FLUX.1 transformer")
    quantization.keep_only_quantized_weights(transformer)
    return transformer


def _transformer_from_file(file: Path, header: Any, configs: str, weight_dtype: torch.dtype,
                           base_quantization: str) -> torch.nn.Module:
    """diffusers' ``from_single_file`` of a transformer file (a ``.gguf`` through its GGUF loader, the weights kept
    quantized); a BFL-layout file of another width than FLUX.1's, which diffusers' converter assumes, is read by
    diffusers and its keys converted by our tables first."""
    flag = flux_files.FLAGS["transformer"]
    kwargs: dict[str, Any] = {"config": configs, "subfolder": "transformer", _DTYPE_KWARG: weight_dtype}
    if file.suffix == ".gguf":
        if base_quantization != "none":
            raise UserError(f"{file} is already quantized (GGUF); remove --base_quantization")
        from diffusers import GGUFQuantizationConfig

        kwargs["quantization_config"] = GGUFQuantizationConfig(compute_dtype=weight_dtype)
    source: Any = file
    config = FluxTransformer2DModel.load_config(configs, subfolder="transformer")
    if flux_files.needs_own_conversion(header, config):
        try:
            source = flux_files.transformer_from_bfl(load_single_file_checkpoint(str(file)), config)
        except KeyError as e:
            raise UserError(f"{flag} {file} does not fit the transformer config of {configs} ({e}); give "
                            "--model_config a diffusers folder of the same model") from e
    transformer = _single_file(FluxTransformer2DModel, source, flag, **kwargs)
    if file.suffix != ".gguf":
        quantization.quantize_single_file_model(transformer, base_quantization, weight_dtype)
    return transformer


def host_placement(mode: str, on_host: bool) -> dict[str, Any]:
    """``from_pretrained``'s placement of a base quantized as ``mode``: diffusers' bitsandbytes loader quantizes each
    weight where it places it, the GPU by default, so a base that must wait in host memory (``on_host``: for a block
    swapper, which then moves only its resident part) is placed there; bitsandbytes quantizes on the CPU (0.48 on).
    Other bases load into host memory anyway."""
    return {"device_map": "cpu"} if mode == "nf4" and on_host else {}


def _load_sdxl_single_file(file: Path, config: str | Path | None, weight_dtype: torch.dtype,
                           unet_quantization: str) -> StableDiffusionXLPipeline:
    if file.suffix == ".safetensors":
        check_sdxl_safetensors(file)
    kwargs: dict[str, Any] = {_DTYPE_KWARG: weight_dtype}
    if config is not None:
        kwargs["config"] = folder_or_hub_id(config, SDXLComponents, "StableDiffusionXLPipeline")
    try:
        if unet_quantization != "none":
            # The pipeline's single-file loader takes no quantization_config; its UNet's loader does.
            kwargs["unet"] = UNet2DConditionModel.from_single_file(
                str(file), subfolder="unet", **kwargs,
                quantization_config=quantization.diffusers_config(unet_quantization, weight_dtype))
        return StableDiffusionXLPipeline.from_single_file(str(file), **kwargs)
    except _LOAD_ERRORS as e:
        # Configs from the hub (diffusers' default for the file, or a hub id) are out of reach offline.
        hint = ("" if config is not None and Path(config).expanduser().is_dir() else
                "; offline, give --model_config a diffusers SDXL folder (for the model configs and tokenizers)")
        raise UserError(f"could not load the SDXL checkpoint {file}: {e}{hint}") from e


def load_sdxl(path_or_id_or_single_file: str | Path, *, revision: str | None = None,
              variant: str | None = None, config: str | Path | None = None,
              weight_dtype: torch.dtype = torch.float32, unet_quantization: str = "none",
              unet: bool = True) -> SDXLComponents:
    """Load an SDXL pipeline's components, all in ``weight_dtype``, from a diffusers folder, a hub id
    or a single-file checkpoint (``.safetensors`` / ``.ckpt``, original SGM layout).

    For a single file, ``config`` names a diffusers SDXL folder or hub id that supplies the model
    configs, tokenizers and scheduler; without it diffusers fetches them from the hub.
    ``unet_quantization`` is a :mod:`~dreamstep.models.quantization` mode for the UNet's linear layers.
    Without ``unet`` a folder or hub id leaves the UNet out (``None``; :func:`load_sdxl_unet` loads it alone);
    a single file is read whole, its UNet included.
    """
    if is_single_file(path_or_id_or_single_file):
        file = check_checkpoint_file(Path(path_or_id_or_single_file).expanduser(), "SDXL checkpoint")
        return _components(_load_sdxl_single_file(file, config, weight_dtype, unet_quantization), SDXLComponents)
    name = folder_or_hub_id(path_or_id_or_single_file, SDXLComponents, "StableDiffusionXLPipeline")
    pipeline_quantization = quantization.pipeline_config({"unet": unet_quantization if unet else "none"},
                                                         weight_dtype)
    extra: dict[str, Any] = {"quantization_config": pipeline_quantization} if pipeline_quantization is not None else {}
    if not unet:
        extra["unet"] = None
    pipe = _from_pretrained(StableDiffusionXLPipeline, name, revision=revision, variant=variant,
                            **{_DTYPE_KWARG: weight_dtype}, **extra)
    return _components(pipe, SDXLComponents)


def load_sdxl_unet(path_or_id: str | Path, *, revision: str | None = None, variant: str | None = None,
                   weight_dtype: torch.dtype = torch.float32, unet_quantization: str = "none",
                   on_host: bool = False) -> torch.nn.Module:
    """The UNet alone of an SDXL diffusers folder or hub id, in ``weight_dtype``, its linear weights quantized
    as ``unet_quantization`` says; in host memory, or with an unswapped 4-bit base on the GPU
    (:func:`host_placement`)."""
    name = folder_or_hub_id(path_or_id, SDXLComponents, "StableDiffusionXLPipeline")
    load_kwargs = {_DTYPE_KWARG: weight_dtype, **host_placement(unet_quantization, on_host)}
    unet = load_or_quantize(
        UNet2DConditionModel, source_identity(name, "unet", revision, variant), unet_quantization, weight_dtype,
        load_kwargs, lambda: _from_pretrained(
            UNet2DConditionModel, name, subfolder="unet", revision=revision, variant=variant,
            quantization_config=quantization.diffusers_config(unet_quantization, weight_dtype), **load_kwargs),
        "SDXL UNet")
    quantization.keep_only_quantized_weights(unet)
    return unet


def component_identity(source: str | Path, subfolder: str, *, revision: str | None = None,
                       variant: str | None = None, extra: str = "") -> str:
    """A string naming one component's weights, for cache keys: the source, revision and variant, and for
    a local folder the size and modification time of each weight file (so replaced weights miss)."""
    parts = [str(source), subfolder, str(revision), str(variant), extra]
    folder = Path(source) / subfolder
    if folder.is_dir():
        parts.append(str(folder.resolve()))
        for file in sorted(folder.iterdir()):
            stat = file.stat()
            parts.append(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|".join(parts)
