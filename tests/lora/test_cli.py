"""``dreamstep convert lora`` and ``dreamstep lora info`` from the command line, and the one-line errors a
user gets for a broken file, an unknown key layout and a LoRA for another model."""

from __future__ import annotations

import pickle

import pytest
import torch
from lora_testkit import MINDSPORE_DIR
from safetensors.torch import save_file

from dreamstep.cli import main
from dreamstep.lora.convert import LoraWeights, kohya_state_dict, read_lora
from dreamstep.lora.io import write_lora_file

MS_FP32 = MINDSPORE_DIR / "mindspore_lora_fp32.ckpt"


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _error(capsys, *argv) -> str:
    code, _, err = _run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _kohya_flux(path, block: int = 0):
    g = torch.Generator().manual_seed(0)
    modules = {f"lora_unet_double_blocks_{block}_img_attn_proj": LoraWeights(torch.randn(4, 32, generator=g),
                                                                            torch.randn(32, 4, generator=g), 2.0),
               "lora_unet_single_blocks_0_linear1": LoraWeights(torch.randn(8, 32, generator=g),
                                                               torch.randn(224, 8, generator=g), 8.0)}
    write_lora_file(path, kohya_state_dict(modules), {"ss_network_dim": "4", "ss_base_model_version": "flux1"},
                    "safetensors")
    return path


def test_convert_mindspore_to_diffusers_bf16(capsys, tmp_path):
    out = tmp_path / "lora.safetensors"
    code, stdout, _ = _run(capsys, "convert", "lora", MS_FP32, out, "--to", "diffusers", "--dtype", "bf16")
    assert code == 0 and "mindspore-sdxl (mindspore)" in stdout and "diffusers-sdxl (safetensors), 4 modules" in stdout
    lora = read_lora(out)
    assert {m.down.dtype for m in lora.modules.values()} == {torch.bfloat16}
    assert {m.alpha for m in lora.modules.values()} == {4.0}
    assert "unet.mid_block.attentions.0.proj_in" in lora.modules
    assert lora.metadata["dreamstep_converted_from"] == "mindspore-sdxl"

    assert "exists" in _error(capsys, "convert", "lora", MS_FP32, out, "--to", "kohya")
    code, _, _ = _run(capsys, "convert", "lora", MS_FP32, out, "--to", "kohya", "--overwrite")
    assert code == 0 and read_lora(out).format == "kohya-sdxl"


@pytest.mark.parametrize("kind", ["kohya-flux", "diffusers-flux", "kohya-sdxl", "diffusers-sdxl", "mindspore-sdxl",
                                  "kohya-sdxl-torch"])
def test_info_on_each_format(capsys, tmp_path, kind, tiny_flux_dir, tiny_sdxl_dir):
    if kind == "mindspore-sdxl":
        path = MS_FP32
    elif kind.endswith("flux"):
        path = _kohya_flux(tmp_path / "kohya.safetensors")
        if kind == "diffusers-flux":
            assert main(["convert", "lora", str(path), str(tmp_path / "d.safetensors"), "--to", "diffusers"]) == 0
            path = tmp_path / "d.safetensors"
    else:
        layout = kind.split("-")[0]
        path = tmp_path / ("lora.ckpt" if kind.endswith("torch") else "lora.safetensors")
        assert main(["convert", "lora", str(MS_FP32), str(path), "--to", layout]) == 0
    capsys.readouterr()
    base = tiny_flux_dir if kind.endswith("flux") else tiny_sdxl_dir
    code, out, _ = _run(capsys, "lora", "info", path, "--base", base)
    assert code == 0
    assert f"format:    {kind.removesuffix('-torch')}:" in out
    if kind.endswith("flux"):
        assert "fits:      yes, every module exists with its shape" in out
    else:  # the port's sample adapts a cross-attention 32 wide; the tiny SDXL's text width is 96
        assert "fits:      NO: module 'unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k' takes " \
               "inputs of shape (32,)" in out and "the layer takes (96,)" in out
    if kind.endswith("flux"):
        # Kohya's fused single-block linear1 is four diffusers modules; each keeps rank 8 and alpha 8.
        assert f"modules:   {2 if kind == 'kohya-flux' else 5}" in out
        assert "ss_network_dim: 4" in out
        assert "rank 8  alpha 8  (scale 1)" in out
        # a diffusers-layout file of ours holds alpha / rank folded into lora_B
        assert ("rank 4  alpha 2  (scale 0.5)" if kind == "kohya-flux" else "rank 4  alpha 4  (scale 1)") in out
    else:
        assert "modules:   4" in out and "rank 4  alpha 4  (scale 1)" in out
    if kind == "kohya-sdxl-torch":
        assert "torch)" in out


@pytest.mark.parametrize("model", ["flux", "sdxl"])
def test_info_says_a_tiny_model_lora_does_not_fit_the_released_model_and_why(capsys, tmp_path, model):
    path = _kohya_flux(tmp_path / "kohya.safetensors") if model == "flux" else MS_FP32
    code, out, _ = _run(capsys, "lora", "info", path)
    assert code == 0
    fits = next(line for line in out.splitlines() if line.startswith("fits:"))
    if model == "flux":
        assert "fits:      NO: module 'transformer.transformer_blocks.0.attn.to_out.0' takes inputs of shape (32,)" \
               " (lora_down (4, 32)), the layer takes (3072,) in the FLUX.1 transformer with 19 double and 38 " \
               "single blocks (FLUX.1-dev); the LoRA was trained on a model of another size" in fits, fits
    else:
        assert "fits:      NO: module 'unet." in fits and "(SDXL base 1.0); the LoRA was trained on a model of " \
               "another size" in fits, fits
    assert "give its folder with --base" in fits


def test_truncated_safetensors_is_one_line_naming_the_file(capsys, tmp_path):
    data = _kohya_flux(tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
    line = _error(capsys, "lora", "info", tmp_path / "cut.safetensors")
    assert "cut.safetensors: not a readable safetensors file (truncated or corrupt" in line
    line = _error(capsys, "convert", "lora", tmp_path / "cut.safetensors", tmp_path / "o.safetensors",
                  "--to", "diffusers")
    assert "cut.safetensors" in line


def test_unknown_key_layout_names_the_key(capsys, tmp_path):
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    line = _error(capsys, "convert", "lora", tmp_path / "model.safetensors", tmp_path / "o.safetensors",
                  "--to", "kohya")
    assert "key 'model.diffusion_model.input_blocks.0.0.weight' is not a LoRA key" in line


def test_lora_for_another_model_names_the_module(capsys, tmp_path):
    line = _error(capsys, "convert", "lora", MS_FP32, tmp_path / "o.safetensors", "--to", "kohya", "--model", "flux")
    assert "module 'lora_unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q' has no counterpart in " \
           "FLUX.1; this LoRA looks made for SDXL" in line


def test_lora_for_a_larger_model_names_the_missing_module(capsys, tmp_path, tiny_flux_dir):
    src = _kohya_flux(tmp_path / "big.safetensors", block=5)
    line = _error(capsys, "convert", "lora", src, tmp_path / "o.safetensors", "--to", "diffusers",
                  "--base", tiny_flux_dir)
    assert "module 'lora_unet_double_blocks_5_img_attn_proj' does not exist in the target FLUX.1 transformer with " \
           "1 double and 1 single blocks" in line
    code, out, _ = _run(capsys, "lora", "info", src, "--base", tiny_flux_dir)
    assert code == 0 and "fits:      NO: module 'lora_unet_double_blocks_5_img_attn_proj'" in out


class _RunsCode:
    """Unpickles as a call to print: a stand-in for a pickle that runs code."""

    def __reduce__(self):
        return print, ("PICKLED CODE RAN",)


# A torch pickle with a .safetensors name (torch.load alone would hand it to safetensors and crash): plain
# tensors under a key that is no LoRA's, or pickled code, which is refused without running it.
_PICKLES = {
    "tensors": (lambda path: torch.save({"model.weight": torch.zeros(2, 2)}, path),
                ": key 'model.weight' is not a LoRA key"),
    "code": (lambda path: path.write_bytes(pickle.dumps(_RunsCode(), protocol=2)),
             ": the torch checkpoint holds pickled objects other than tensors, which may run code, so dreamstep "
             "does not load it; get the LoRA as a .safetensors file"),
}


@pytest.mark.parametrize("kind", list(_PICKLES))
@pytest.mark.parametrize("command", ["info", "convert", "generate"])
def test_a_pickle_named_safetensors_gets_one_line(command, kind, tmp_path, tiny_flux_dir, capsys):
    renamed = tmp_path / "renamed.safetensors"
    write, message = _PICKLES[kind]
    write(renamed)
    argv = {"info": ["lora", "info", renamed],
            "convert": ["convert", "lora", renamed, tmp_path / "out.safetensors", "--to", "kohya"],
            "generate": ["generate", "flux", "--model", tiny_flux_dir, "--prompt", "x", "--lora", renamed,
                         "--output_dir", tmp_path / "images"]}[command]
    code, out, err = _run(capsys, *argv)
    assert code == 2 and err.startswith(f"error: {renamed}{message}") and err.count("\n") == 1, err
    assert "PICKLED CODE RAN" not in out + err
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "images").exists()


def test_convert_makes_a_missing_output_folder_but_not_for_a_refused_file(tmp_path, capsys):
    source = _kohya_flux(tmp_path / "in.safetensors")
    code, _, _ = _run(capsys, "convert", "lora", source, tmp_path / "no" / "such" / "out.safetensors", "--to",
                      "diffusers")
    assert code == 0 and (tmp_path / "no" / "such" / "out.safetensors").is_file()
    (tmp_path / "junk.safetensors").write_text("not a LoRA")
    _error(capsys, "convert", "lora", tmp_path / "junk.safetensors", tmp_path / "new" / "out.safetensors", "--to",
           "diffusers")
    assert not (tmp_path / "new").exists()
    line = _error(capsys, "convert", "lora", source, source / "out.safetensors", "--to", "diffusers")
    assert line == f"error: {source / 'out.safetensors'}: {source} is not a folder (a file is in its path); choose " \
                   "another output path"


def test_a_conversion_that_fuses_or_splits_modules_says_why_the_count_changed(capsys, tmp_path):
    kohya = _kohya_flux(tmp_path / "kohya.safetensors")
    code, out, _ = _run(capsys, "convert", "lora", kohya, tmp_path / "d.safetensors", "--to", "diffusers")
    assert code == 0 and ", 5 modules\n" in out
    assert "note: 2 modules became 5: sd-scripts' FLUX layout fuses the attention's q, k and v" in out
    assert "they were split back, the weights unchanged" in out
    code, out, _ = _run(capsys, "convert", "lora", tmp_path / "d.safetensors", tmp_path / "k.safetensors",
                        "--to", "kohya")
    assert code == 0 and "note: 5 modules became 2: " in out and "they were stacked" in out
