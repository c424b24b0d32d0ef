"""sdxl-lora with sd-scripts' ``--network_module lycoris.kohya --network_args algo=...`` as written: each LyCORIS
type lowers the fixed-noise loss, resumes exactly, continues from its file with --network_weights, and writes
sd-scripts' names and ``ss_network_*`` metadata; a bad LyCORIS option is one line before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from sdxl_testkit import captions_for, fixed_noise_loss, load_pixels, run_cli, write_method

TYPES = {
    # LyCORIS' default preset (full): on the tiny UNet the fixed-noise loss moves through the ResNet convolutions,
    # and attn-mlp's LoKr (18.6k parameters in Kronecker products with a random 4x4 factor) learns too slowly there
    # for 4-24 steps to outweigh the seed's draw of noise (README, "LoKr, LoHa, DoRA and LoCon").
    "lokr": ("algo=lokr", "factor=4"),
    "loha": ("algo=loha", "preset=attn-mlp", "use_scalar=True"),  # LyCORIS' scalar init: the update starts larger
    "locon": ("algo=locon", "conv_dim=2", "conv_alpha=1"),
    "dora": ("algo=lora", "dora_wd=True", "preset=attn-mlp"),
}
KEYS = {"lokr": ".lokr_w1", "loha": ".hada_w1_a", "locon": ".lora_down.weight", "dora": ".dora_scale"}


def _base(tiny_sdxl_dir: Path, toml: Path, kind: str, *extra_args: str) -> tuple:
    return ("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config", toml,
            "--network_module", "lycoris.kohya", "--network_dim", "4", "--network_alpha", "4", "--network_args",
            *TYPES[kind], *extra_args, "--learning_rate", "3e-2", "--seed", "5", "--log_with", "none",
            "--network_train_unet_only")


@pytest.mark.parametrize("kind", list(TYPES))
def test_each_type_lowers_the_loss_and_continues_from_its_file(kind: str, tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    toml = write_method(tmp_path, "class_tokens")  # 8 samples, batch 2: 4 steps an epoch
    out = tmp_path / "out"
    assert run_cli(*_base(tiny_sdxl_dir, toml, kind), "--output_dir", out, "--max_train_steps", "4") == 0
    trained = load_file(out / "last.safetensors")
    assert any(k.endswith(KEYS[kind]) for k in trained)
    assert all(k.startswith("lora_unet_") for k in trained)  # sd-scripts' SGM names
    with safe_open(out / "last.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_module"] == "lycoris.kohya"
    network_args = json.loads(meta["ss_network_args"])
    assert network_args["algo"] == TYPES[kind][0].split("=")[1]
    if kind == "dora":  # one magnitude per input column, said in the metadata sd-scripts rebuilds the network from
        assert network_args["wd_on_output"] == "False"
        assert all(v.shape[0] == 1 for k, v in trained.items() if k.endswith(".dora_scale"))
    pixels, captions = load_pixels(tmp_path / "butterfly"), captions_for("class_tokens")
    after = fixed_noise_loss(pixels, captions, out / "last.safetensors", as_generate=True)
    assert after < fixed_noise_loss(pixels, captions)

    more = tmp_path / "more"  # --network_weights: the next run starts from the file (a step at lr ~0 keeps it)
    assert run_cli(*_base(tiny_sdxl_dir, toml, kind), "--output_dir", more, "--max_train_steps", "1",
                   "--learning_rate", "1e-12", "--network_weights", out / "last.safetensors") == 0
    continued = load_file(more / "last.safetensors")
    for key, value in trained.items():
        torch.testing.assert_close(continued[key], value, atol=1e-6, rtol=0, msg=key)
    if kind in ("loha", "locon"):  # the rank shapes their tensors: another one is refused before anything is written
        refused = tmp_path / "refused"
        assert run_cli(*_base(tiny_sdxl_dir, toml, kind), "--output_dir", refused, "--network_dim", "8",
                       "--network_weights", out / "last.safetensors") == 2
        assert not refused.exists()


@pytest.mark.parametrize("kind", ["lokr", "dora"])  # LoKr's alpha buffers; DoRA's trained magnitudes
def test_resume_is_exact(kind: str, tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    fewer_modules = ("preset=attn-mlp",) if kind == "lokr" else ()  # resume needs no convolutions: faster
    base = _base(tiny_sdxl_dir, write_method(tmp_path, "captions"), kind, *fewer_modules)
    assert run_cli(*base, "--output_dir", tmp_path / "straight", "--max_train_steps", "3") == 0
    interrupted = tmp_path / "interrupted"
    assert run_cli(*base, "--output_dir", interrupted, "--max_train_steps", "1", "--save_state") == 0
    assert run_cli(*base, "--output_dir", interrupted, "--max_train_steps", "3", "--resume", "latest") == 0
    straight = load_file(tmp_path / "straight" / "last.safetensors")
    resumed = load_file(interrupted / "last.safetensors")
    assert straight.keys() == resumed.keys()
    for key, value in straight.items():
        assert torch.equal(value, resumed[key]), key


@pytest.mark.parametrize(("args", "expected"), [
    (("algo=ia3",), "algo=ia3: dreamstep trains lora, locon, loha, lokr"),
    (("algo=lokr", "factr=8"), "unknown key 'factr' (did you mean 'factor'?)"),
    (("algo=lokr", "factor=0"), "factor=0: the LoKr factor"),
    (("preset=attn_mlp",), "preset=attn_mlp: use one of LyCORIS' presets"),
    (("algo=lokr", "dropout=0.1"), "LyCORIS' lokr has no plain dropout"),
    (("dora_wd=yes please",), "dora_wd=yes please is not true or false"),
    (("train_norm=True",), "'train_norm' is a LyCORIS option dreamstep does not support"),
])
def test_bad_lycoris_option_is_one_line(args: tuple[str, ...], expected: str, tmp_path: Path, capsys) -> None:
    code = run_cli("train", "sdxl-lora", "--pretrained_model_name_or_path", tmp_path / "no-model", "--dataset_config",
                   write_method(tmp_path, "captions"), "--output_dir", tmp_path / "o",
                   "--network_module", "lycoris.kohya", "--network_args", *args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "o").exists()


def test_a_dora_on_a_quantized_unet_is_one_line(tmp_path: Path, capsys) -> None:
    code = run_cli("train", "sdxl-lora", "--pretrained_model_name_or_path", tmp_path / "no-model", "--dataset_config",
                   write_method(tmp_path, "captions"), "--output_dir", tmp_path / "o", "--fp8_base",
                   "--network_module", "lycoris.kohya", "--network_args", "dora_wd=True")
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith("error: --fp8_base with --network_args dora_wd=True: DoRA divides by the norm"), err
    assert not (tmp_path / "o").exists()
