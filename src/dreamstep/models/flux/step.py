"""The FLUX flow-matching step every FLUX recipe extends: :class:`~dreamstep.models.flow_step.FlowMatchingStep` with
the transformer's inputs (packed x_σ, σ, guidance, prompt embeddings, position ids). A recipe's step writes only
:meth:`FluxFlowMatchingStep.predict`, and :meth:`~FluxFlowMatchingStep.condition` when it has a condition image.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from dreamstep.models.flow_step import FlowMatchingStep
from dreamstep.models.flux import plumbing as flux


class FluxFlowMatchingStep(FlowMatchingStep):
    """A flow-matching step of a FLUX transformer; ``guidance_scale`` is fed to guidance-distilled bases (``None``
    for the others); the other arguments are :class:`~dreamstep.models.flow_step.FlowMatchingStep`'s
    (``objective``: ``FluxTrainingConfig.flow_matching_objective()``)."""

    def __init__(self, model: torch.nn.Module, *, guidance_scale: float | None, **step_options: Any):
        super().__init__(model, **step_options)
        self.guidance_scale = guidance_scale

    @abc.abstractmethod
    def predict(self, model: torch.nn.Module, inputs: dict[str, Any], batch: dict[str, Any],
                condition: torch.Tensor | None) -> torch.Tensor:
        """The velocity predicted for the target's packed tokens, (B, N, 4C). ``inputs`` are the transformer's
        keyword arguments for the target (``hidden_states`` (B, N, 4C), ``timestep``, ``guidance``,
        ``pooled_projections``, ``encoder_hidden_states``, ``txt_ids``, ``img_ids`` (N, 3)); ``condition`` is
        what :meth:`condition` gave."""

    def velocity(self, model: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, batch: dict[str, Any],
                 condition: torch.Tensor | None) -> torch.Tensor:
        bsz, _, height, width = noisy.shape
        # The transformer sees x_σ packed into 2x2 patches: (B, h/2 · w/2, 4C).
        packed = flux.pack(noisy)
        guidance = (torch.full((bsz,), self.guidance_scale, device=noisy.device)
                    if self.guidance_scale is not None else None)
        # Position ids in fp32 whatever x_σ's dtype: bf16 holds integers exactly only up to 256 (4096 px).
        inputs = dict(hidden_states=packed, timestep=sigmas.flatten(), guidance=guidance,
                      pooled_projections=batch["pooled"], encoder_hidden_states=batch["prompt_embeds"],
                      txt_ids=batch["text_ids"], img_ids=flux.latent_image_ids(height, width, noisy.device,
                                                                              torch.float32))
        return flux.unpack(self.predict(model, inputs, batch, condition), height, width)
