"""Every TOML in configs/ loads with the schema it is written for: no stale key survives a rename."""

from __future__ import annotations

from pathlib import Path

import pytest

from dreamstep.config.flux_controlnet import FluxControlNetConfig
from dreamstep.config.flux_kontext_lora import FluxKontextLoraConfig
from dreamstep.config.flux_lora import FluxLoraConfig
from dreamstep.config.schema import build_config, load_toml
from dreamstep.config.sdxl_lora import SDXLLoraConfig
from dreamstep.data.dataset_config import parse_dataset_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TRAINING_SCHEMAS = {"demo_flux_lora": FluxLoraConfig, "flux_controlnet": FluxControlNetConfig,
                    "flux_kontext_lora": FluxKontextLoraConfig, "sdxl_lora": SDXLLoraConfig}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_config_loads(path: Path) -> None:
    if path.stem.startswith("sdxl_dataset_"):
        datasets = parse_dataset_config(load_toml(path), source=str(path))
        assert datasets and all(d.subsets for d in datasets)
    else:
        assert path.stem in TRAINING_SCHEMAS, f"{path.name}: add it to TRAINING_SCHEMAS"
        build_config(TRAINING_SCHEMAS[path.stem], toml_path=path)
