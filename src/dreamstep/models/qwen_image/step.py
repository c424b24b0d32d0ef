"""The flow-matching step every Qwen-Image recipe extends: :class:`~dreamstep.models.flow_step.FlowMatchingStep` with
the transformer's inputs (packed x_σ, σ, the prompt embeddings and their mask, ``img_shapes``). A recipe writes
only :meth:`QwenImageFlowMatchingStep.predict` (and :meth:`~dreamstep.models.flow_step.FlowMatchingStep.condition`
when it has reference images).

The latents are 4-D here, (B, C, h, w): Qwen-Image's VAE works on videos, (B, C, frames, h, w) with one frame for an
image, and diffusers' training script draws its noise and packs its latents in that 5-D shape; a single frame holds
the same numbers in the same order, so the draws and the packing are the script's.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from dreamstep.models.flow_step import FlowMatchingStep
from dreamstep.models.qwen_image import plumbing as qwen


class QwenImageFlowMatchingStep(FlowMatchingStep):
    """A flow-matching step of a Qwen-Image transformer; the arguments are
    :class:`~dreamstep.models.flow_step.FlowMatchingStep`'s."""

    @abc.abstractmethod
    def predict(self, model: torch.nn.Module, inputs: dict[str, Any], batch: dict[str, Any],
                condition: Any) -> torch.Tensor:
        """The velocity predicted for the target's packed tokens, (B, N, 4C). ``inputs`` are the transformer's keyword
        arguments for the target (``hidden_states`` (B, N, 4C), ``timestep`` (B,), ``encoder_hidden_states``
        (B, S, D), ``encoder_hidden_states_mask`` (B, S) or ``None``, ``img_shapes``); ``condition`` is what
        :meth:`condition` gave."""

    def velocity(self, model: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, batch: dict[str, Any],
                 condition: Any) -> torch.Tensor:
        _, _, height, width = noisy.shape
        inputs = dict(hidden_states=qwen.pack(noisy), timestep=sigmas.flatten(),
                      encoder_hidden_states=batch["prompt_embeds"],
                      encoder_hidden_states_mask=batch.get("prompt_mask"),
                      img_shapes=qwen.img_shapes(len(noisy), [(height, width)]))
        return qwen.unpack(self.predict(model, inputs, batch, condition), height, width)
