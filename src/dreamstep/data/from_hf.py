"""A Hugging Face dataset (a parquet, arrow, JSON or CSV file, a
``save_to_disk`` folder, a folder of data files or an image folder, or a hub name when online) as a folder
of images plus the ``metadata.json`` that fine-tuning reads (``{"000012.jpg": {"caption": ...}}``, see
:mod:`dreamstep.data.records`), and a ``dataset.toml`` to pass as ``--dataset_config``.

Images keep their encoded bytes when they are PNG, JPEG, WebP, BMP or TIFF (no re-encoding loss) and are
re-encoded as PNG otherwise; every one is decoded once to make sure it is readable. Row ``i`` becomes
``OUT/<i:06d>.<ext>``, written atomically, so a run that stops (Ctrl-C, a crash, ``--limit``) continues
where it stopped when started again: rows whose image is there are not rewritten. ``metadata.json`` is
rewritten atomically every few hundred rows and at the end.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError
from tqdm.auto import tqdm

from dreamstep.config.schema import toml_value
from dreamstep.data.images import IMAGE_EXTENSIONS, to_rgb
from dreamstep.errors import UserError, did_you_mean
from dreamstep.files import check_folder_can_be_made, write_bytes_atomic

METADATA_NAME = "metadata.json"
TOML_NAME = "dataset.toml"
MARKER_NAME = ".from_hf.json"  # what this folder was made from, so a continued run converts the same data
CAPTION_COLUMNS = ("text", "caption", "captions", "prompt", "sentence", "description", "label_text")
KEPT_FORMATS = {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp", "BMP": ".bmp", "TIFF": ".tif"}
_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json", ".csv": "csv"}
_SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what Dataset(Dict).save_to_disk writes
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
SAVE_EVERY = 500  # rows between metadata.json rewrites


@dataclass
class Conversion:
    """What a run did: rows written now, rows already there, rows left out and why."""

    output_dir: Path
    written: int = 0
    kept: int = 0
    no_caption: list[int] = field(default_factory=list)
    unreadable: list[tuple[int, str]] = field(default_factory=list)

    @property
    def images(self) -> int:
        return self.written + self.kept


class _NotAnImage(ValueError):
    """The cell holds no image at all (a wrong column, or a path to nothing)."""


class _Unreadable(ValueError):
    """The cell holds image bytes that do not decode."""


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise UserError("dataset from-hf needs the 'datasets' package; install it with "
                        "pip install 'dreamstep[hf]' (or pip install datasets)") from None
    datasets.disable_progress_bars()  # ours counts rows; theirs would interleave with it
    return datasets


# ------------------------------------------------------------------------------ reading the source

def load_source(source: str, split: str | None = None, config_name: str | None = None) -> Any:
    """The chosen split of ``source`` as a ``datasets`` Dataset (saved folders, memory-mapped) or
    IterableDataset (files, folders and hub names, streamed: nothing is copied into a cache)."""
    datasets = _datasets()
    path = Path(source).expanduser()
    try:
        if path.is_dir() and any((path / m).is_file() for m in _SAVED_MARKERS):
            data = datasets.load_from_disk(str(path))
        elif path.is_file():
            builder = _BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise UserError(f"{path}: not a dataset file; give a {', '.join(_BUILDERS)} file or a folder")
            data = datasets.load_dataset(builder, data_files=str(path), streaming=True)
        elif path.is_dir():
            data = datasets.load_dataset(str(path), streaming=True)
        elif _HUB_NAME.match(source) and not source.endswith(tuple(_BUILDERS)):
            data = datasets.load_dataset(source, config_name, streaming=True)
        else:
            raise UserError(f"SOURCE {source}: no such file or folder; give a parquet/arrow file, a folder, "
                            "or a Hugging Face hub dataset name")
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "local" if path.exists() else "hub"
        hint = ("" if where == "local" else
                " (a hub name needs a network, with HF_HUB_OFFLINE unset; or give local files)")
        raise UserError(f"SOURCE {source}: could not load it as a dataset ({reason}){hint}") from e
    return _pick_split(data, split, source)


def _pick_split(data: Any, split: str | None, source: str) -> Any:
    if not hasattr(data, "keys"):  # a single split already
        if split is not None:
            raise UserError(f"--split {split}: {source} holds a single split; leave --split out")
        return data
    names = list(data.keys())
    if split is None:
        split = "train" if "train" in names else names[0] if len(names) == 1 else None
        if split is None:
            raise UserError(f"{source} has splits {', '.join(names)}; choose one with --split")
    if split not in names:
        raise UserError(f"--split {split}: {source} has no such split{did_you_mean(split, names)}; "
                        f"choose one of {', '.join(names)}")
    return data[split]


def _column_kinds(dataset: Any) -> dict[str, str]:
    """Each column's kind: 'image' (Image feature), 'text', 'list' or the feature's type name."""
    datasets = _datasets()
    features = dataset.features
    if features is None:  # streamed formats without a schema: look at the first row
        first = next(iter(dataset), {})
        return {name: "text" if isinstance(value, str) else type(value).__name__ for name, value in first.items()}
    kinds = {}
    for name, feature in features.items():
        if isinstance(feature, datasets.Image):
            kinds[name] = "image"
        elif isinstance(feature, datasets.Value):
            kinds[name] = "text" if feature.dtype in ("string", "large_string") else feature.dtype
        elif isinstance(feature, (list, datasets.List, datasets.LargeList)):
            kinds[name] = "list"
        else:
            kinds[name] = type(feature).__name__
    return kinds


def choose_columns(kinds: dict[str, str], image_column: str | None, caption_column: str | None,
                   source: str) -> tuple[str, str]:
    """The image and caption columns, given or detected; a wrong name lists the columns."""
    listing = ", ".join(f"{n} ({k})" for n, k in kinds.items())
    for flag, name in (("--image_column", image_column), ("--caption_column", caption_column)):
        if name is not None and name not in kinds:
            raise UserError(f"{flag} {name}: {source} has no such column{did_you_mean(name, kinds)}; "
                            f"its columns: {listing}")
    if image_column is None:
        image_column = next((n for n, k in kinds.items() if k == "image"), None)
        if image_column is None:
            raise UserError(f"{source} has no image column; name the column holding images (or image paths) "
                            f"with --image_column; its columns: {listing}")
    if image_column in kinds and kinds[image_column] not in ("image", "text", "binary", "large_binary", "dict"):
        raise UserError(f"--image_column {image_column}: the column holds {kinds[image_column]} values, not "
                        f"images; its columns: {listing}")
    if caption_column is None:
        caption_column = next((n for n in CAPTION_COLUMNS if n in kinds and n != image_column), None)
        if caption_column is None:
            raise UserError(f"{source}: no caption column found; choose one with --caption_column; its "
                            f"columns: {listing}")
    if caption_column == image_column:
        raise UserError(f"--caption_column {caption_column} is the image column; choose the column with the "
                        f"captions; its columns: {listing}")
    return image_column, caption_column


def _raw_rows(dataset: Any, image_column: str, caption_column: str, is_image: bool) -> Iterator[dict[str, Any]]:
    """Rows of the two columns, with images left encoded (``{"bytes", "path"}``): nothing is decoded
    twice, and rows already converted cost only a read."""
    dataset = dataset.select_columns([image_column, caption_column])
    if is_image:
        dataset = dataset.cast_column(image_column, _datasets().Image(decode=False))
    return iter(dataset)


def _row_count(dataset: Any, source: str) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        pass
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq
        return pq.ParquetFile(path).metadata.num_rows
    return None


# ------------------------------------------------------------------------------ one row

def image_bytes(value: Any, base: Path | None) -> bytes:
    """The encoded image in a cell: ``{"bytes", "path"}``, raw bytes, a path (relative to ``base``), or a
    decoded PIL image (encoded as PNG)."""
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        if value.get("bytes"):
            return value["bytes"]
        value = value["path"]
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return buffer.getvalue()
    if isinstance(value, str):
        path = Path(value)
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            raise _NotAnImage(f"'{value}' is not an image file")
        return path.read_bytes()
    raise _NotAnImage(f"a {type(value).__name__} value is not an image")


def checked_image(data: bytes) -> tuple[bytes, str]:
    """``(bytes, extension)`` to write: the same bytes for formats training reads, else a PNG. The image
    is decoded completely, so a truncated file is caught here and not in training."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            if image.format in KEPT_FORMATS:
                return data, KEPT_FORMATS[image.format]
            buffer = io.BytesIO()
            to_rgb(image).save(buffer, format="PNG")
            return buffer.getvalue(), ".png"
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise _Unreadable(f"unreadable image ({e})") from e


def caption_text(value: Any) -> str | None:
    """A caption cell as one line: a string, or the first non-empty string of a list."""
    if isinstance(value, (list, tuple)):
        value = next((v for v in value if isinstance(v, str) and v.strip()), None)
    if not isinstance(value, str) or not value.strip():
        return None
    return " ".join(value.split())


# ------------------------------------------------------------------------------ the output folder

def check_output(output_dir: Path, identity: dict[str, Any]) -> dict[str, str]:
    """Refuse an ``output_dir`` this run must not write into; return the images already there by stem. A
    non-empty folder must be an earlier run's on the same data: nothing else of the user's is written into or
    over. Writes nothing: the folder is made when the first image is (see :func:`open_output`)."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"OUT {output_dir} is a file; give a folder")
    check_folder_can_be_made(output_dir, "OUT")
    marker = output_dir / MARKER_NAME
    images = ({p.stem: p.name for p in output_dir.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS}
              if output_dir.is_dir() else {})
    if output_dir.is_dir() and any(output_dir.iterdir()) and not marker.is_file():
        raise UserError(f"OUT {output_dir} is not empty and was not made by 'dataset from-hf'; give a new "
                        "or empty folder")
    if images:
        try:
            earlier = json.loads(marker.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{marker} is damaged; delete OUT {output_dir} and run again") from None
        changed = next((k for k in identity if earlier.get(k) != identity[k]), None)
        if changed is not None:
            raise UserError(f"OUT {output_dir} was made with {changed} = {earlier.get(changed)!r}, not "
                            f"{identity[changed]!r}; give the same source and columns to continue, or a new folder")
    return images


def open_output(output_dir: Path, identity: dict[str, Any]) -> None:
    """Create or reopen ``output_dir`` (checked by :func:`check_output`) and mark it as this conversion's."""
    output_dir.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(output_dir / MARKER_NAME, json.dumps(identity, indent=1).encode())
    for stale in output_dir.glob(".*.tmp"):  # an interrupted write; its row is converted again
        stale.unlink()


def write_metadata(output_dir: Path, captions: dict[str, dict[str, str]]) -> Path:
    path = output_dir / METADATA_NAME
    write_bytes_atomic(path, json.dumps(captions, ensure_ascii=False, indent=1).encode("utf-8"))
    return path


def bucket_limits(resolution: int) -> tuple[int, int, int]:
    """``(min_bucket_reso, max_bucket_reso, bucket_reso_steps)`` that bracket ``resolution``: sd-scripts'
    256..2048 in steps of 64 at 1024 px, scaled down for small test resolutions (whose buckets would
    otherwise lie outside the defaults and be refused), with steps a multiple of 16 (FLUX's packing)."""
    steps = 64 if resolution >= 512 else 16
    low = max(steps, resolution // 4 // steps * steps)
    return low, max(resolution * 2, 1024), steps


def write_dataset_toml(output_dir: Path, resolution: int) -> Path:
    """A fine-tuning dataset config over the folder, ready for ``--dataset_config`` at ``resolution``."""
    folder = output_dir.resolve()
    low, high, steps = bucket_limits(resolution)
    text = (f"# Written by 'dreamstep dataset from-hf': images in this folder, captions in {METADATA_NAME}.\n"
            f"[general]\nresolution = {resolution}\nenable_bucket = true\nmin_bucket_reso = {low}\n"
            f"max_bucket_reso = {high}\nbucket_reso_steps = {steps}\n\n"
            f"[[datasets]]\n\n[[datasets.subsets]]\nimage_dir = {toml_value(str(folder))}\n"
            f"metadata_file = {toml_value(str(folder / METADATA_NAME))}\n")
    path = output_dir / TOML_NAME
    write_bytes_atomic(path, text.encode("utf-8"))
    return path


# ------------------------------------------------------------------------------ the conversion

def convert(rows: Iterable[dict[str, Any]], image_column: str, caption_column: str, output_dir: Path,
            existing: dict[str, str], base: Path | None, total: int | None, limit: int | None,
            identity: dict[str, Any]) -> Conversion:
    """Write each row's image and collect its caption; metadata.json is saved as it goes and at the end. The
    folder is opened (made, marked with ``identity``) at the first image, so a source with none leaves nothing."""
    result = Conversion(output_dir)
    captions: dict[str, dict[str, str]] = {}
    opened = False
    bar = tqdm(total=min(total, limit) if total is not None and limit else total or limit, unit="row",
               desc="from-hf")
    try:
        for index, row in enumerate(rows):
            if limit is not None and index >= limit:
                break
            bar.update(1)
            caption = caption_text(row[caption_column])
            if caption is None:
                result.no_caption.append(index)
                continue
            stem = f"{index:06d}"
            name = existing.get(stem)
            if name is not None:
                result.kept += 1
            else:
                image = _row_image(row[image_column], base, index, result, image_column)
                if image is None:
                    continue
                if not opened:
                    open_output(output_dir, identity)
                    opened = True
                data, extension = image
                name = f"{stem}{extension}"
                write_bytes_atomic(output_dir / name, data)
                result.written += 1
            captions[name] = {"caption": caption}
            if len(captions) % SAVE_EVERY == 0:
                write_metadata(output_dir, captions)
    finally:
        bar.close()
        if captions:
            write_metadata(output_dir, captions)
    return result


def _row_image(value: Any, base: Path | None, index: int, result: Conversion,
               image_column: str) -> tuple[bytes, str] | None:
    """The row's image as ``(bytes, extension)`` to write, or ``None`` (noted in ``result``) when unreadable."""
    try:
        return checked_image(image_bytes(value, base))
    except _NotAnImage as e:
        if result.images == 0:  # the first image cell already holds none: the wrong column
            raise UserError(f"--image_column {image_column}: row {index} holds no image ({e}); choose the "
                            "column with the images") from None
        result.unreadable.append((index, str(e)))
    except _Unreadable as e:
        result.unreadable.append((index, str(e)))
    return None


def convert_dataset(source: str, output_dir: str | Path, *, image_column: str | None = None,
                    caption_column: str | None = None, split: str | None = None, config_name: str | None = None,
                    limit: int | None = None, resolution: int = 1024) -> Conversion:
    """Convert ``split`` of ``source`` into ``output_dir`` (continuing an earlier run there), up to ``limit``
    rows, and write a ``dataset.toml`` for ``resolution``; the columns default to the first image and
    caption columns found."""
    dataset = load_source(source, split, config_name)
    kinds = _column_kinds(dataset)
    image_column, caption_column = choose_columns(kinds, image_column, caption_column, source)
    source_path = Path(source).expanduser()
    identity = {"source": str(source_path.resolve()) if source_path.exists() else source,
                "split": split, "dataset_config_name": config_name,
                "image_column": image_column, "caption_column": caption_column}
    output_dir = Path(output_dir).expanduser()
    existing = check_output(output_dir, identity)
    rows = _raw_rows(dataset, image_column, caption_column, kinds[image_column] == "image")
    base = source_path if source_path.is_dir() else source_path.parent if source_path.exists() else None
    result = convert(rows, image_column, caption_column, output_dir, existing, base,
                     _row_count(dataset, source), limit, identity)
    if result.images == 0:
        raise UserError(f"{source}: no row had both an image and a caption in columns "
                        f"'{image_column}' and '{caption_column}'; check --image_column and --caption_column")
    write_dataset_toml(output_dir, resolution)
    return result
