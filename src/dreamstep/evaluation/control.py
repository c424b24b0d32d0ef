"""How well a ControlNet sample follows its control image, for control types whose agreement can be
measured from the sample alone.

``edge``: the control image is an edge map (Canny, HED, lines: bright edges on dark). The sample's edges
are its Sobel gradient magnitude, thresholded to keep as many pixels as the control has edge pixels; the
score is the F1 of the two edge sets, with a one-pixel tolerance either way (3x3 dilation), so 1 means
every control edge is found in the sample and nothing else, and a blank or unrelated sample scores low.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

_FLAT = 1e-3  # gradient magnitudes below this are flat image, not edges
_SOBEL_X = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])


def _grey(image: Image.Image, size: tuple[int, int]) -> torch.Tensor:
    """(H, W) floats in [0, 1]."""
    return torch.from_numpy(np.asarray(image.convert("L").resize(size), dtype=np.float32) / 255.0)


def sobel_magnitude(grey: torch.Tensor) -> torch.Tensor:
    """Gradient magnitude of an (H, W) image, same shape (the border replicated, so the frame is no edge)."""
    kernels = torch.stack([_SOBEL_X, _SOBEL_X.T]).unsqueeze(1)  # (2, 1, 3, 3)
    padded = F.pad(grey[None, None], (1, 1, 1, 1), mode="replicate")
    gradients = F.conv2d(padded, kernels)[0]  # (2, H, W)
    return gradients.pow(2).sum(0).sqrt()


def _dilate(mask: torch.Tensor) -> torch.Tensor:
    return F.max_pool2d(mask[None, None].float(), 3, stride=1, padding=1)[0, 0] > 0


def edge_agreement(sample: Image.Image, control: Image.Image) -> float:
    """F1 in [0, 1] between the control's edge pixels and the sample's strongest-gradient pixels."""
    control_edges = _grey(control, sample.size) > 0.5
    wanted = int(control_edges.sum())
    if wanted == 0:
        return float("nan")
    magnitude = sobel_magnitude(_grey(sample, sample.size))
    threshold = torch.topk(magnitude.flatten(), wanted).values[-1]
    sample_edges = (magnitude >= threshold) & (magnitude > _FLAT)
    if not sample_edges.any():
        return 0.0
    precision = float((sample_edges & _dilate(control_edges)).sum()) / max(1, int(sample_edges.sum()))
    recall = float((control_edges & _dilate(sample_edges)).sum()) / wanted
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def mean_edge_agreement(samples: Sequence[Image.Image], controls: Sequence[Image.Image]) -> float:
    """Mean :func:`edge_agreement` over (sample, control) pairs."""
    scores = [edge_agreement(s, c) for s, c in zip(samples, controls, strict=True)]
    scores = [s for s in scores if not np.isnan(s)]
    return float(np.mean(scores)) if scores else float("nan")
