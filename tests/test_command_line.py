"""The `dreamstep` command: help everywhere, unknown commands suggested, errors as one line."""

import subprocess
import sys

import pytest

from dreamstep.cli import COMMANDS, main


def test_top_level_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "train flux-lora" in out and "tiny-model" in out


@pytest.mark.parametrize("command", [" ".join(k) for k in COMMANDS])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([*command.split(), "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: dreamstep {command}")


def test_help_does_not_import_torch():
    code = "import sys; from dreamstep.cli import main; main(['--help']); assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0


def test_unknown_command_suggests_the_close_one(capsys):
    assert main(["train", "flux-lroa"]) == 2
    assert "did you mean 'train flux-lora'" in capsys.readouterr().err
