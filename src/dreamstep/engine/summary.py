"""The start-of-run summary: what a run is about to do, printed once before the first step, so a wrong
folder, a skipped image, a lone process or a cold cache shows before hours are spent."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import BucketDataset
from dreamstep.engine.plan import TrainingPlan


def describe_data(dataset: BucketDataset) -> list[str]:
    """Images and samples per subset, skipped files with their reason, and buckets with sample counts."""
    lines = []
    images: Counter[str] = Counter()
    samples: Counter[str] = Counter()
    for record in dataset.records:
        name = str(record.subset.image_dir or record.subset.where)
        name += " (regularization)" if record.subset.is_reg else ""
        images[name] += 1
        samples[name] += record.num_repeats
    for name, count in images.items():
        lines.append(f"images      {name}: {count} images, {samples[name]} samples per epoch")
    for path, reason in dataset.skipped:
        lines.append(f"skipped     {path}: {reason}")
    lines += describe_fallback_captions(dataset)
    if dataset.held_out:
        names = ", ".join(str(p) for p in dataset.held_out[:6]) + (" ..." if len(dataset.held_out) > 6 else "")
        count = len(dataset.held_out)
        lines.append(f"held out    {count} image{'s' * (count != 1)} for the validation loss, not trained on: {names}")
    buckets = Counter((w, h) for _, w, h in dataset.sample_group)
    lines.append("buckets     " + ", ".join(f"{w}x{h}: {n}" for (w, h), n in sorted(buckets.items())))
    return lines


def describe_fallback_captions(dataset: BucketDataset) -> list[str]:
    """Per subset, the training images without a caption file, which train with its fallback caption
    (``--instance_prompt``, ``--default_caption``, ``class_tokens``)."""
    missing: dict[Any, list[Path]] = {}
    for record in dataset.records:
        file = caption_file(record)
        if not record.subset.is_reg and file is not None and not file.is_file():
            missing.setdefault(record.subset, []).append(record.image.path)
    lines = []
    for subset, paths in missing.items():
        names = ", ".join(p.name for p in paths[:6]) + (" ..." if len(paths) > 6 else "")
        lines.append(f"captions    {len(paths)} image{'s' * (len(paths) != 1)} of {subset.where} without a "
                     f"{subset.caption_extension} file train with {subset.caption_fallback} "
                     f"'{subset.class_tokens}': {names}")
    return lines


def caption_file(record: Any) -> Path | None:
    """The caption file its subset reads for a record's image (it may be missing), or ``None`` when the subset
    reads none (no caption extension, or captions from a metadata file)."""
    subset = record.subset
    if subset.caption_extension and subset.metadata_file is None:
        return record.image.path.with_suffix(subset.caption_extension)
    return None


def caption_source(record: Any) -> str:
    """The file a record's caption came from: its caption file when there is one, else the image."""
    file = caption_file(record)
    return str(file) if file is not None and file.is_file() else f"{record.image.path} (its caption)"


def describe_truncation(dataset: BucketDataset, tokenizers: Mapping[str, tuple[Any, int]]) -> list[str]:
    """One line per caption longer than a text encoder reads (``tokenizers``: name -> (tokenizer, limit)),
    naming the file and the token count; the words past the limit do not reach the model."""
    lines = []
    for name, (tokenizer, limit) in tokenizers.items():
        lengths: dict[str, int] = {}
        for record in dataset.records:
            if record.caption not in lengths:
                lengths[record.caption] = len(tokenizer(record.caption).input_ids)
            if lengths[record.caption] > limit:
                lines.append(f"truncated   {caption_source(record)}: {lengths[record.caption]} tokens, "
                             f"{name} reads {limit}")
    return lines


def requested_processes() -> int | None:
    """How many processes ``accelerate launch --num_processes N`` asked for, read from the launcher's
    command line (Linux); None when unknown. Without --multi_gpu accelerate starts one process regardless."""
    if "ACCELERATE_MIXED_PRECISION" not in os.environ:
        return None
    try:
        words = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    for i, word in enumerate(words):
        value = word.split("=", 1)[1] if word.startswith("--num_processes=") else (
            words[i + 1] if word == "--num_processes" and i + 1 < len(words) else None)
        if value is not None and value.isdigit():
            return int(value)
    return None


def describe_processes(accelerator: Any, sharded_stage: int = 0) -> list[str]:
    """Processes, nodes and device, and how the trainable state is held (``sharded_stage``: the run's
    --zero_stage, 0 when not sharding; one process has nothing to shard with, which is said)."""
    running = accelerator.num_processes
    nodes = max(1, running // int(os.environ.get("LOCAL_WORLD_SIZE", running)))
    if sharded_stage and running > 1:
        holding = f"FSDP2 --zero_stage {sharded_stage}: each holds 1/{running} of the trainable state"
    else:
        holding = f"{accelerator.distributed_type.value}: each holds all of the trainable state" if running > 1 else ""
    lines = [f"processes   {running} on {nodes} node{'s' * (nodes > 1)} ({accelerator.device.type})"
             f"{f'; {holding}' if holding else ''}"]
    if sharded_stage and running == 1:
        lines.append(f"note        --zero_stage {sharded_stage} does nothing in one process: sharding spreads the "
                     "trainable state over several (accelerate launch --multi_gpu --num_processes N -m dreamstep "
                     "train ...)")
    asked = requested_processes()
    if asked is not None and asked != running:
        lines.append(f"warning     accelerate launch asked for {asked} processes but {running} runs: without "
                     "--multi_gpu (on CPUs too) accelerate starts one process; add --multi_gpu")
    return lines


def trainable_parameters(*modules: torch.nn.Module) -> tuple[int, str]:
    """Count and dtype of the parameters that train."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    dtype = names.get(params[0].dtype, str(params[0].dtype)) if params else "-"
    return sum(p.numel() for p in params), dtype


def describe_caches(caches: Mapping[str, TensorCache | None]) -> str:
    parts = []
    for name, cache in caches.items():
        if cache is None:
            parts.append(f"{name}: off")
        else:
            entries = sum(1 for _ in cache.root.rglob("*.safetensors")) if cache.root.is_dir() else 0
            written = f"{cache.written} entr{'y' if cache.written == 1 else 'ies'}"
            parts.append(f"{name}: {cache.root} ({written} written now, {entries - cache.written} were there already)")
    return "caches      " + "; ".join(parts)


def print_run_summary(run: Any, dataset: BucketDataset, plan: TrainingPlan, *,
                      gradient_accumulation_steps: int, mixed_precision: str,
                      trainable: tuple[torch.nn.Module, ...], caches: Mapping[str, TensorCache | None],
                      outputs: str, tokenizers: Mapping[str, tuple[Any, int]] | None = None,
                      sharded_stage: int = 0) -> None:
    """Print the summary on the main process (the others print nothing). ``tokenizers`` (name ->
    (tokenizer, tokens the encoder reads)) name the captions that get cut; ``sharded_stage`` is the
    FSDP2 stage the trainable state is sharded with (0: not sharded)."""
    if not run.is_main_process:
        return
    processes = run.accelerator.num_processes
    epochs = plan.num_epochs
    sizes = sorted(set(dataset.batch_sizes))  # per dataset: a dataset TOML's batch_size wins over the flag
    per_batch = gradient_accumulation_steps * processes
    batch, effective = (str(sizes[0]), str(sizes[0] * per_batch)) if len(sizes) == 1 else (
        f"{sizes[0]}-{sizes[-1]}", f"{sizes[0] * per_batch}-{sizes[-1] * per_batch}")
    count, dtype = trainable_parameters(*trainable)
    lines = [
        *describe_data(dataset),
        *describe_truncation(dataset, tokenizers or {}),
        f"schedule    {epochs} epoch{'s' * (epochs != 1)}, {plan.total_steps} optimizer steps "
        f"({plan.steps_per_epoch} per epoch), "
        f"effective batch {effective} = {batch} per process x "
        f"{gradient_accumulation_steps} accumulated x {processes} process{'es' * (processes != 1)}",
        *describe_processes(run.accelerator, sharded_stage),
        f"precision   frozen weights {mixed_precision if mixed_precision != 'no' else 'fp32'}, trainable {dtype}",
        f"trainable   {count:,} parameters",
        describe_caches(caches),
        f"outputs     {outputs}",
    ]
    text = "\n".join(["run:", *(f"  {line}" for line in lines)])
    print(text, flush=True)
    run.preamble.append(text)
