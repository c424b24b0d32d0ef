"""The Krea 2 family: ``tiny-model krea2`` writes a folder Krea2Pipeline loads and samples from (its caption features
several layers deep), the key tables name layers of the released 12B transformer, LoRA names tell Krea 2, and the
memory plan prices the released model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import Krea2Pipeline

from dreamstep.cli import main
from dreamstep.models.family import family_of_pipeline, get_family, guess_family
from dreamstep.models.full_size import built_released_shapes, weight_shapes
from dreamstep.models.krea2 import configs
from dreamstep.models.krea2.lora_keys import COMFYUI_PREFIX, comfyui_state_dict, released_names
from dreamstep.models.krea2.tiny import TINY_SELECT_LAYERS, build_tiny_krea2
from dreamstep.models.memory_plan import PlanOptions
from dreamstep.models.plans import Estimator
from dreamstep.models.tiny import write_tiny_model

GIB = 2**30


def test_tiny_model_loads_in_krea2_pipeline_and_samples(tmp_path: Path) -> None:
    folder = write_tiny_model("krea2", tmp_path / "tiny")
    pipe = Krea2Pipeline.from_pretrained(folder)
    assert pipe.text_encoder_select_layers == TINY_SELECT_LAYERS and not pipe.config.is_distilled
    embeds, mask = pipe.encode_prompt("a photo of sks dog", device="cpu", max_sequence_length=16)
    # The system prompt's 34 tokens are cut off: the mask counts the prompt's own tokens and the assistant's 5.
    assert embeds.shape == (1, 16, len(TINY_SELECT_LAYERS), pipe.text_encoder.config.text_config.hidden_size)
    assert int(mask.sum()) == len(pipe.tokenizer("a photo of sks dog").input_ids) + 5
    image = pipe("a photo of sks dog", height=32, width=48, num_inference_steps=2, guidance_scale=0.0,
                 max_sequence_length=16, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (48, 32)
    assert configs.is_distilled(folder) is False
    build_tiny_krea2(seed=1, distilled=True).save_pretrained(tmp_path / "turbo")
    assert configs.is_distilled(tmp_path / "turbo") and configs.is_distilled(configs.TURBO_ID)


def test_key_tables_name_every_block_layer_of_the_released_model() -> None:
    shapes = weight_shapes("krea2")
    assert shapes == built_released_shapes("krea2")
    keys = get_family("krea2").lora_keys(None)
    named = {m for entry in keys.maps for m in entry.diffusers if not m.startswith(COMFYUI_PREFIX)}
    assert named <= set(shapes)
    blocks = {n for n in shapes if n.startswith(("transformer.transformer_blocks.", "transformer.text_fusion.")) and
              "projector" not in n}
    assert blocks == named
    assert keys.by_kohya["lora_unet_blocks_27_attn_wq"].diffusers == ("transformer.transformer_blocks.27.attn.to_q",)
    assert shapes["transformer.transformer_blocks.0.attn.to_k"] == (12 * 128, 48 * 128)  # grouped key/value heads


def test_comfyui_layout_is_what_diffusers_reads_back() -> None:
    pipe = build_tiny_krea2(seed=0)
    names = released_names(pipe.transformer.config)
    state = {f"transformer.{m}.lora_{ab}.weight": torch.randn(4, 4) for m in names for ab in "AB"}
    comfy = comfyui_state_dict(state, pipe.transformer.config)
    assert "diffusion_model.blocks.0.attn.wq.lora_A.weight" in comfy
    assert "diffusion_model.txtfusion.refiner_blocks.0.mlp.down.lora_B.weight" in comfy
    back = Krea2Pipeline.lora_state_dict(comfy)
    assert set(back) == set(state)


def test_pipeline_classes_and_lora_names_tell_krea2() -> None:
    assert family_of_pipeline("Krea2Pipeline").name == "krea2"
    assert guess_family(["transformer.text_fusion.refiner_blocks.0.attn.to_q"])[0] == "krea2"
    assert guess_family(["diffusion_model.blocks.0.attn.wq"])[0] == "krea2"
    assert guess_family(["lora_unet_blocks_3_attn_gate", "lora_unet_blocks_3_attn_wq"])[0] == "krea2"


def test_full_size_plan_prices_the_released_model(capsys: pytest.CaptureFixture) -> None:
    parts = get_family("krea2").meta_components(None)
    assert round(sum(p.numel() for p in parts["transformer"].parameters()) / 1e9, 1) == 12.8
    estimator = Estimator("krea2", None, rank=16)
    bf16 = estimator(PlanOptions(resolution=512, rank=16)).total
    int8 = estimator(PlanOptions(resolution=512, rank=16, base_quantization="int8",
                                 text_encoder_quantization="int8")).total
    assert 24 * GIB < bf16 < 30 * GIB and int8 < 16 * GIB
    assert main(["plan", "krea2", "--resolution", "512", "--device_memory", "24GB"]) == 0
    assert "text_encoder (Qwen3-VL) (frozen)" in capsys.readouterr().out
