"""Shared test setup: no hub access, a fixed thread count, and tiny pipelines built once a session.

The fixtures return folders written by :func:`dreamstep.models.tiny.write_tiny_model`; tests must not
modify them (copy first if a test needs to write next to a model).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The memory plan's measured passes and the quantized bases are kept in folders of this session's, not the user's.
os.environ["DREAMSTEP_PLAN_CACHE"] = __import__("tempfile").mkdtemp(prefix="dreamstep-plan-cache-")
os.environ["DREAMSTEP_QUANTIZED_CACHE"] = __import__("tempfile").mkdtemp(prefix="dreamstep-quantized-cache-")

from pathlib import Path

import pytest
import torch

from dreamstep.notices import hide_known_notices

hide_known_notices()

from dreamstep.models.flux.tiny import build_tiny_flux, write_flux_component_files  # noqa: E402 (after the notices)
from dreamstep.models.sdxl.tiny import SINGLE_FILE_NAME  # noqa: E402
from dreamstep.models.tiny import write_tiny_model  # noqa: E402

# Two cores on the CI machine, shared by two pytest-xdist workers: one thread each avoids oversubscription
# (tiny models gain nothing from intra-op threads). A fixed count also keeps float results reproducible.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each test starts and ends with accelerate's per-process state unset, as a new ``dreamstep`` process
    does: accelerate allows one mixed precision per process, and tests train in-process."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny FLUX.1 pipeline folder without guidance embedding (like FLUX.1-schnell)."""
    return write_tiny_model("flux", tmp_path_factory.mktemp("tiny") / "flux", seed=0)


@pytest.fixture(scope="session")
def tiny_flux_dev_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny guidance-distilled FLUX.1 pipeline folder (like FLUX.1-dev)."""
    return write_tiny_model("flux", tmp_path_factory.mktemp("tiny") / "flux-dev", seed=0,
                            guidance_embeds=True)


@pytest.fixture(scope="session")
def tiny_flux_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``tiny_flux_dev_dir``'s weights as the component files ComfyUI / sd-scripts users have, by sd-scripts' flag
    names ("transformer", "clip_l", "t5xxl", "ae"), stored as the downloads are (BFL-layout transformer and ae in
    bf16, clip_l and T5 in fp16), in a folder of their own (no configs beside them); ``fp8_transformer`` and
    ``fp8_t5xxl``: fp8 copies; ``fp32_<part>``: the folder's exact weights."""
    folder = tmp_path_factory.mktemp("flux-files")
    pipe = build_tiny_flux(seed=0, guidance_embeds=True)
    files = write_flux_component_files(pipe, folder)
    for kind, dtype in (("fp8", torch.float8_e4m3fn), ("fp32", torch.float32)):
        (folder / kind).mkdir()
        written = write_flux_component_files(pipe, folder / kind, dict.fromkeys(files, dtype))
        files |= {f"{kind}_{part}": path for part, path in written.items()}
    return files


@pytest.fixture(scope="session")
def tiny_flux_kontext_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny FLUX.1 Kontext [dev] pipeline folder (a FluxKontextPipeline)."""
    return write_tiny_model("flux-kontext", tmp_path_factory.mktemp("tiny") / "flux-kontext", seed=0)


@pytest.fixture(scope="session")
def tiny_sdxl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SDXL pipeline folder that also holds the same weights as one SGM-layout file,
    ``<folder>/tiny_sdxl.safetensors`` (see ``tiny_sdxl_single_file``)."""
    return write_tiny_model("sdxl", tmp_path_factory.mktemp("tiny") / "sdxl", seed=0,
                            single_file=True)


@pytest.fixture(scope="session")
def tiny_sdxl_single_file(tiny_sdxl_dir: Path) -> Path:
    """The SGM-layout single file of ``tiny_sdxl_dir`` (like sd_xl_base_1.0.safetensors)."""
    return tiny_sdxl_dir / SINGLE_FILE_NAME


@pytest.fixture(scope="session")
def tiny_evaluators(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random DINO and CLIP folders (``dino``, ``clip``), as ``dreamstep tiny-model evaluators`` writes."""
    from dreamstep.evaluation.tiny import write_tiny_evaluators

    return write_tiny_evaluators(tmp_path_factory.mktemp("tiny") / "evaluators", seed=0)
