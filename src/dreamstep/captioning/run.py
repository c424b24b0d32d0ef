"""The ``dreamstep caption`` loop: find what needs a caption, load the captioner, caption in batches (the next
batch's images decode on threads while the model works), write each caption as its batch finishes, and end with
what was written where and which images were skipped."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from PIL import Image
from tqdm.auto import tqdm

from dreamstep.captioning.captioner import load_captioner
from dreamstep.captioning.targets import CaptionWriter, Target, caption_folders, compose, find_targets
from dreamstep.config.caption import CaptionConfig
from dreamstep.data.images import load_rgb, skipped_files
from dreamstep.errors import UserError

_DECODE_THREADS = 4
# Pictures are shrunk to this longest side on the decoding threads: every captioner looks at less (Florence-2
# 768 px, WD14 448, BLIP 384), and Qwen-VL, which takes an image at its own size, would otherwise spend
# thousands of tokens (and gigabytes) on a 24-megapixel photo.
MAX_SIDE = 1024


def _load(target: Target) -> Image.Image | str:
    """The image as the trainers decode it (EXIF orientation, any mode to RGB, alpha on white), or why not."""
    try:
        image = load_rgb(target.image)
    except UserError as e:
        # Pillow names the file in its message; the report names it once, before the reason.
        reason = str(e).removeprefix(f"{target.image}: ").split("; replace")[0]
        return reason.replace(f" '{target.image}'", "")
    image.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.LANCZOS)
    return image


def _batches(targets: list[Target], size: int, pool: ThreadPoolExecutor) -> Iterator[list[tuple[Target, Future]]]:
    """Batches of (target, decoding image); the next batch is already decoding while one is captioned."""
    chunks = [targets[i:i + size] for i in range(0, len(targets), size)]
    pending = [(t, pool.submit(_load, t)) for t in chunks[0]] if chunks else []
    for index in range(len(chunks)):
        current = pending
        pending = [(t, pool.submit(_load, t)) for t in chunks[index + 1]] if index + 1 < len(chunks) else []
        yield current


def caption(config: CaptionConfig) -> None:
    folders, notes = caption_folders(config.source, config.caption_extension, config.metadata_jsonl)
    for note in notes:
        print(f"note: {note}")
    targets, done = find_targets(folders, redo=config.overwrite or config.append)
    kept = " (--overwrite replaces them, --append adds to them)" if done else ""
    print(f"{len(targets)} images to caption, {done} already captioned{kept}, in "
          f"{', '.join(f.describe() for f in folders)}")
    if not targets:
        print("nothing to do: every image has a caption")
        return
    start = time.perf_counter()
    captioner = load_captioner(config)
    print(f"{config.captioner} {config.model_id} on {captioner.device} ({captioner.dtype}), loaded in "
          f"{time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    writer = CaptionWriter()
    unreadable: list[tuple[Path, str]] = []
    empty: list[Path] = []
    planned = 0
    with ThreadPoolExecutor(max_workers=_DECODE_THREADS) as pool, \
            tqdm(total=len(targets), unit="img", desc=f"caption {config.captioner}", dynamic_ncols=True) as bar:
        for batch in _batches(targets, config.batch_size, pool):
            loaded = [(t, f.result()) for t, f in batch]
            unreadable += [(t.image, result) for t, result in loaded if isinstance(result, str)]
            good = [(t, image) for t, image in loaded if not isinstance(image, str)]
            captions = captioner.caption([image for _, image in good]) if good else []
            for (target, _), text in zip(good, captions):
                if not text.strip():
                    empty.append(target.image)
                    continue
                final = compose(text, target.existing, append=config.append, prefix=config.prefix,
                                tags=captioner.tags)
                planned += 1
                if config.dry_run:
                    bar.write(f"{target.image}: {final}")
                else:
                    writer.write(target, final)
            writer.flush()
            bar.update(len(batch))
    seconds = time.perf_counter() - start
    _report(config, folders, writer, planned, unreadable, empty, len(targets) / max(seconds, 1e-9))


def _report(config: CaptionConfig, folders: list, writer: CaptionWriter, planned: int,
            unreadable: list[tuple[Path, str]], empty: list[Path], images_per_second: float) -> None:
    where = ", ".join(f.describe() for f in folders)
    speed = f"{images_per_second:.2f} images/s"
    if config.dry_run:
        print(f"dry run: would write {planned} captions in {where} ({speed}); nothing was written")
    else:
        print(f"wrote {len(writer.written)} captions in {where} ({speed})")
    if unreadable:
        print(f"skipped {len(unreadable)} unreadable image(s); replace or remove them:")
        for path, reason in unreadable:
            print(f"  {path}: {reason}")
    if empty:
        print(f"skipped {len(empty)} image(s) the captioner gave no text for:")
        for path in empty:
            print(f"  {path}")
    others = [entry for f in folders for entry in skipped_files(f.path, (f.extension or "",))]
    if others:
        print(f"left out {len(others)} file(s) that are not images dreamstep reads (the trainers leave them out too):")
        for path, reason in others:
            print(f"  {path}: {reason}")
