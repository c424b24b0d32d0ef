"""The memory plan's figures are read back from disk when the model, the pass and the code are the same (a LoRA
run's plan then builds no module), and computed afresh when any of them differs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dreamstep.models import memory_plan as mp
from dreamstep.models.family import get_family
from dreamstep.models.plans import Estimator, options_that_fit


def _counting_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    measured: list[int] = []
    real = mp.pass_peak

    def counted(*args, **kwargs) -> int:
        measured.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mp, "pass_peak", counted)
    return measured


def test_a_second_plan_of_the_same_run_reads_the_passes_back(tiny_flux_dev_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DREAMSTEP_PLAN_CACHE", str(tmp_path))
    measured = _counting_passes(monkeypatch)
    options = mp.PlanOptions(resolution=64, rank=4, max_sequence_length=16, weight_dtype=mp.torch.float32)
    first = Estimator("flux", str(tiny_flux_dev_dir), rank=4, device_type="cpu")(options)
    passes = len(measured)
    assert passes > 0 and any(tmp_path.iterdir())
    again = Estimator("flux", str(tiny_flux_dev_dir), rank=4, device_type="cpu")(options)
    assert len(measured) == passes and again == first

    Estimator("flux", str(tiny_flux_dev_dir), rank=8, device_type="cpu")(options)  # another LoRA: other passes
    assert len(measured) > passes


def test_an_unwritable_cache_only_means_measuring(tiny_flux_dev_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("DREAMSTEP_PLAN_CACHE", str(blocked / "plans"))
    options = mp.PlanOptions(resolution=64, rank=4, max_sequence_length=16, weight_dtype=mp.torch.float32)
    plan = Estimator("flux", str(tiny_flux_dev_dir), rank=4, device_type="cpu")(options)
    assert plan.total > 0


def _counting_builds(monkeypatch: pytest.MonkeyPatch, family: str) -> list[str]:
    built: list[str] = []
    owner = get_family(family)
    real = owner.meta_components

    def counted(folder, variant=None):
        built.append(str(folder))
        return real(folder, variant)

    monkeypatch.setattr(owner, "meta_components", counted)
    return built


def test_a_plan_read_back_builds_no_module(tiny_flux_dev_dir: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights' sizes, the swapped blocks and the LoRA's count come back with the passes: the second plan
    of a LoRA run, with the search for options that fit, builds nothing on the meta device."""
    monkeypatch.setenv("DREAMSTEP_PLAN_CACHE", str(tmp_path))
    built = _counting_builds(monkeypatch, "flux")
    options = mp.PlanOptions(resolution=64, rank=4, max_sequence_length=16, blocks_to_swap=1,
                             base_quantization="int8", weight_dtype=mp.torch.float32)

    def plan_and_search() -> tuple:
        estimator = Estimator("flux", str(tiny_flux_dev_dir), rank=4, device_type="cpu")
        return estimator(options), options_that_fit(estimator, options, device_memory=2**20)

    first = plan_and_search()
    assert built == [str(tiny_flux_dev_dir)]
    assert plan_and_search() == first and len(built) == 1


def test_a_changed_config_is_planned_afresh(tiny_flux_dev_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DREAMSTEP_PLAN_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_flux_dev_dir, folder)
    options = mp.PlanOptions(resolution=64, rank=4, max_sequence_length=16, weight_dtype=mp.torch.float32)
    before = Estimator("flux", str(folder), rank=4, device_type="cpu")(options)
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_single_layers": 3}))
    after = Estimator("flux", str(folder), rank=4, device_type="cpu")(options)
    assert after.phase("train").device_total > before.phase("train").device_total


def test_a_plan_read_back_imports_neither_diffusers_nor_peft(tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    """What makes ``plan`` of a model planned before take about a second rather than ten: no model library is
    imported (measured in a fresh interpreter)."""
    env = {**os.environ, "DREAMSTEP_PLAN_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    script = ("import sys\nfrom dreamstep.cli import main\n"
              f"main(['plan', 'flux', '--pretrained_model_name_or_path', {str(tiny_flux_dev_dir)!r}, '--resolution', "
              "'64', '--device_memory', '1GB'])\n"
              "print(sorted(m for m in ('diffusers', 'peft', 'transformers') if m in sys.modules))")
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    assert runs[0].stdout.splitlines()[-1] != "[]"  # the first plan builds the modules
    assert runs[1].stdout.splitlines()[-1] == "[]"
    assert runs[1].stdout.splitlines()[:-1] == runs[0].stdout.splitlines()[:-1]
