"""TrainingLogger: TensorBoard events, loss-curve PNG, image grids, graceful degradation."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from PIL import Image

from dreamstep.engine.logging import (
    TrainingLogger,
    draw_loss_curve,
    save_image_grid,
    smooth,
)

_SMOOTH_BLUE = (20, 70, 170)
_RAW_BLUE = (170, 190, 230)


def _pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))  # (H, W, 3)


def _has_color(pixels: np.ndarray, color: tuple[int, int, int]) -> bool:
    return bool((pixels == np.array(color, dtype=np.uint8)).all(axis=-1).any())


def test_logger_writes_tensorboard_history_and_loss_curve(tmp_path):
    logger = TrainingLogger(tmp_path, report_to="tensorboard")
    losses = [1.0 / (1 + i) + 0.05 * math.sin(i) for i in range(40)]
    for i, loss in enumerate(losses, start=1):
        logger.log(i, {"loss": loss, "lr": 1e-4})
    curve = logger.close()
    assert curve == tmp_path / "loss_curve.png"
    assert list(tmp_path.glob("events.out.tfevents.*"))
    assert logger.loss_history == list(enumerate(losses, start=1))
    pixels = _pixels(curve)
    assert pixels.shape == (480, 800, 3)
    assert _has_color(pixels, _SMOOTH_BLUE) and _has_color(pixels, _RAW_BLUE)
    # the smoothed curve descends: its pixels sit higher (smaller y) on the left than on the right
    ys, xs = np.nonzero((pixels == np.array(_SMOOTH_BLUE, dtype=np.uint8)).all(axis=-1))
    assert ys[xs < 200].mean() < ys[xs > 600].mean()


def test_report_to_none_writes_no_events_but_still_draws(tmp_path):
    logger = TrainingLogger(tmp_path, report_to="none")
    logger.log(1, {"loss": 0.5})
    assert logger.close() == tmp_path / "loss_curve.png"
    assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_missing_tensorboard_degrades_with_a_warning(tmp_path, monkeypatch):
    # Make `import tensorboard` fail as it does when the package is not installed.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.warns(UserWarning, match="tensorboard is not installed"):
        logger = TrainingLogger(tmp_path)
    logger.log(1, {"loss": 0.5})
    assert logger.close().is_file()
    assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_only_the_main_process_writes(tmp_path):
    logger = TrainingLogger(tmp_path / "logs", is_main_process=False)
    logger.log(1, {"loss": 0.5})
    assert logger.log_images(1, [Image.new("RGB", (4, 4))]) is None
    assert logger.close() is None
    assert not (tmp_path / "logs").exists()


def test_image_grid_layout(tmp_path):
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255)]
    images = [Image.new("RGB", (16, 8), c) for c in colors]
    path = save_image_grid(images, tmp_path / "grid.png", columns=3)
    pixels = _pixels(path)
    assert pixels.shape == (16, 48, 3)  # 2 rows x 3 columns of 16x8
    for i, color in enumerate(colors):
        row, col = divmod(i, 3)
        assert tuple(pixels[row * 8 + 4, col * 16 + 8]) == color
    assert tuple(pixels[12, 40]) == (255, 255, 255)  # the empty sixth cell


def test_log_images_saves_a_grid_per_step(tmp_path):
    logger = TrainingLogger(tmp_path, report_to="tensorboard")
    path = logger.log_images(20, [Image.new("RGB", (8, 8), "red")] * 4)
    logger.close()
    assert path == tmp_path / "samples" / "validation-000020.png"
    assert _pixels(path).shape == (16, 16, 3)


def test_smooth_is_a_debiased_ema():
    assert smooth([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    # weight 0.5: ema = 0.5, 1.25; normaliser = 0.5, 0.75
    assert smooth([1.0, 2.0], weight=0.5) == pytest.approx([1.0, 1.25 / 0.75])


def test_loss_curve_handles_one_point_flat_and_non_finite_values(tmp_path):
    for name, losses in (("one", [0.3]), ("flat", [0.2] * 5), ("nan", [0.5, math.nan, 0.4, math.inf, 0.3])):
        path = draw_loss_curve(range(1, len(losses) + 1), losses, tmp_path / f"{name}.png")
        assert _has_color(_pixels(path), _SMOOTH_BLUE), name


def test_a_resumed_log_hides_the_steps_the_interrupted_run_logged_after_its_checkpoint(tmp_path):
    """Killed at step 5 with a checkpoint at 3, the run resumes at 4: TensorBoard must not draw 4 and 5 twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TrainingLogger(tmp_path)
    for step in range(1, 6):
        first.log(step, {"loss": 1.0})
    first.close()
    resumed = TrainingLogger(tmp_path, purge_step=4)
    for step in range(4, 8):
        resumed.log(step, {"loss": 2.0})
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [(s.step, s.value) for s in scalars] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0), (6, 2.0),
                                                    (7, 2.0)]


def test_train_log_has_a_line_per_step_and_the_run_messages(tmp_path):
    from dreamstep.dashboard.scalars import RunScalars

    logger = TrainingLogger(tmp_path, report_to="none")
    for step in (1, 2, 3):
        logger.log(step, {"loss": 1.0 / step, "lr": 1e-4})
    logger.note("saved checkpoint-3")
    logger.close()
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == [
        "step 1 loss=1 lr=0.0001", "step 2 loss=0.5 lr=0.0001", "step 3 loss=0.333333 lr=0.0001",
        "saved checkpoint-3"]
    # appended, not replaced, by a resumed run; the repeated step replaces the old one when read back
    resumed = TrainingLogger(tmp_path, report_to="none")
    resumed.log(3, {"loss": 0.25, "lr": 1e-4})
    resumed.close()
    loss = RunScalars(tmp_path).refresh()["loss"]
    assert list(loss.steps) == [1, 2, 3] and loss.values[-1] == 0.25


def test_evaluation_scores_reach_tensorboard_the_metrics_files_and_the_loss_curve(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TrainingLogger(tmp_path)
    for step in range(1, 21):
        logger.log(step, {"loss": 1.0 + 0.1 * math.sin(step)})
    for step, val_loss in ((0, 0.9), (10, 0.7), (20, 0.8)):
        logger.log_metrics(step, {"val_loss": val_loss, "dino": step / 40})
    written = logger.write_metrics(marks={"val_loss": 10})
    curve = logger.close()
    assert (tmp_path / "metrics.csv").read_text().splitlines()[0] == "step,val_loss,dino"
    assert written["metrics plot"] == tmp_path / "metrics.png"
    assert _has_color(_pixels(curve), (220, 100, 20))  # the validation loss, in orange
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(s.step, round(s.value, 6)) for s in events.Scalars("eval/val_loss")] == [(0, 0.9), (10, 0.7), (20, 0.8)]


def _sample(size: int, color: tuple[int, int, int], prompt: str, seed: int) -> Image.Image:
    image = Image.new("RGB", (size, size), color)
    image.info["dreamstep"] = {"prompt": prompt, "seed": seed, "steps": 4, "sampler": "Euler", "guidance_scale": 3.5,
                               "width": size, "height": size, "model": "tiny", "dreamstep_version": "0"}
    return image


def test_labels_of_small_samples_stay_in_their_own_cell(tmp_path):
    from PIL import ImageFont

    from dreamstep.engine.logging import _cell_labels

    prompt = "a photograph of sks dog wearing an extraordinarily_long_hyphenless_accessory in the snow"
    images = [_sample(64, (200, 0, 0), prompt, 123456789), _sample(64, (0, 0, 200), prompt, 7)]
    path = save_image_grid(images, tmp_path / "grid.png", columns=2, step=1000)
    pixels = _pixels(path)
    cell_w = pixels.shape[1] // 2
    assert cell_w >= 150  # widened for its labels, not overlapping the next column
    font = ImageFont.load_default()
    for image in images:
        (offset, lines), = _cell_labels(image, 1000, cell_w, font)
        assert offset == 0 and all(font.getlength(line) <= cell_w - 4 for line in lines)
        assert any("123456789" in line or "seed 7" in line for line in lines) and any("1000" in line for line in lines)


def test_a_composite_labels_each_result_under_itself_not_under_its_control_image(tmp_path):
    from dreamstep.models.flux.controlnet import side_by_side

    control = Image.new("RGB", (64, 64), (0, 0, 0))
    composite = side_by_side([[control, _sample(64, (0, 200, 0), "a red square", 1),
                               _sample(64, (0, 0, 200), "a blue square", 2)]])
    pixels = _pixels(save_image_grid([composite], tmp_path / "grid.png", step=5))
    band = pixels[64:]
    assert (band[:, :64] == 255).all()  # nothing under the control image
    assert (band[:, 64:128] < 128).any() and (band[:, 128:] < 128).any()  # a label under each result
