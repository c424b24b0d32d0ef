"""``dreamstep plan flux|flux-kontext|sdxl``: the memory plan of a LoRA run without training, e.g.
``dreamstep plan flux --resolution 1024 --base_quantization int8 --device_memory 16GB``; ``flux-kontext`` plans a
FLUX.1 Kontext LoRA on before/after pairs (the condition image's tokens beside the target's). A FLUX base may be
given as the files users have, as the trainers take them (``--pretrained_model_name_or_path flux1-dev.safetensors
--clip_l --t5xxl --ae``, ``--model_config``); a transformer file stored in fp8 is planned as the fp8 base."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dreamstep.config.memory import OPTIMIZER_STATE_BYTES, QUANTIZATION_MODES, parse_bytes
from dreamstep.errors import UserError
from dreamstep.models.family import all_variants, family_of_pipeline, variant_family

MAX_T5_TOKENS = 512  # FLUX.1-dev's T5 reads at most 512 tokens


def configure_parser(parser: argparse.ArgumentParser, key: tuple[str, ...]) -> None:
    parser.description = ("Estimate the peak device and host memory of each phase of a FLUX.1 or SDXL LoRA run "
                          "(encode images, encode text, load, train, validate) before loading anything "
                          "(full-size published configs, or a local model folder's), and say which options fit "
                          "the card.")
    parser.add_argument("model", choices=all_variants(), help="the model variant whose LoRA run is planned (a family's "
                                                              "variant, as tiny-model names it)")
    parser.add_argument("--pretrained_model_name_or_path", default=None,
                        help="a local model folder to read the configs from (default: FLUX.1-dev / SDXL base 1.0), "
                             "or a FLUX transformer file (flux1-dev.safetensors, an fp8 copy, a .gguf)")
    for flag, part in (("--clip_l", "CLIP-L text encoder"), ("--t5xxl", "T5-XXL encoder"), ("--ae", "autoencoder")):
        parser.add_argument(flag, default=None, help=f"FLUX: the {part} file beside a transformer file")
    parser.add_argument("--model_config", default=None,
                        help="FLUX, with a transformer file: a diffusers FLUX folder with the configs")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--train_batch_size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--lora_layers", nargs="+", default=None,
                        help="FLUX LoRA layers, as train flux-lora's --lora_layers (default attention; all-linear, "
                             "...)")
    parser.add_argument("--no_gradient_checkpointing", action="store_true")
    parser.add_argument("--cpu_offload_checkpointing", action="store_true",
                        help="the inputs checkpointing keeps wait in host memory (as train's flag)")
    parser.add_argument("--base_quantization", choices=QUANTIZATION_MODES, default="none")
    parser.add_argument("--text_encoder_quantization", choices=QUANTIZATION_MODES, default="none")
    parser.add_argument("--encoders_on_device", action="store_true",
                        help="keep CLIP (SDXL: both text encoders) and the VAE on the device while training "
                             "(a text-encoder LoRA, no latent cache)")
    parser.add_argument("--no_validation_images", action="store_true",
                        help="validation computes only the validation loss (the VAE stays in host memory)")
    parser.add_argument("--blocks_to_swap", type=int, default=0)
    parser.add_argument("--class_images_batch", type=int, default=0,
                        help="prior preservation with class images to generate, this many at a time (the trainers' "
                             "--sample_batch_size): the plan adds their phase (default 0: none to generate)")
    parser.add_argument("--optimizer", default="AdamW", choices=tuple(OPTIMIZER_STATE_BYTES))
    parser.add_argument("--max_sequence_length", type=int, default=512, help="T5 tokens (FLUX)")
    parser.add_argument("--device_memory", default=None, help="the card's memory, e.g. 12GB (default: detected)")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what no run could train with, each in one line naming the flag, before anything is built."""
    family = variant_family(args.model)
    step = family.resolution_step
    if args.resolution < step or args.resolution % step:
        raise UserError(f"--resolution {args.resolution}: give a positive multiple of {step} "
                        f"(e.g. {max(step, round(args.resolution / step) * step)})")
    for flag, value in (("--train_batch_size", args.train_batch_size), ("--rank", args.rank)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be at least 1")
    if args.class_images_batch < 0:
        raise UserError(f"--class_images_batch {args.class_images_batch}: must be 0 (no class images to generate) "
                        "or more")
    if not 1 <= args.max_sequence_length <= MAX_T5_TOKENS:  # refused for any model: no silent acceptance
        raise UserError(f"--max_sequence_length {args.max_sequence_length}: T5 reads 1 to {MAX_T5_TOKENS} tokens")
    if args.blocks_to_swap and args.no_gradient_checkpointing:
        raise UserError("--blocks_to_swap needs gradient checkpointing (the trainers refuse it without): remove "
                        "--no_gradient_checkpointing")
    if args.cpu_offload_checkpointing and args.no_gradient_checkpointing:
        raise UserError("--cpu_offload_checkpointing needs gradient checkpointing: remove --no_gradient_checkpointing")
    if args.blocks_to_swap < 0:
        raise UserError(f"--blocks_to_swap {args.blocks_to_swap}: must be 0 or more")
    if args.device_memory:
        parse_bytes(args.device_memory, "--device_memory")
    given = [flag for flag in _FILE_FLAGS if getattr(args, flag) is not None]
    if given and family.name != "flux":
        raise UserError(f"--{given[0]} is a FLUX component flag; remove it for {args.model}")
    if args.text_encoder_quantization != "none" and family.long_text_encoder is None:
        raise UserError(f"--text_encoder_quantization applies to FLUX's T5 encoder; {family.title}'s trainer keeps "
                        f"its text encoders unquantized, so remove it for {args.model}")
    if args.cpu_offload_checkpointing and family.long_text_encoder is None:  # only the FLUX trainers have it
        raise UserError(f"--cpu_offload_checkpointing is a FLUX trainers' option; remove it for {args.model}")
    if args.pretrained_model_name_or_path is not None and not _flux_files(args):
        check_model_folder(args.pretrained_model_name_or_path, args.model)


_FILE_FLAGS = ("clip_l", "t5xxl", "ae", "model_config")


def _flux_files(args: argparse.Namespace) -> bool:
    """Whether the FLUX base is given as component files (checked by resolve_base, as the trainers check them)."""
    from dreamstep.models.flux.files import is_component_file

    model = args.pretrained_model_name_or_path
    return variant_family(args.model).name == "flux" and model is not None and (
        is_component_file(model) or any(getattr(args, flag) is not None for flag in _FILE_FLAGS))


def check_model_folder(source: str, model: str) -> None:
    """A local folder must be a diffusers pipeline of ``model``'s family; a path that does not exist is an
    error, not a hub id (only ``owner/name`` with no such folder here is taken as one)."""
    path = Path(source).expanduser()
    looks_like_hub_id = source.count("/") == 1 and not source.startswith((".", "/", "~"))
    if not path.exists():
        if looks_like_hub_id:
            return
        raise UserError(f"--pretrained_model_name_or_path {source}: no such folder; give a diffusers model folder "
                        "or a hub id such as black-forest-labs/FLUX.1-dev")
    index = path / "model_index.json"
    if not index.is_file():
        raise UserError(f"--pretrained_model_name_or_path {source}: no model_index.json there; give the folder of "
                        "a diffusers pipeline")
    try:
        found = json.loads(index.read_text()).get("_class_name", "?")
    except ValueError:
        raise UserError(f"{index}: not valid JSON") from None
    wanted, owner = variant_family(model), family_of_pipeline(found)
    if owner is not wanted:
        hint = f"; plan it with 'dreamstep plan {owner.name}'" if owner is not None else ""
        raise UserError(f"--pretrained_model_name_or_path {source}: a {found} folder, not a {wanted.title} "
                        f"pipeline{hint}")
    from dreamstep.models.sources import check_pipeline_source

    check_pipeline_source(source, wanted.name)  # the parts' configs readable


def model_source(args: argparse.Namespace) -> tuple[str | None, str]:
    """The folder / hub id whose configs the plan reads, and the base quantization: a FLUX base of component files
    is resolved as the trainers resolve it (each file checked), and a transformer stored in fp8 is the fp8 base."""
    if not _flux_files(args):
        return args.pretrained_model_name_or_path, args.base_quantization
    from dreamstep.models.flux.files import read_header, resolve_base, storage_quantization

    base = resolve_base(args.pretrained_model_name_or_path, clip_l=args.clip_l, t5xxl=args.t5xxl, ae=args.ae,
                        model_config=args.model_config)
    quantization = args.base_quantization
    if base.files.transformer is not None:
        header = read_header(base.files.transformer, "--pretrained_model_name_or_path")
        quantization = storage_quantization(header, quantization)
    return base.source, quantization


def run(args: argparse.Namespace, key: tuple[str, ...]) -> None:
    check_arguments(args)
    source, base_quantization = model_source(args)
    from dreamstep.models import memory_plan as mp
    from dreamstep.models.memory_plan import PlanOptions
    from dreamstep.models.plans import Estimator, plan_report

    device_memory = (parse_bytes(args.device_memory, "--device_memory") if args.device_memory
                     else mp.detected_device_memory())
    options = PlanOptions(resolution=args.resolution, batch_size=args.train_batch_size, rank=args.rank,
                          gradient_checkpointing=not args.no_gradient_checkpointing,
                          cpu_offload_checkpointing=args.cpu_offload_checkpointing,
                          base_quantization=base_quantization,
                          text_encoder_quantization=args.text_encoder_quantization,
                          encoders_on_device=args.encoders_on_device, blocks_to_swap=args.blocks_to_swap,
                          optimizer=args.optimizer, max_sequence_length=args.max_sequence_length,
                          validation_images=not args.no_validation_images,
                          class_images_batch=args.class_images_batch,
                          image_token_multiplier=variant_family(args.model).variants[args.model])
    estimator = Estimator(variant_family(args.model).name, source, args.rank, lora_layers=args.lora_layers,
                          variant=args.model)
    print(plan_report(estimator, options, device_memory))
    if base_quantization == "nf4":
        import torch

        if not torch.cuda.is_available():
            print("note: nf4 (bitsandbytes) trains only on a CUDA GPU; this machine has none, so this plan is for "
                  "another machine")

