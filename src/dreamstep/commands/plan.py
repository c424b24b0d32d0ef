"""``dreamstep plan flux|sdxl``: the memory plan of a LoRA run without training, e.g.
``dreamstep plan flux --resolution 1024 --base_quantization int8 --device_memory 16GB``."""

from __future__ import annotations

import argparse

from dreamstep.config.memory import QUANTIZATION_MODES, parse_bytes
from dreamstep.errors import UserError
from dreamstep.models import memory_plan as mp
from dreamstep.models.memory_plan import PlanOptions
from dreamstep.models.plans import Estimator, plan_report


def configure_parser(parser: argparse.ArgumentParser, key: tuple[str, ...]) -> None:
    parser.description = ("Estimate the peak device and host memory of each phase of a FLUX.1 or SDXL LoRA run "
                          "(encode, load, train, validate) before loading anything "
                          "(full-size published configs, or a local model folder's), and say which options fit "
                          "the card.")
    parser.add_argument("model", choices=("flux", "sdxl"), help="FLUX.1 LoRA or SDXL LoRA")
    parser.add_argument("--pretrained_model_name_or_path", default=None,
                        help="a local model folder to read the configs from (default: FLUX.1-dev / SDXL base 1.0)")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--train_batch_size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--lora_layers", nargs="+", default=["attention"],
                        help="FLUX LoRA layers, as train flux-lora's --lora_layers (attention, all-linear, ...)")
    parser.add_argument("--no_gradient_checkpointing", action="store_true")
    parser.add_argument("--base_quantization", choices=QUANTIZATION_MODES, default="none")
    parser.add_argument("--text_encoder_quantization", choices=QUANTIZATION_MODES, default="none")
    parser.add_argument("--encoders_on_device", action="store_true",
                        help="keep CLIP (SDXL: both text encoders) and the VAE on the device while training "
                             "(a text-encoder LoRA, no latent cache)")
    parser.add_argument("--no_validation_images", action="store_true",
                        help="validation computes only the validation loss (the VAE stays in host memory)")
    parser.add_argument("--blocks_to_swap", type=int, default=0)
    parser.add_argument("--optimizer", default="AdamW", choices=tuple(mp.OPTIMIZER_BYTES))
    parser.add_argument("--max_sequence_length", type=int, default=512, help="T5 tokens (FLUX)")
    parser.add_argument("--device_memory", default=None, help="the card's memory, e.g. 12GB (default: detected)")


def run(args: argparse.Namespace, key: tuple[str, ...]) -> None:
    device_memory = (parse_bytes(args.device_memory, "--device_memory") if args.device_memory
                     else mp.detected_device_memory())
    options = PlanOptions(resolution=args.resolution, batch_size=args.train_batch_size, rank=args.rank,
                          gradient_checkpointing=not args.no_gradient_checkpointing,
                          base_quantization=args.base_quantization,
                          text_encoder_quantization=args.text_encoder_quantization,
                          encoders_on_device=args.encoders_on_device, blocks_to_swap=args.blocks_to_swap,
                          optimizer=args.optimizer, max_sequence_length=args.max_sequence_length,
                          validation_images=not args.no_validation_images)
    estimator = Estimator(args.model, args.pretrained_model_name_or_path, args.rank, lora_layers=args.lora_layers)
    if not 0 <= args.blocks_to_swap < len(estimator.blocks):
        raise UserError(f"--blocks_to_swap {args.blocks_to_swap}: the model has {len(estimator.blocks)} blocks; "
                        f"choose 0 to {len(estimator.blocks) - 1}")
    print(plan_report(estimator, options, device_memory))

