"""The ``dreamstep`` command. Every subcommand's flags are parsed and checked before anything heavy
(torch, diffusers, peft) is imported, so ``--help``, a typo or a bad value answers at once.

A command is either schema-driven (``options`` names its config dataclass, a torch-free module: the
parser comes from it, the config is built and checked, and only then is ``runner`` imported and called
with the config), or a module with ``configure_parser(parser, key)`` and ``run(args, key)``. A
:class:`~dreamstep.errors.UserError` becomes one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from dreamstep.command_end import command_failed
from dreamstep.config.memory import use_expandable_segments
from dreamstep.errors import UserError, did_you_mean
from dreamstep.notices import hide_known_notices, hide_transformers_progress_bars


@dataclass(frozen=True)
class Command:
    summary: str
    runner: str  # "module:function" called with the config, or a module with configure_parser and run
    options: str | None = None  # "module:Class", the config dataclass (imports nothing heavy)


# The commands of no one family; each family adds its own (``train``, ``generate``, ``eval``: ModelFamily.commands).
_SHARED_COMMANDS: dict[tuple[str, ...], Command] = {
    ("convert", "lora"): Command(
        "convert a LoRA between Kohya, diffusers and MindSpore", "dreamstep.commands.convert_lora"),
    ("lora", "info"): Command(
        "show a LoRA file's format, target, ranks and metadata", "dreamstep.commands.lora_info"),
    ("caption",): Command(
        "caption a folder of pictures: Florence-2, Qwen-VL, BLIP or a WD14 tagger", "dreamstep.commands.caption"),
    ("dataset", "from-hf"): Command(
        "turn a Hugging Face dataset into an image folder", "dreamstep.commands.dataset_from_hf"),
    ("plan",): Command(
        "estimate a LoRA run's peak device memory and what fits a card", "dreamstep.commands.plan"),
    ("tiny-model",): Command(
        "write a tiny random pipeline of any family (and evaluators, captioners) for offline tests",
        "dreamstep.commands.tiny_model"),
    ("dashboard",): Command(
        "a local web page: watch runs, compare them, check a dataset", "dreamstep.commands.dashboard"),
}
_GROUP_ORDER = ("train", "generate", "convert", "lora", "caption", "dataset", "plan", "tiny-model", "eval",
                "dashboard")


def _all_commands() -> dict[tuple[str, ...], Command]:
    from dreamstep.models.family import families

    found = dict(_SHARED_COMMANDS)
    for family in families().values():
        found.update({key: Command(*entry) for key, entry in family.commands.items()})
    return dict(sorted(found.items(), key=lambda item: _GROUP_ORDER.index(item[0][0])))


COMMANDS = _all_commands()


def _help(commands: dict[tuple[str, ...], Command], group: str | None = None) -> str:
    usage = f"dreamstep {group} SUBCOMMAND" if group else "dreamstep COMMAND [SUBCOMMAND]"
    intro = "Subcommands:" if group else f"Fine-tune {_family_titles()} (LoRA, DreamBooth, ControlNet). Commands:"
    lines = [f"usage: {usage} [options]", "", intro, ""]
    for key, command in commands.items():
        if group is None or key[0] == group:
            lines.append(f"  {' '.join(key):<26} {command.summary}")
    lines += ["", f"Run '{usage} --help' for a command's options."]
    return "\n".join(lines)


def _family_titles() -> str:
    from dreamstep.models.family import families

    titles = [family.title for family in families().values()]
    return ", ".join(titles[:-1]) + " and " + titles[-1] if len(titles) > 1 else titles[0]


def _match(argv: list[str], commands: dict[tuple[str, ...], Command]) -> tuple[str, ...] | None:
    for length in (2, 1):
        key = tuple(argv[:length])
        if key in commands:
            return key
    return None


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors as one UserError line: an unknown flag gets a did-you-mean instead of the
    usage block, and the usage is one line (the trainers have dozens of flags, listed once under options)."""

    # Flags of another tool that this command knows and does not implement: flag name -> why (a config's
    # ``refused_flags``); they are answered as such, all in one line, never taken for typos.
    refused: dict[str, str] = {}

    def error(self, message: str) -> NoReturn:
        unknown = re.match(r"unrecognized arguments: (.+)", message)
        if unknown:
            given = [t.split("=")[0] for t in unknown[1].split() if t.startswith("-")]
            refused = [f"{flag} ({self.refused[flag[2:]]})" for flag in given if flag[2:] in self.refused]
            if refused:
                raise UserError(f"{', '.join(refused)}: sd-scripts flag{'s' if len(refused) > 1 else ''} that "
                                f"{self.prog} does not support; remove {'them' if len(refused) > 1 else 'it'}")
            flag = given[0] if given else unknown[1].split()[0]
            flags = [s for action in self._actions for s in action.option_strings]
            # Another trainer's spelling of the same flag (--resume vs --resume_from_checkpoint) shares a prefix.
            same_stem = [f for f in flags if flag.startswith(f + "_") or f.startswith(flag + "_")]
            hint = f" (did you mean '{same_stem[0]}'?)" if same_stem else did_you_mean(flag, flags)
            others = f" (and {len(given) - 1} more)" if len(given) > 1 else ""
            raise UserError(f"unknown flag {flag}{hint}{others}; run '{self.prog} --help' for the list")
        raise UserError(f"{message}; run '{self.prog} --help' for the list")


_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)(e[+-]?\d+)?", re.IGNORECASE)


def attach_negative_numbers(argv: list[str]) -> list[str]:
    """``--learning_rate -1e-4`` as ``--learning_rate=-1e-4``: argparse takes ``-1e-4`` for a flag (it
    recognises only plain negative numbers), so the range check, not "expected one argument", answers."""
    joined: list[str] = []
    for token in argv:
        previous = joined[-1] if joined else ""
        if _NUMBER.fullmatch(token) and previous.startswith("--") and "=" not in previous:
            joined[-1] = f"{previous}={token}"
        else:
            joined.append(token)
    return joined


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, name) if name else loaded


def _docstring(module: str) -> str | None:
    """A module's docstring, read from its source without importing it (importing a recipe loads torch)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    text = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8")), clean=False)
    return plain_text(text) if text else None


def plain_text(text: str) -> str:
    """Docstring markup as a terminal shows it: ``--flag`` and :mod:`x` become --flag and x."""
    return re.sub(r":\w+:`~?([^`]+)`", r"\1", text).replace("``", "")


def _parser(key: tuple[str, ...], command: Command) -> argparse.ArgumentParser:
    prog = f"dreamstep {' '.join(key)}"
    is_trainer = key[0] == "train"
    # A trainer's module docstring lists its features and outputs: the best description it has.
    description = (_docstring(command.runner.partition(":")[0]) if is_trainer else None) or command.summary
    return OneLineParser(prog=prog, usage=f"{prog} [--config TOML] [options]" if is_trainer else None,
                         description=description, allow_abbrev=False,
                         formatter_class=argparse.RawDescriptionHelpFormatter)


def _run(key: tuple[str, ...], command: Command, argv: list[str]) -> None:
    parser = _parser(key, command)
    argv = attach_negative_numbers(argv)
    if command.options is None:
        hide_known_notices()
        module = _load(command.runner)
        module.configure_parser(parser, key)
        args = parser.parse_args(argv)
        module.run(args, key)
        return
    from dreamstep.config.schema import add_arguments, build_config

    options = _load(command.options)
    add_arguments(parser, options, sections=key[0] == "train")
    parser.refused = getattr(options, "refused_flags", {})
    config = build_config(options, parser.parse_args(argv))
    from dreamstep.engine.interrupt import held_while_importing

    with held_while_importing():
        hide_known_notices()
        runner = _load(command.runner)
    hide_transformers_progress_bars()
    runner(config)


def _run_to_end(key: tuple[str, ...], command: Command, args: list[str]) -> None:
    """Run a command; if it stops with an error, its unfinished run releases the output folder now (and
    removes it when the run made it and wrote nothing), not at interpreter exit: notebooks and tests run
    many commands in one process."""
    try:
        _run(key, command, args)
    except BaseException as error:
        command_failed(str(error).split("\n")[0] or type(error).__name__)
        raise
    from dreamstep.engine.process_group import leave_process_group

    leave_process_group()  # the trainer's models are out of scope now


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    key = _match(argv, COMMANDS)
    if key is None:
        groups = {k[0] for k in COMMANDS if len(k) > 1}
        if not argv or argv[0] in ("-h", "--help") or (argv[0] in groups and argv[1:2] in ([], ["-h"], ["--help"])):
            print(_help(COMMANDS, argv[0] if argv and argv[0] in groups else None))
            return 0
        if argv[0] in ("-V", "--version"):
            from dreamstep import __version__
            print(f"dreamstep {__version__}")
            return 0
        typed = " ".join(argv[:2])
        names = [" ".join(k) for k in COMMANDS]
        hint = did_you_mean(typed, names) or did_you_mean(argv[0], names)
        print(f"error: unknown command '{typed}'{hint}; run 'dreamstep --help' for the list", file=sys.stderr)
        return 2
    use_expandable_segments()  # before any command initialises CUDA
    guards = _command_guards(key)
    try:
        _run_to_end(key, COMMANDS[key], argv[len(key):])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        from dreamstep.engine.interrupt import take_abort

        take_abort()
        # A trainer's message says what was saved and the command that continues the run.
        print(str(e) or "interrupted", file=sys.stderr)
        return getattr(e, "exit_code", 130)
    except Exception as e:
        from dreamstep.engine.disk import is_disk_full
        from dreamstep.engine.interrupt import take_abort

        abort = take_abort()
        if abort is not None:  # a library turned the signal's abort into an error of its own
            print(str(abort), file=sys.stderr)
            return abort.exit_code
        if not is_disk_full(e):
            raise
        print(f"error: the disk is full ({str(e).splitlines()[0]}); free some space and run again", file=sys.stderr)
        return 2
    finally:
        guards.close()
    return 0


def _command_guards(key: tuple[str, ...]) -> contextlib.ExitStack:
    """Entered for the whole command, its error messages included: a trainer stops cleanly on a signal from its
    first line on, and no command fails because the reader of its output went away."""
    from dreamstep.closed_output import output_that_may_close
    from dreamstep.engine.interrupt import command_signals

    guards = contextlib.ExitStack()
    guards.enter_context(output_that_may_close())
    if key[0] == "train":
        guards.enter_context(command_signals())
    return guards


if __name__ == "__main__":
    sys.exit(main())
