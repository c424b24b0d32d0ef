"""LoRA files for the generation tests, made once per session (tests must not modify them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from generation_testkit import flux_lora_file, sdxl_kohya_lora_file


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The tiny models run fastest on one thread: with two, on a busy two-core machine, each op waits for the
    other thread's turn (measured: 0.4 s vs 8.5 s for one SDXL image)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def flux_lora(tiny_flux_dev_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return flux_lora_file(tiny_flux_dev_dir, tmp_path_factory.mktemp("loras"), seed=1)


@pytest.fixture(scope="session")
def flux_lora_2(tiny_flux_dev_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return flux_lora_file(tiny_flux_dev_dir, tmp_path_factory.mktemp("loras"), seed=2)


@pytest.fixture(scope="session")
def sdxl_kohya_lora(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sdxl_kohya_lora_file(tiny_sdxl_dir, tmp_path_factory.mktemp("loras") / "sdxl_kohya.safetensors", seed=3)
