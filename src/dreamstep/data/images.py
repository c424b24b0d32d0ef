"""Reading training images safely: every file is decoded once up front, so a corrupt image stops the run
before training with its path, never halfway through an epoch.

Decoding applies the EXIF orientation and turns every Pillow mode into 8-bit RGB: 16-bit greyscale is
scaled (not clipped), CMYK goes through its ICC profile when it has one, and transparency (alpha or a
palette's transparent index) is composited onto white, as a viewer shows it.
"""

from __future__ import annotations

import errno
import hashlib
import io
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageCms, ImageOps

from dreamstep.errors import UserError

# .gif and animated .webp train on their first frame.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".jfif", ".webp", ".gif", ".bmp", ".tif", ".tiff")
# Files that live beside training images on purpose (captions, metadata, sd-scripts' latent caches).
COMPANION_EXTENSIONS = (".txt", ".caption", ".json", ".jsonl", ".npz", ".toml")
_ORIENTATION_TAG = 0x0112
_SWAPPED_ORIENTATIONS = (5, 6, 7, 8)


@dataclass(frozen=True)
class ImageInfo:
    """What validation learned about one image file."""

    path: Path
    size: tuple[int, int]  # (width, height) after the EXIF orientation is applied
    sha256: str  # of the file's bytes: the content key for caches


def list_images(folder: Path, where: str) -> list[Path]:
    """The image files directly inside ``folder``, sorted by name; ``where`` names the flag or key in errors."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{where}: folder '{folder}' does not exist; check the path")
    paths = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if not paths:
        kinds = ", ".join(IMAGE_EXTENSIONS)
        raise UserError(f"{where}: folder '{folder}' has no images ({kinds}); put the training images there")
    return paths


def skipped_files(folder: Path, companions: tuple[str, ...] = ()) -> list[tuple[Path, str]]:
    """The entries of ``folder`` that training leaves out, each with the reason: files of other types,
    broken links, link loops and subfolders. Hidden files and caption/metadata files (``companions`` and
    :data:`COMPANION_EXTENSIONS`) are expected there and not listed."""
    expected = {*COMPANION_EXTENSIONS, *(c.lower() for c in companions)}
    skipped = []
    for path in sorted(Path(folder).iterdir()):
        if path.name.startswith(".") or path.suffix.lower() in expected:
            continue
        if path.is_symlink() and not path.exists():
            try:
                path.stat()
                reason = "broken link"
            except OSError as e:
                reason = "link loop" if e.errno == errno.ELOOP else "broken link (its target is missing)"
        elif path.is_dir():
            reason = "a folder (images in subfolders are not read)"
        elif path.suffix.lower() not in IMAGE_EXTENSIONS:
            reason = f"not an image type dreamstep reads ({path.suffix or 'no extension'})"
        else:
            continue
        skipped.append((path, reason))
    return skipped


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB (EXIF orientation is not touched here)."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        return _wide_grey_to_rgb(image)
    if mode == "CMYK":
        return _cmyk_to_rgb(image)
    if mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    elif mode in ("LA", "La", "PA", "RGBa"):
        image = image.convert("RGBA")
    if image.mode == "RGBA":
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image).convert("RGB")
    return image.convert("RGB")


def _wide_grey_to_rgb(image: Image.Image) -> Image.Image:
    """16-bit (or 32-bit integer) greyscale spans 0..65535: scale to 0..255 instead of clipping."""
    values = np.asarray(image, dtype=np.float64)
    if image.mode != "F":
        values = values / 257.0
    grey = np.clip(np.rint(values), 0, 255).astype(np.uint8)
    return Image.fromarray(grey, mode="L").convert("RGB")


def _cmyk_to_rgb(image: Image.Image) -> Image.Image:
    profile = image.info.get("icc_profile")
    if profile:
        try:
            source = ImageCms.ImageCmsProfile(io.BytesIO(profile))
            return ImageCms.profileToProfile(image, source, ImageCms.createProfile("sRGB"), outputMode="RGB")
        except (ImageCms.PyCMSError, OSError):
            pass  # a broken embedded profile: Pillow's plain conversion is still a usable image
    return image.convert("RGB")


def load_rgb(path: Path) -> Image.Image:
    """Open an image as upright 8-bit RGB; an unreadable file raises a UserError naming it."""
    try:
        with Image.open(path) as image:
            image.load()
            return to_rgb(ImageOps.exif_transpose(image))
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise UserError(f"{path}: cannot read image ({e}); replace or remove the file") from None


def inspect_image(path: Path) -> ImageInfo | str:
    """Hash and fully decode one file; return its info, or the reason it cannot be used."""
    try:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if image.format == "JPEG":
                image.draft("RGB", (max(1, width // 8), max(1, height // 8)))  # decode every block, fast
            image.load()
            orientation = image.getexif().get(_ORIENTATION_TAG, 1)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        # Pillow names its input in the message, here an in-memory buffer; the caller names the file.
        reason = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e)).strip() or type(e).__name__
        return f"cannot read image ({reason})"
    if orientation in _SWAPPED_ORIENTATIONS:
        width, height = height, width
    return ImageInfo(path=path, size=(width, height), sha256=hashlib.sha256(data).hexdigest())


def validate_images(paths: list[Path], workers: int = 8) -> dict[Path, ImageInfo]:
    """Decode every image before training. Any failure is one UserError naming the first bad file
    (and how many more there are), so a run never trains on fewer images than it was given."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(inspect_image, paths))
    failures = [(p, r) for p, r in zip(paths, results) if isinstance(r, str)]
    if failures:
        path, reason = failures[0]
        more = f" ({len(failures) - 1} more unreadable: {', '.join(str(p) for p, _ in failures[1:4])})" \
            if len(failures) > 1 else ""
        raise UserError(f"{path}: {reason}; replace or remove the file{more}")
    return {info.path: info for info in results if isinstance(info, ImageInfo)}

