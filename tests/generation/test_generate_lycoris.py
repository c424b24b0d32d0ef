"""LyCORIS files (LoKr, LoHa, DoRA, LoCon) in ``dreamstep generate``: each changes the image, and ``--merge`` gives
the image that the modules on the forward give (what training computed), for FLUX and SDXL."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from generation_testkit import generate, lycoris_file
from test_generate_loras import CHANGED, SAME

from dreamstep.config.lycoris import LycorisOptions

TYPES = {
    "lokr": LycorisOptions("lokr", dim=4, alpha=2.0, factor=4),
    "loha": LycorisOptions("loha", dim=4, alpha=2.0),
    "dora": LycorisOptions("lora", dim=4, alpha=2.0, dora_wd=True),
    "locon": LycorisOptions("lora", dim=4, alpha=2.0, conv_dim=2, conv_alpha=1.0),
}


@pytest.fixture(scope="module")
def base_images(tiny_flux_dev_dir: Path, tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("base")
    return {"flux": generate("flux", tiny_flux_dev_dir, out / "flux"),
            "sdxl": generate("sdxl", tiny_sdxl_dir, out / "sdxl")}


@pytest.mark.parametrize(("model_type", "kind"), [("flux", k) for k in TYPES if k != "locon"] +
                         [("sdxl", k) for k in TYPES])  # LoCon adapts convolutions: the FLUX transformer has none
def test_lycoris_file_changes_the_image_and_merges_to_the_same(model_type: str, kind: str, base_images: dict,
                                                               tiny_flux_dev_dir: Path, tiny_sdxl_dir: Path,
                                                               tmp_path: Path) -> None:
    model = tiny_flux_dev_dir if model_type == "flux" else tiny_sdxl_dir
    std = {"loha": 1.0, "dora": 0.5}.get(kind, 0.2)  # a LoHa's delta is a product of products: smaller at one std
    lora = lycoris_file(model_type, model, tmp_path / f"{kind}.safetensors", TYPES[kind], seed=5, std=std)
    adapters = generate(model_type, model, tmp_path / "adapters", "--lora", f"{lora}:0.8")
    merged = generate(model_type, model, tmp_path / "merged", "--lora", f"{lora}:0.8", "--merge")
    assert np.abs(adapters - base_images[model_type]).max() > CHANGED
    np.testing.assert_allclose(merged, adapters, atol=SAME)
