"""FLUX.1 LoRA conversion Kohya <-> diffusers on the tiny model: the merged weight delta of every module is
the same before and after, both directions, and diffusers' own loader gives the same image for our Kohya
file, our diffusers file, our in-memory dict and weights merged by hand."""

from __future__ import annotations

import torch
from lora_testkit import (
    SCALES,
    delta,
    inference_mode,
    loaded_image,
    merge_into,
    module_of,
    random_lora,
)

from dreamstep.lora.convert import (
    LoraWeights,
    convert_lora,
    diffusers_state_dict,
    kohya_state_dict,
    load_lora_as_diffusers,
    read_lora,
)
from dreamstep.lora.io import write_lora_file
from dreamstep.lora.layouts import diffusers_adapter_metadata
from dreamstep.models.flux.tiny import build_tiny_flux

PROMPT = "a photo of sks robot"


def _write_diffusers(modules, path):
    write_lora_file(path, diffusers_state_dict(modules), diffusers_adapter_metadata(modules), "safetensors")
    return path


def _assert_same(a: dict[str, LoraWeights], b: dict[str, LoraWeights]) -> None:
    """The same modules with the same downs and exactly the same delta (a diffusers-layout file of ours holds
    alpha / rank folded into lora_B; the test scales are powers of two, so folding is exact)."""
    assert sorted(a) == sorted(b)
    for name, m in a.items():
        assert torch.equal(m.down, b[name].down), name
        assert torch.equal(delta(m), delta(b[name])), name


def _assert_fused_deltas(kohya: dict[str, LoraWeights], ours: dict[str, LoraWeights], keys, rtol: float) -> None:
    """Each Kohya module's delta, split by rows, is the delta of its diffusers parts."""
    for entry in keys.maps:
        if entry.kohya not in kohya:
            continue
        parts = [delta(ours[n]) for n in entry.diffusers]
        torch.testing.assert_close(delta(kohya[entry.kohya]), torch.cat(parts), rtol=rtol, atol=1e-12)


def test_diffusers_to_kohya_and_back_is_exact(flux_pipe, flux_keys, tmp_path):
    ours = random_lora(flux_pipe, flux_keys, list(flux_keys.by_diffusers), seed=0)
    src = _write_diffusers(ours, tmp_path / "diffusers.safetensors")
    done = convert_lora(src, tmp_path / "kohya.safetensors", "kohya")
    assert done.target_format == "kohya-flux" and [n.split(":")[0] for n in done.notes] == ["55 modules became 48"]
    kohya = read_lora(tmp_path / "kohya.safetensors")
    assert kohya.format == "kohya-flux"
    assert {"lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_txt_mod_lin",
            "lora_unet_single_blocks_0_linear1", "lora_te1_text_model_encoder_layers_0_self_attn_q_proj",
            "lora_te3_encoder_block_0_layer_0_SelfAttention_q"} <= set(kohya.modules)
    qkv = kohya.modules["lora_unet_double_blocks_0_img_attn_qkv"]
    assert qkv.rank == sum(ours[f"transformer.transformer_blocks.0.attn.to_{p}"].rank for p in "qkv")
    _assert_fused_deltas(kohya.modules, ours, flux_keys, rtol=1e-12)

    convert_lora(tmp_path / "kohya.safetensors", tmp_path / "back.safetensors", "diffusers")
    _assert_same(read_lora(tmp_path / "back.safetensors").modules, ours)


def test_kohya_to_diffusers_and_back_is_exact(flux_pipe, flux_keys, tmp_path):
    """A Kohya LoRA as sd-scripts trains it: dense up over the whole fused rank."""
    g = torch.Generator().manual_seed(1)
    kohya = {}
    for i, entry in enumerate(flux_keys.maps):
        layers = [module_of(flux_pipe, n) for n in entry.diffusers]
        rank = 2 + i % 3
        kohya[entry.kohya] = LoraWeights(torch.randn(rank, layers[0].in_features, generator=g),
                                        torch.randn(sum(layer.out_features for layer in layers), rank, generator=g),
                                        rank * SCALES[i % 3])
    write_lora_file(tmp_path / "kohya.safetensors", kohya_state_dict(kohya), {"ss_network_dim": "4"},
                    "safetensors")
    convert_lora(tmp_path / "kohya.safetensors", tmp_path / "diffusers.safetensors", "diffusers")
    ours = read_lora(tmp_path / "diffusers.safetensors")
    assert ours.format == "diffusers-flux" and ours.metadata["ss_network_dim"] == "4"
    _assert_fused_deltas(kohya, ours.modules, flux_keys, rtol=1e-12)

    convert_lora(tmp_path / "diffusers.safetensors", tmp_path / "back.safetensors", "kohya")
    _assert_same(read_lora(tmp_path / "back.safetensors").modules, kohya)


def test_parts_with_different_scales_fold_into_up(flux_pipe, flux_keys, tmp_path):
    ours = random_lora(flux_pipe, flux_keys, list(flux_keys.by_diffusers), seed=2,
                       scale_of=lambda kohya_index, part: SCALES[part % 3])
    src = _write_diffusers(ours, tmp_path / "diffusers.safetensors")
    done = convert_lora(src, tmp_path / "kohya.safetensors", "kohya")
    assert any("lora_unet_double_blocks_0_img_attn_qkv" in note and "folded" in note for note in done.notes)
    _assert_fused_deltas(read_lora(tmp_path / "kohya.safetensors").modules, ours, flux_keys, rtol=1e-6)


def _image(pipe) -> torch.Tensor:
    return pipe(PROMPT, num_inference_steps=2, height=32, width=32, guidance_scale=3.5, max_sequence_length=32,
                output_type="pt", generator=torch.Generator().manual_seed(0)).images


def _reference_image(modules: dict[str, LoraWeights]) -> torch.Tensor:
    reference = inference_mode(build_tiny_flux(seed=0, guidance_embeds=True))
    merge_into(reference, modules)
    return _image(reference)


def test_diffusers_loads_our_files_as_the_merged_reference(flux_pipe, flux_keys, tmp_path):
    # diffusers' FLUX loader takes LoRAs on the transformer and the CLIP text encoder (not on T5).
    names = [n for n in flux_keys.by_diffusers if not n.startswith("text_encoder_2.")]
    ours = random_lora(flux_pipe, flux_keys, names, seed=3)
    src = _write_diffusers(ours, tmp_path / "diffusers.safetensors")
    convert_lora(src, tmp_path / "diffusers.pt", "diffusers")
    state_dict, _ = load_lora_as_diffusers(src, "flux")

    base = _image(flux_pipe)
    expected = _reference_image(ours)
    assert (expected - base).abs().max() > 1e-2  # the LoRA changes the image
    for source in (src, tmp_path / "diffusers.pt", state_dict):
        torch.testing.assert_close(loaded_image(flux_pipe, source, _image), expected, atol=2e-4, rtol=0)
    torch.testing.assert_close(_image(flux_pipe), base)


def test_diffusers_loads_our_kohya_file_as_the_merged_reference(flux_pipe, flux_keys, tmp_path):
    # diffusers' own Kohya FLUX reader (diffusers 0.42) covers the blocks and CLIP only: it drops the
    # embedders and the final layer (named without their 'transformer.' prefix), and it splits
    # single_blocks.N.linear1 at FLUX.1's full widths (3072, 12288), which the tiny model does not have.
    linear1 = set(flux_keys.by_kohya["lora_unet_single_blocks_0_linear1"].diffusers)
    names = [n for n in flux_keys.by_diffusers if n.startswith(("text_encoder.", "transformer.transformer_blocks.",
                                                                "transformer.single_transformer_blocks."))
             and n not in linear1]
    ours = random_lora(flux_pipe, flux_keys, names, seed=4)
    src = _write_diffusers(ours, tmp_path / "diffusers.safetensors")
    convert_lora(src, tmp_path / "kohya.safetensors", "kohya")
    torch.testing.assert_close(loaded_image(flux_pipe, tmp_path / "kohya.safetensors", _image), _reference_image(ours),
                               atol=2e-4, rtol=0)
