"""The `dreamstep` command: help everywhere, unknown commands suggested, errors as one line."""

import json
import re
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("group", ["train", "generate"])
def test_a_group_lists_its_subcommands(group, capsys):
    assert main([group, "--help"]) == 0
    out = capsys.readouterr().out
    assert all(" ".join(key) in out for key in COMMANDS if key[0] == group)


HEAVY = ("torch", "diffusers", "peft", "transformers", "accelerate")
_PROBE = """
import sys
from pathlib import Path
from dreamstep.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as done:
    code = done.code
print(code, sorted(m for m in {heavy!r} if m in sys.modules))
"""


@pytest.mark.parametrize("argv", [["--help"], ["--no_such_flag", "1"], ["--seed", "-1"]],
                         ids=["help", "typo", "bad-value"])
@pytest.mark.parametrize("key", [k for k, c in COMMANDS.items() if c.options], ids=" ".join)
def test_help_typos_and_bad_values_answer_before_torch_loads(key, argv):
    """`train flux-lora --help` took 6-13 s because torch, diffusers and peft loaded first: none may load
    before the flags are checked."""
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY), *key, *argv],
                          capture_output=True, text=True, timeout=60)
    expected_code = 0 if argv == ["--help"] else 2
    assert proc.stdout.splitlines()[-1] == f"{expected_code} []", proc.stdout + proc.stderr
    if expected_code:
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")


@pytest.mark.parametrize("key, flag, hint", [
    (("train", "flux-lora"), "--learning_rat", "--learning_rate"),
    (("train", "sdxl-lora"), "--resume_from_checkpoint", "--resume"),
    (("train", "flux-lora"), "--resume", "--resume_from_checkpoint"),
])
def test_an_unknown_flag_gets_one_line_with_a_suggestion(key, flag, hint, capsys):
    assert main([*key, flag, "x"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: unknown flag {flag} (did you mean '{hint}'?); run 'dreamstep {' '.join(key)} --help' " \
                  "for the list\n"


def test_a_negative_number_after_a_space_is_a_value(capsys):
    assert main(["train", "flux-lora", "--learning_rate", "-1e-4"]) == 2
    assert capsys.readouterr().err == "error: --learning_rate must be positive (got -0.0001)\n"


@pytest.mark.parametrize("key", [k for k, c in COMMANDS.items() if c.options], ids=" ".join)
def test_help_is_written_for_users(key, capsys):
    """No docstring markup, no references to our design documents, each default said once."""
    with pytest.raises(SystemExit):
        main([*key, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "``" not in text and not re.search(r":(mod|func|class|meth):`", text)
    assert not re.search(r"seed[- ]?0\d\d", text, re.IGNORECASE)
    assert not re.search(r"\(default: [^)]*\) \(default:", text)


def test_shipped_configs_do_not_cite_design_documents():
    for path in (Path(__file__).resolve().parents[1] / "configs").glob("*.toml"):
        assert not re.search(r"seed[- ]?0\d\d", path.read_text(), re.IGNORECASE), path.name


@pytest.mark.parametrize("spelling", ["--guidance_embeds", "--guidance-embeds"])
def test_tiny_model_takes_the_flag_spelling_of_every_other_command(spelling, tmp_path, capsys):
    assert main(["tiny-model", "flux", str(tmp_path / "flux"), spelling]) == 0
    config = json.loads((tmp_path / "flux" / "transformer" / "config.json").read_text())
    assert config["guidance_embeds"] is True


def test_eval_takes_the_trainers_names_for_its_metrics(tmp_path, capsys):
    """The trainers call them --eval_metrics and --eval_best_by; eval --metrics and --best_by."""
    argv = ["eval", "flux", "--model", str(tmp_path), "--weights", str(tmp_path / "x.safetensors"), "--prompt", "x",
            "--output_dir", str(tmp_path / "out")]
    assert main([*argv, "--eval_metrics", "clip_t,clip_x"]) == 2
    assert "error: --metrics: unknown metric 'clip_x'" in capsys.readouterr().err
    assert main([*argv, "--eval_metrics", "clip_t", "--eval_best_by", "dino"]) == 2
    assert "error: --best_by dino: not among --metrics (clip_t)" in capsys.readouterr().err
    toml = tmp_path / "eval.toml"
    toml.write_text('eval_metrics = ["clip_t"]\neval_best_by = "dino"\n')
    assert main([*argv, "--config", str(toml)]) == 2
    assert "error: --best_by dino: not among --metrics (clip_t)" in capsys.readouterr().err


def test_commands_give_the_cuda_allocator_expandable_segments_unless_the_user_configured_it(monkeypatch, capsys):
    """Set before the command runs, so before anything initialises CUDA; a setting of the user's stays."""
    import os

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert main(["plan", "flux", "--device_memory", "lots"]) == 2  # any command: this one stops at its flag
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert main(["plan", "flux", "--device_memory", "lots"]) == 2
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert main(["plan", "flux", "--device_memory", "lots"]) == 2
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert capsys.readouterr().err.count("error: --device_memory 'lots' is not a memory size") == 3
