"""FLUX.1 from component files (flux1 / ae / clip_l / t5xxl .safetensors as ComfyUI and sd-scripts keep them):
the same weights as the diffusers folder, fp8 storage kept as the fp8 base, configs from the files, and one line
for every wrong file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
from safetensors.torch import load_file, save_file
from torchao.quantization import Float8Tensor

from dreamstep.errors import UserError
from dreamstep.models import published_configs
from dreamstep.models.flux.files import (
    FileHeader,
    FluxFiles,
    guidance_embeds,
    published_transformer_config,
    resolve_base,
    transformer_from_bfl,
    transformer_to_bfl,
)
from dreamstep.models.loading import load_flux, load_flux_transformer


def _files(paths: dict[str, Path], **replace: Path) -> FluxFiles:
    return FluxFiles(**{part: replace.get(part, paths[part]) for part in ("transformer", "clip_l", "t5xxl", "ae")})


def test_component_files_load_the_weights_of_the_folder(tiny_flux_dev_dir: Path,
                                                         tiny_flux_files: dict[str, Path]) -> None:
    folder = load_flux(tiny_flux_dev_dir)
    files = load_flux(tiny_flux_dev_dir, files=_files(tiny_flux_files))
    # Each file holds the folder's weights rounded to its storage dtype (transformer and ae bf16, clip_l and
    # t5xxl fp16); the loader reads them back exactly.
    for name, stored in (("transformer", torch.bfloat16), ("vae", torch.bfloat16), ("text_encoder", torch.float16),
                         ("text_encoder_2", torch.float16)):
        expected, loaded = getattr(folder, name).state_dict(), getattr(files, name).state_dict()
        assert expected.keys() == loaded.keys(), name
        assert all(torch.equal(loaded[k], v.to(stored).float()) for k, v in expected.items()), name
    assert files.tokenizer_2.model_max_length == folder.tokenizer_2.model_max_length


def test_an_fp8_transformer_file_is_the_fp8_base(tiny_flux_dev_dir: Path, tiny_flux_files: dict[str, Path]) -> None:
    parts = load_flux(tiny_flux_dev_dir, weight_dtype=torch.bfloat16,
                      files=_files(tiny_flux_files, transformer=tiny_flux_files["fp8_transformer"],
                                   t5xxl=tiny_flux_files["fp8_t5xxl"]))
    linears = [m for m in parts.transformer.modules() if type(m) is torch.nn.Linear]
    # Every linear weight stays 8-bit (torchao's fp8 tensor): no bf16 copy of the model to move to a device.
    assert linears and all(isinstance(m.weight, Float8Tensor) for m in linears)
    assert all(p.dtype.itemsize == 2 for p in parts.text_encoder_2.parameters())  # fp8 T5 read as bf16
    assert not any(p.dtype.itemsize == 1 for p in parts.transformer.parameters() if not isinstance(p, Float8Tensor))
    bsz, tokens = 1, 16
    out = parts.transformer(hidden_states=torch.randn(bsz, tokens, 64, dtype=torch.bfloat16),
                            timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
                            pooled_projections=torch.randn(bsz, 32, dtype=torch.bfloat16),
                            encoder_hidden_states=torch.randn(bsz, 8, 32, dtype=torch.bfloat16),
                            txt_ids=torch.zeros(8, 3), img_ids=torch.zeros(tokens, 3), return_dict=False)[0]
    assert out.shape == (bsz, tokens, 64) and torch.isfinite(out).all()


def test_our_bfl_layout_is_the_one_diffusers_reads_at_full_size() -> None:
    # FLUX.1-dev on the meta device; each tensor stands in as its row numbers (one column), so diffusers' converter
    # (which splits fused rows at FLUX.1's width) and ours are compared value by value without 12B weights.
    with torch.device("meta"):
        full = FluxTransformer2DModel(**published_configs.FLUX_DEV_TRANSFORMER)
    rows = {k: torch.arange(v.shape[0]).reshape(-1, 1) + 10**6 * i
            for i, (k, v) in enumerate(full.state_dict().items())}
    bfl = transformer_to_bfl(rows, full.config)
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    ours = transformer_from_bfl(dict(bfl), full.config)
    assert theirs.keys() == ours.keys() == rows.keys()
    assert all(torch.equal(theirs[k], rows[k]) and torch.equal(ours[k], rows[k]) for k in rows)
    header = FileHeader(Path("flux1-dev.safetensors"), {k: tuple(v.shape) for k, v in bfl.items()}, {})
    assert published_transformer_config(header)["guidance_embeds"] is True and guidance_embeds(header)
    schnell = FileHeader(header.path, {k: s for k, s in header.shapes.items() if not k.startswith("guidance_in")}, {})
    assert published_transformer_config(schnell)["guidance_embeds"] is False


def test_files_alone_need_the_published_configs_or_model_config(tiny_flux_files: dict[str, Path],
                                                                tiny_flux_dev_dir: Path) -> None:
    paths = {part: str(tiny_flux_files[part]) for part in ("clip_l", "t5xxl", "ae")}
    base = resolve_base(str(tiny_flux_files["transformer"]), **paths)
    assert base.source is None  # no model_index.json beside the files
    with pytest.raises(UserError, match="is not FLUX.1-dev or -schnell as published .* give --model_config"):
        load_flux(base.source, files=base.files)
    with pytest.raises(UserError, match="comes without its other parts: give --clip_l, --t5xxl, --ae"):
        resolve_base(str(tiny_flux_files["transformer"]))
    with_config = resolve_base(str(tiny_flux_files["transformer"]), model_config=str(tiny_flux_dev_dir))
    assert with_config.source == str(tiny_flux_dev_dir) and with_config.files.clip_l is None


def test_a_schnell_config_for_a_dev_file_is_named(tiny_flux_dir: Path, tiny_flux_files: dict[str, Path]) -> None:
    with pytest.raises(UserError, match="is FLUX.1-dev .* but the configs of .* are FLUX.1-schnell"):
        load_flux(tiny_flux_dir, files=FluxFiles(transformer=tiny_flux_files["transformer"]))


def test_every_wrong_file_gets_one_line_naming_its_flag(tiny_flux_files: dict[str, Path], tiny_flux_dev_dir: Path,
                                                        tiny_sdxl_single_file: Path, tmp_path: Path) -> None:
    lora = tmp_path / "lora.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 32)}, str(lora))
    truncated = tmp_path / "flux1-dev.safetensors"
    truncated.write_bytes(tiny_flux_files["transformer"].read_bytes()[:5000])
    cases = [
        (dict(ae=str(tiny_sdxl_single_file)), "--ae .* is an SDXL \\(or SD\\) checkpoint, not the FLUX.1 autoencoder"),
        (dict(clip_l=str(tiny_flux_files["t5xxl"])), "--clip_l .* is a T5 encoder, not a CLIP-L text encoder"),
        (dict(t5xxl=str(tiny_flux_files["clip_l"])), "--t5xxl .* is a CLIP text encoder of width 32, not a T5"),
        (dict(ae=str(tmp_path / "missing.safetensors")), "--ae .*missing.safetensors does not exist"),
    ]
    for flags, message in cases:
        with pytest.raises(UserError, match=message):
            resolve_base(str(tiny_flux_files["transformer"]), model_config=str(tiny_flux_dev_dir), **flags)
    for base, message in ((lora, "--pretrained_model_name_or_path .*lora.safetensors is a LoRA, not a FLUX.1 "
                                 "transformer"),
                          (truncated, "--pretrained_model_name_or_path .* cannot be read as safetensors .* "
                                      "re-download it")):
        with pytest.raises(UserError, match=message):
            resolve_base(str(base), model_config=str(tiny_flux_dev_dir))


def _write_gguf(source: Path, path: Path) -> Path:
    """``source``'s tensors as a GGUF file, as the published flux1-dev-Q8_0.gguf: matrices in Q8_0 (blocks of 32
    along a row), the rest in fp32; written by the gguf package, offline."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(str(path), arch="flux")
    for key, tensor in load_file(source).items():
        values = tensor.float().numpy()
        if values.ndim == 2 and values.shape[1] % 32 == 0:
            packed = quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(key, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(key, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_transformer_loads_quantized_through_diffusers(tiny_flux_dev_dir: Path,
                                                              tiny_flux_files: dict[str, Path], tmp_path: Path) -> None:
    from diffusers.quantizers.gguf.utils import GGUFLinear

    gguf_file = _write_gguf(tiny_flux_files["fp32_transformer"], tmp_path / "flux1-Q8_0.gguf")
    base = resolve_base(str(gguf_file), model_config=str(tiny_flux_dev_dir))
    quantized = load_flux_transformer(base.source, transformer_single_file=base.files.transformer,
                                      weight_dtype=torch.bfloat16)
    assert isinstance(quantized.transformer_blocks[0].attn.to_q, GGUFLinear)
    reference = load_flux_transformer(tiny_flux_dev_dir, weight_dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 64, generator=generator).bfloat16(), timestep=torch.tensor([0.5]),
                  guidance=torch.tensor([3.5]), pooled_projections=torch.randn(1, 32, generator=generator).bfloat16(),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=generator).bfloat16(),
                  txt_ids=torch.zeros(8, 3), img_ids=torch.zeros(16, 3), return_dict=False)
    expected, found = reference(**inputs)[0].float(), quantized(**inputs)[0].float()
    # Q8_0 keeps about 2 decimal digits per weight: close to the bf16 model, far closer than the output's scale.
    assert (found - expected).abs().mean() < 0.05 * expected.abs().mean()


@pytest.mark.parametrize("damage", ["key-value count", "tensor count", "truncated"])
def test_a_gguf_with_a_damaged_header_is_one_line(damage: str, tiny_flux_dev_dir: Path,
                                                  tiny_flux_files: dict[str, Path], tmp_path: Path) -> None:
    """The magic says GGUF, the header after it is damaged (the gguf reader raised IndexError or KeyError)."""
    data = _write_gguf(tiny_flux_files["fp32_transformer"], tmp_path / "whole.gguf").read_bytes()
    # The header: magic, version (u32), tensor count (u64), key-value count (u64).
    damaged = {"key-value count": data[:16] + (10**6).to_bytes(8, "little") + data[24:],
               "tensor count": data[:8] + (len(data)).to_bytes(8, "little") + data[16:],
               "truncated": data[:200]}[damage]
    (tmp_path / "flux1-Q8_0.gguf").write_bytes(damaged)
    with pytest.raises(UserError, match=r"^--pretrained_model_name_or_path .*flux1-Q8_0.gguf cannot be read as GGUF "
                                        r"\(.*\): a truncated or damaged download\? re-download it$"):
        resolve_base(str(tmp_path / "flux1-Q8_0.gguf"), model_config=str(tiny_flux_dev_dir))
