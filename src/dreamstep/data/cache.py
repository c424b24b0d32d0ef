"""A disk cache for VAE latents and text-encoder outputs, keyed by content, never by step.

A latent's key is the sha256 of the image file's bytes plus the exact transform (bucket, resize, crop,
flip); a text entry's key is the caption itself; both are joined with a model identity string (say the
model path and revision plus dtype) so a different VAE or text encoder never reads another's entries.
Unchanged data is a hit in any later run; changed bytes or a different crop is a miss. Entries are
safetensors files written atomically (temporary file, then rename), in a directory the caller chooses,
which may not be one of the user's image folders.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dreamstep.data.buckets import Placement
from dreamstep.errors import UserError
from dreamstep.files import atomic_path

log = logging.getLogger(__name__)


def image_content_key(sha256: str, placement: Placement, fit_to: tuple[int, int] | None = None) -> str:
    """Key of a transformed image. ``fit_to`` marks a conditioning image first resized to its target's size."""
    fit = f";fit={fit_to[0]}x{fit_to[1]}" if fit_to is not None else ""
    return f"image:{sha256};{placement.describe()}{fit}"


def text_content_key(caption: str) -> str:
    """Key of a caption's text-encoder outputs."""
    return f"text:{caption}"


MEMORY_BUDGET = 256 * 2**20  # bytes of read entries a process keeps (each loader worker its own)


class TensorCache:
    """Named tensors per content key, stored under ``root`` for one model identity. Entries read are kept
    in memory, the most recently used up to ``memory_budget`` bytes: a small data set (DreamBooth's few
    images and captions, seen every epoch) is read from disk once. Whoever gets an entry must not change
    its tensors (batches stack them into new ones)."""

    def __init__(self, root: str | Path, model_id: str, image_dirs: Iterable[str | Path] = (),
                 memory_budget: int = MEMORY_BUDGET):
        self.root = Path(root).resolve()
        self.model_id = model_id
        self.memory_budget = memory_budget
        self._held: OrderedDict[Path, dict[str, torch.Tensor]] = OrderedDict()
        self._held_bytes = 0
        for folder in image_dirs:
            folder = Path(folder).resolve()
            if self.root == folder or folder in self.root.parents:
                raise UserError(f"cache directory {root} is inside the image folder {folder}; choose a cache "
                                "directory outside your data (e.g. under the output directory)")
        # The folder is made by the first put(): a run that stops at a later input check leaves nothing.
        self.written = 0  # entries this object stored (the run's cache misses)

    def path(self, content_key: str) -> Path:
        """Where an entry lives: sha256(model identity, content key), fanned out over 256 folders."""
        digest = hashlib.sha256(f"{self.model_id}\0{content_key}".encode()).hexdigest()
        return self.root / digest[:2] / f"{digest}.safetensors"

    def get(self, content_key: str) -> dict[str, torch.Tensor] | None:
        """The stored tensors, or None on a miss (an unreadable entry is a miss and gets rewritten)."""
        path = self.path(content_key)
        if path in self._held:
            self._held.move_to_end(path)
            return self._held[path]
        if not path.is_file():
            return None
        try:
            tensors = load_file(path)
        except (SafetensorError, OSError) as e:
            log.warning("cache entry %s is unreadable (%s); recomputing it", path, e)
            return None
        self._hold(path, tensors)
        return tensors

    def _hold(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.memory_budget:
            return
        self._held[path] = tensors
        self._held_bytes += size
        while self._held_bytes > self.memory_budget:
            _, dropped = self._held.popitem(last=False)
            self._held_bytes -= sum(t.numel() * t.element_size() for t in dropped.values())

    def put(self, content_key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Store tensors atomically; a crash leaves either the old entry or the new one, never half."""
        path = self.path(content_key)
        path.parent.mkdir(parents=True, exist_ok=True)
        contiguous = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        with atomic_path(path) as tmp:
            save_file(contiguous, str(tmp), metadata={"model_id": self.model_id, "content": content_key[:4096]})
        self.written += 1

    def get_or_compute(self, content_keys: Sequence[str | None],
                       compute: Callable[[list[int]], dict[str, torch.Tensor]],
                       known: Sequence[dict[str, torch.Tensor] | None] | dict[str, torch.Tensor] | None = None
                       ) -> dict[str, torch.Tensor]:
        """Batch lookup: entries already ``known`` or cached are used; ``compute(positions)`` returns batched
        tensors for missing ones. Entries whose key is None (not cacheable) are computed together and not
        stored; the others are computed one per call and stored: batched kernels may round differently with
        other batch mates, and an entry must not depend on which samples shared its first batch (a resumed
        run meets them in other batches). Returns every name stacked over the batch, on the CPU. ``known``
        may also be the whole batch already stacked (see :func:`stack_entries`), which is returned as it is."""
        if isinstance(known, dict):
            return known
        found = list(known) if known is not None else [None] * len(content_keys)
        for i, key in enumerate(content_keys):
            if found[i] is None and key is not None:
                found[i] = self.get(key)
        missing = [i for i, entry in enumerate(found) if entry is None]
        uncached = [i for i in missing if content_keys[i] is None]
        if uncached:
            computed = compute(uncached)
            for row, i in enumerate(uncached):
                found[i] = {name: value[row].detach().cpu() for name, value in computed.items()}
        for i in missing:
            if content_keys[i] is not None:
                found[i] = {name: value[0].detach().cpu() for name, value in compute([i]).items()}
                self.put(content_keys[i], found[i])
        names = found[0].keys()
        return {name: torch.stack([entry[name] for entry in found]) for name in names}


def stack_entries(entries: Sequence[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor] | list | None:
    """Cache entries read for a batch's samples, stacked per name when every sample has one (what
    :meth:`TensorCache.get_or_compute` then returns as it is); else the list as it is, None where missing."""
    if not entries or any(entry is None for entry in entries):
        return list(entries)
    return {name: torch.stack([entry[name] for entry in entries]) for name in entries[0]}


def latents_for_batch(batch: dict[str, Any], encode: Callable[[torch.Tensor], torch.Tensor],
                      cache: TensorCache | None, prefix: str = "") -> torch.Tensor:
    """The batch's latents (B, C, h, w), on the CPU when a cache is used: from the cache where present (read
    by the loader: ``batch["latents"]``, stacked when every sample has them),
    else ``encode(pixel_values)`` for the samples that came with pixels, stored for later epochs and runs.
    ``prefix="conditioning_"`` does the same for ControlNet conditioning images."""
    pixels, positions = batch[f"{prefix}pixel_values"], batch[f"{prefix}pixel_items"]

    def checked(rows: list[int]) -> torch.Tensor:
        latents = encode(pixels[rows])
        _check_finite(latents, [batch["image_paths"][positions[row]] for row in rows], prefix)
        return latents

    if cache is None:
        if len(positions) != len(batch["captions"]):
            raise ValueError("some samples came without pixels but no cache was given")
        return checked(list(range(len(positions))))
    keys = batch["image_keys" if not prefix else f"{prefix}keys"]
    latents = batch[f"{prefix}latents"]
    if isinstance(latents, torch.Tensor):  # every sample's latents were read and stacked by the loader
        return latents
    known = [{"latents": t} if t is not None else None for t in latents]

    def compute(missing: list[int]) -> dict[str, torch.Tensor]:
        return {"latents": checked([positions.index(i) for i in missing])}

    return cache.get_or_compute(keys, compute, known)["latents"]


def remove_caches(root: Path, names: Iterable[str]) -> None:
    """Delete the named cache folders under ``root`` (a run's temporary caches), and ``root`` when that
    leaves it empty."""
    for name in names:
        if (root / name).is_dir():
            shutil.rmtree(root / name)
    if root.is_dir() and not any(root.iterdir()):
        root.rmdir()
def _check_finite(latents: torch.Tensor, paths: list[str], prefix: str) -> None:
    """Stop at the first image whose latents hold NaN or inf, before they are cached or trained on: an
    fp16 VAE overflows on some images (SDXL's does), which would otherwise surface steps later as a
    non-finite loss."""
    finite = torch.isfinite(latents.flatten(1)).all(dim=1)
    if not bool(finite.all()):
        path = paths[int((~finite).nonzero()[0])]
        which = "the conditioning image of " if prefix else ""
        raise UserError(f"{which}{path}: the VAE encoded this image to NaN/inf latents (a half-precision VAE "
                        f"overflows on some images); keep the VAE in fp32: --no_half_vae for sdxl-lora, "
                        f"--mixed_precision bf16 or no for the FLUX trainers")
