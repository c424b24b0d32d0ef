"""The DreamBooth fidelity scores on the tiny random DINO and CLIP models: the contracts users rely on
(self-similarity 1, symmetry, range, the subject's own pictures above noise) and one-line load errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dreamstep.errors import UserError
from dreamstep.evaluation.fidelity import (
    FidelityScorer,
    matched_mean_cosine,
    pairwise_mean_cosine,
    remove_identifier,
)

ROBOT_DIR = Path(__file__).resolve().parents[2] / "examples" / "robot"


@pytest.fixture(scope="module")
def scorer(tiny_evaluators: dict[str, Path]) -> FidelityScorer:
    return FidelityScorer(["dino", "clip_i", "clip_t"], dino_model=str(tiny_evaluators["dino"]),
                          clip_model=str(tiny_evaluators["clip"]))


@pytest.fixture(scope="module")
def robots() -> list[Image.Image]:
    return [Image.open(p).convert("RGB") for p in sorted(ROBOT_DIR.glob("*.png"))]


def _noise_images(count: int, size: int = 96, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def test_an_image_scores_one_against_itself(scorer: FidelityScorer, robots: list[Image.Image]) -> None:
    scorer.set_references(robots[:1])
    scores = scorer.score(robots[:1], ["a photo of sks robot"], "sks")
    assert scores["dino"] == pytest.approx(1.0, abs=1e-5)
    assert scores["clip_i"] == pytest.approx(1.0, abs=1e-5)
    assert -1.0 <= scores["clip_t"] <= 1.0


def test_image_scores_are_symmetric_and_in_range(scorer: FidelityScorer, robots: list[Image.Image]) -> None:
    a, b = robots[:3], robots[3:] + _noise_images(2)
    scorer.set_references(b)
    forward = scorer.score(a, ["x"] * len(a))
    scorer.set_references(a)
    backward = scorer.score(b, ["x"] * len(b))
    for metric in ("dino", "clip_i"):
        assert forward[metric] == pytest.approx(backward[metric], abs=1e-6)
        assert -1.0 <= forward[metric] <= 1.0
    x, y = torch.randn(4, 8), torch.randn(5, 8)
    assert pairwise_mean_cosine(x, y) == pytest.approx(pairwise_mean_cosine(y, x), abs=1e-6)
    assert matched_mean_cosine(x, x) == pytest.approx(1.0, abs=1e-6)
    assert matched_mean_cosine(x, -x) == pytest.approx(-1.0, abs=1e-6)


def test_the_subjects_own_pictures_rank_above_noise(scorer: FidelityScorer, robots: list[Image.Image]) -> None:
    scorer.set_references(robots)
    same = scorer.score(robots, ["x"] * len(robots))
    noise = scorer.score(_noise_images(len(robots)), ["x"] * len(robots))
    assert same["dino"] > noise["dino"] + 0.1, (same, noise)
    assert same["clip_i"] > noise["clip_i"], (same, noise)


def test_clip_t_follows_the_prompt_without_the_identifier(scorer: FidelityScorer, robots: list[Image.Image]) -> None:
    with_token = scorer.score(robots[:2], ["a photo of sks robot"] * 2, identifier=None)["clip_t"]
    removed = scorer.score(robots[:2], ["a photo of sks robot"] * 2, identifier="sks")["clip_t"]
    plain = scorer.score(robots[:2], ["a photo of robot"] * 2, identifier=None)["clip_t"]
    assert removed == pytest.approx(plain, abs=1e-6)
    assert removed != pytest.approx(with_token, abs=1e-6)
    assert remove_identifier("sks dog, a photo of sks  dog", "sks") == "dog, a photo of dog"
    assert remove_identifier("a photo of sksdog", "sks") == "a photo of sksdog"


def test_a_missing_model_id_offline_is_one_line_naming_it() -> None:
    with pytest.raises(UserError) as error:
        FidelityScorer(["dino"], dino_model="nobody/no-such-dino")
    message = str(error.value)
    assert "nobody/no-such-dino" in message and "--dino_model" in message and "\n" not in message
    assert "network access" in message


def test_a_damaged_model_folder_is_named_as_damaged_not_as_offline(tmp_path: Path) -> None:
    damaged = tmp_path / "dino"
    damaged.mkdir()
    (damaged / "config.json").write_text("{not json")
    with pytest.raises(UserError) as error:
        FidelityScorer(["dino"], dino_model=str(damaged))
    message = str(error.value)
    assert f"--dino_model {damaged}: cannot load the evaluation model from this folder" in message
    assert "not a valid JSON" in message and "network" not in message
