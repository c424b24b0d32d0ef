"""The ``dreamstep`` command. Each subcommand lives in its own module, imported only when it runs,
so ``dreamstep --help`` answers at once. A module provides ``configure_parser(parser)`` and
``run(args)``; a :class:`~dreamstep.errors.UserError` becomes one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from dreamstep.errors import UserError, did_you_mean

COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("train", "flux-lora"): ("dreamstep.recipes.flux_lora", "DreamBooth / captioned LoRA for FLUX.1"),
    ("train", "sdxl-lora"): ("dreamstep.recipes.sdxl_lora", "Kohya-compatible LoRA for SDXL"),
    ("train", "flux-controlnet"): ("dreamstep.recipes.flux_controlnet", "ControlNet for FLUX.1"),
    ("generate", "flux"): ("dreamstep.commands.generate", "generate images with FLUX.1 (+ LoRAs, ControlNet)"),
    ("generate", "sdxl"): ("dreamstep.commands.generate", "generate images with SDXL (+ LoRAs)"),
    ("convert", "lora"): ("dreamstep.commands.convert_lora", "convert a LoRA between Kohya, diffusers and MindSpore"),
    ("lora", "info"): ("dreamstep.commands.lora_info", "show a LoRA file's format, target, ranks and metadata"),
    ("dataset", "from-hf"): ("dreamstep.commands.dataset_from_hf", "turn a Hugging Face dataset into an image folder"),
    ("tiny-model",): ("dreamstep.commands.tiny_model", "write a tiny random FLUX or SDXL pipeline for offline tests"),
    ("eval", "flux"): ("dreamstep.commands.evaluate", "score FLUX LoRAs / ControlNets / checkpoints against the base model"),
    ("eval", "sdxl"): ("dreamstep.commands.evaluate", "score SDXL LoRAs / checkpoints against the base model"),
}


def _top_level_help(commands: dict[tuple[str, ...], tuple[str, str]]) -> str:
    lines = ["usage: dreamstep COMMAND [SUBCOMMAND] [options]", "",
             "Fine-tune FLUX.1 and SDXL (LoRA, DreamBooth, ControlNet). Commands:", ""]
    for key, (_, summary) in commands.items():
        lines.append(f"  {' '.join(key):<26} {summary}")
    lines += ["", "Run 'dreamstep COMMAND [SUBCOMMAND] --help' for a command's options."]
    return "\n".join(lines)


def _match(argv: list[str], commands: dict[tuple[str, ...], tuple[str, str]]) -> tuple[str, ...] | None:
    for length in (2, 1):
        key = tuple(argv[:length])
        if key in commands:
            return key
    return None


class _HideTorchvisionNotice(logging.Filter):
    """transformers announces on every start that image processors fall back to PIL without torchvision;
    dreamstep uses no transformers image processor, so the notice only hides the output that matters."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision" not in record.getMessage()


def hide_known_notices() -> None:
    """Silence start-up notices from dependencies that say nothing about the user's run."""
    logging.getLogger("transformers.utils.import_utils").addFilter(_HideTorchvisionNotice())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = COMMANDS
    key = _match(argv, commands)
    if key is None:
        if not argv or argv[0] in ("-h", "--help"):
            print(_top_level_help(commands))
            return 0
        if argv[0] in ("-V", "--version"):
            from dreamstep import __version__
            print(f"dreamstep {__version__}")
            return 0
        typed = " ".join(argv[:2])
        names = [" ".join(k) for k in commands]
        hint = did_you_mean(typed, names) or did_you_mean(argv[0], names)
        print(f"error: unknown command '{typed}'{hint}; run 'dreamstep --help' for the list", file=sys.stderr)
        return 2
    module_name, summary = commands[key]
    hide_known_notices()
    module = importlib.import_module(module_name)
    prog = f"dreamstep {' '.join(key)}"
    # The trainers have dozens of flags: list them once, under options, not again in the usage line.
    usage = f"{prog} [--config TOML] [options]" if key[0] == "train" else None
    # A trainer's module docstring lists its features and outputs: the best description it has.
    description = module.__doc__ if key[0] == "train" and module.__doc__ else summary
    parser = argparse.ArgumentParser(prog=prog, usage=usage, description=description, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.configure_parser(parser, key)
    args = parser.parse_args(argv[len(key):])
    try:
        module.run(args, key)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
