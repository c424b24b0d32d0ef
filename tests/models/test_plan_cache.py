"""The memory plan's measured passes are read back from disk when the model, the pass and the code are the same,
and measured afresh when any of them differs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dreamstep.models import memory_plan as mp
from dreamstep.models.plans import Estimator


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
