"""The quantized base is quantized at the first start and read back at the next (safetensors through diffusers'
own save_pretrained / from_pretrained), gives the same weights and the same output, and a damaged, replaced or
disabled cache never stops a run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dreamstep.models import quantization
from dreamstep.models.loading import load_flux_transformer


def _load(folder: Path, mode: str = "int8") -> torch.nn.Module:
    return load_flux_transformer(str(folder), weight_dtype=torch.bfloat16, base_quantization=mode)


def _forward(transformer: torch.nn.Module) -> torch.Tensor:
    config = transformer.config
    generator = torch.Generator().manual_seed(0)
    tokens, text = 16, 8
    with torch.no_grad():
        return transformer(
            hidden_states=torch.randn(1, tokens, config.in_channels, generator=generator, dtype=torch.bfloat16),
            encoder_hidden_states=torch.randn(1, text, config.joint_attention_dim, generator=generator,
                                              dtype=torch.bfloat16),
            pooled_projections=torch.randn(1, config.pooled_projection_dim, generator=generator, dtype=torch.bfloat16),
            timestep=torch.tensor([0.5]), img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(text, 3),
            guidance=torch.tensor([3.5]) if config.guidance_embeds else None).sample


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "quantized"
    monkeypatch.setenv("DREAMSTEP_QUANTIZED_CACHE", str(folder))
    return folder


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if not p.name.startswith(".")) if cache.is_dir() else []


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_the_second_start_reads_the_quantized_base_back(tiny_flux_dev_dir: Path, cache: Path, capsys,
                                                         mode: str) -> None:
    first = _load(tiny_flux_dev_dir, mode)
    (entry,) = _entries(cache)
    assert "kept the" in capsys.readouterr().out
    assert list(entry.glob("*.safetensors")) and not list(entry.glob("*.bin"))
    again = _load(tiny_flux_dev_dir, mode)
    assert "quantized at an earlier start" in capsys.readouterr().out
    linear = again.transformer_blocks[0].attn.to_q.weight
    assert type(linear) is type(first.transformer_blocks[0].attn.to_q.weight) and type(linear) is not torch.Tensor
    assert torch.equal(quantization.dequantized(linear), quantization.dequantized(
        first.transformer_blocks[0].attn.to_q.weight))
    assert torch.equal(_forward(again), _forward(first))


def test_replaced_weights_are_quantized_afresh(tiny_flux_dev_dir: Path, cache: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_flux_dev_dir, model)
    _load(model)
    weights = next((model / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())  # the same bytes, written again: a newer file
    _load(model)
    assert len(_entries(cache)) == 2


def test_a_damaged_entry_is_quantized_again_and_replaced(tiny_flux_dev_dir: Path, cache: Path, capsys) -> None:
    expected = _forward(_load(tiny_flux_dev_dir))
    (entry,) = _entries(cache)
    for weights in entry.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()
    assert torch.equal(_forward(_load(tiny_flux_dev_dir)), expected)
    assert "did not load" in capsys.readouterr().out
    assert torch.equal(_forward(_load(tiny_flux_dev_dir)), expected)
    assert "quantized at an earlier start" in capsys.readouterr().out


def test_none_keeps_nothing_and_an_unwritable_folder_only_costs_time(tiny_flux_dev_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DREAMSTEP_QUANTIZED_CACHE", "none")
    _load(tiny_flux_dev_dir)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("DREAMSTEP_QUANTIZED_CACHE", str(blocked / "quantized"))
    assert _load(tiny_flux_dev_dir) is not None
    assert blocked.read_text() == "not a folder"
