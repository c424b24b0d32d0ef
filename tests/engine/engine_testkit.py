"""Small real models, data and the hand-written reference loop the TrainStep tests compare against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dreamstep import TrainStep


def tiny_mlp(seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """4 -> 8 -> 2 MLP with a deterministic init."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)


def regression_batches(count: int, batch_size: int, seed: int = 1,
                       dtype: torch.dtype = torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of (x: (B, 4), y: (B, 2))."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch_size, 4, generator=g, dtype=dtype), torch.randn(batch_size, 2, generator=g, dtype=dtype))
            for _ in range(count)]


class RegressionStep(TrainStep):
    """MSE regression: loss = mean((model(x) - y)^2)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.model(x)
        loss = F.mse_loss(pred, y)
        return loss, pred


def reference_train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[list[tuple]],
                    scheduler=None, max_grad_norm: float | None = None) -> list[float]:
    """The loop TrainStep hides, written out: one big batch per group, backward, clip, step, zero."""
    losses = []
    for group in groups:
        x = torch.cat([b[0] for b in group])
        y = torch.cat([b[1] for b in group])
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
