"""Host syncs of a training step: the FLUX LoRA step, the training loop and the cached input path must not
wait for the device between logging steps.

The steps run on the CPU, where a read of a device value still shows as ``aten._local_scalar_dense`` (what
``float()``, ``bool()`` and ``.item()`` dispatch to). Copies to the CPU from another device and ``nonzero``
on one are counted too, for runs on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT
from torch.utils._python_dispatch import TorchDispatchMode

from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import ConditionedBatches, build_dataset, make_dataloader
from dreamstep.data.sources import bucket_spec, dreambooth_from_flags
from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.logging import TrainingLogger
from dreamstep.engine.loop import run_training
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models import parking
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.flux.lora_targets import flux_lora_targets
from dreamstep.models.flux.tiny import build_tiny_flux
from dreamstep.models.precision import cast_trainable_params_to_fp32
from dreamstep.recipes.flux_lora import FluxLoraModel, FluxLoraStep

LOG_EVERY = 4


def _off_cpu(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def _to_host(name: str, args: tuple, out: object) -> bool:
    """A copy from another device to the CPU (``.cpu()``, ``.to("cpu")``, ``cpu_tensor.copy_(device_tensor)``)."""
    if name == "_to_copy":
        return _off_cpu(args[0]) and not _off_cpu(out)
    return name == "copy_" and _off_cpu(args[1]) and not _off_cpu(args[0])


class HostSyncs(TorchDispatchMode):
    """Counts the ops that make the host wait for the device, except while ``reading`` files: on a machine
    without a GPU, safetensors' reads of cache entries dispatch the same op as a device read."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.reading = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.reading:
            return out
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" or (name == "nonzero" and _off_cpu(args[0])) or _to_host(name, args, out):
            self.count += 1
        return out


def _flux_lora_run(tmp_path: Path) -> tuple[FluxLoraStep, ConditionedBatches]:
    """The flux-lora trainer's step and batches at its defaults (fp32, fused AdamW, clipping at 1), on the
    bundled robot images at 32 px, with the latent and text caches filled as the trainer fills them."""
    pipe = build_tiny_flux(seed=0, guidance_embeds=True)
    add_lora(pipe.transformer, flux_lora_targets(pipe.transformer, ["attention"]), rank=4, alpha=4)
    cast_trainable_params_to_fp32(pipe.transformer)
    pipe.transformer.train()
    config = dreambooth_from_flags(ROBOT_DIR, ROBOT_PROMPT, buckets=bucket_spec(32), center_crop=True)
    latent_cache, text_cache = TensorCache(tmp_path / "latents", "vae"), TensorCache(tmp_path / "text", "text")
    dataset = build_dataset([config], seed=0, latent_cache=latent_cache)
    dataset.text_cache = text_cache
    conditioner = flux.FluxConditioner(pipe, latent_cache=latent_cache, text_cache=text_cache,
                                       max_sequence_length=16, device=torch.device("cpu"))
    parking.fill_caches(conditioner, dataset, epochs=1)
    params = [p for p in pipe.transformer.parameters() if p.requires_grad]
    step = FluxLoraStep(FluxLoraModel(pipe.transformer), optimizer=build_optimizer("AdamW", params, 1e-4),
                        accelerator=make_accelerator(mixed_precision="no"), max_grad_norm=1.0,
                        sigmas=flux.training_sigmas(pipe.scheduler), objective=FlowMatchingObjective(),
                        guidance_scale=3.5, prior_loss_weight=1.0)
    return step, ConditionedBatches(make_dataloader(dataset, seed=0), conditioner)


class ReadsUncounted:
    """A loader whose work on the host (reading the caches on the main thread: no workers) is not counted."""

    def __init__(self, loader: Any, syncs: HostSyncs):
        self.loader, self.syncs = loader, syncs

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.syncs.reading = True
        batches = iter(self.loader)  # draws the epoch's worker seed from the CPU generator
        while True:
            self.syncs.reading = True
            batch = next(batches, None)
            self.syncs.reading = False
            if batch is None:
                return
            yield batch


def test_counter_sees_a_read_of_a_loss():
    loss = torch.ones(3).mean()
    with HostSyncs() as syncs:
        math.isfinite(loss)
    assert syncs.count == 1


def test_only_logging_steps_wait_for_the_device(tmp_path: Path):
    step, batches = _flux_lora_run(tmp_path)
    counts: list[int] = []  # syncs so far, taken as each step's batch is read
    conditioner = batches.conditioner
    syncs = HostSyncs()

    def counted(batch: dict) -> dict:
        counts.append(syncs.count)
        return conditioner(batch)

    batches.conditioner = counted
    batches.loader = ReadsUncounted(batches.loader, syncs)
    logger = TrainingLogger(tmp_path / "logs", report_to="none")
    steps = 2 * LOG_EVERY + 2
    with syncs:
        result = run_training(step, batches, max_train_steps=steps, logger=logger, progress=False,
                              log_every=LOG_EVERY)
    counts.append(syncs.count)
    per_step = [after - before for before, after in zip(counts, counts[1:])]
    logging_steps = [s for s in range(1, steps + 1) if s % LOG_EVERY == 0 or s == steps]
    assert [n for i, n in enumerate(per_step, start=1) if i not in logging_steps] == [0] * (steps - 3)
    # Every step is still recorded, under its own step number, with finite values.
    assert [s for s, _ in logger.loss_history] == list(range(1, steps + 1))
    assert [v for _, v in logger.loss_history] == result.losses and all(map(math.isfinite, result.losses))
    assert len(logger.history["grad_norm"]) == steps and step.num_skipped == 0
