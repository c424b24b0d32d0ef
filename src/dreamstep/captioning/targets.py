"""Which images ``dreamstep caption`` captions and where each caption goes (torch-free).

A caption goes where the trainers read it: a file beside the image, named like it with the caption extension
(the trainers read its first line), or a row of the folder's ``metadata.jsonl`` (``file_name`` and ``text``,
the Hugging Face image-folder layout; a file that names its caption column ``caption`` keeps that name).
An image that has a caption is done: it is skipped unless ``--overwrite`` or ``--append``, so a second run
captions only what the first did not reach. Every file is written atomically (:mod:`dreamstep.files`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from dreamstep.data.dataset_config import load_dataset_config
from dreamstep.data.images import IMAGE_EXTENSIONS, list_images
from dreamstep.errors import UserError
from dreamstep.files import write_text_atomic

DEFAULT_EXTENSION = ".txt"
METADATA_FILE = "metadata.jsonl"
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(frozen=True)
class CaptionFolder:
    """A folder of images and how its captions are stored: files with ``extension``, or ``metadata.jsonl``
    when ``extension`` is None."""

    path: Path
    extension: str | None

    def describe(self) -> str:
        kind = f"{self.extension} files" if self.extension else METADATA_FILE
        return f"{self.path} ({kind})"


@dataclass(frozen=True)
class Target:
    image: Path
    folder: CaptionFolder
    existing: str | None  # the caption the image has now


def one_line(text: str) -> str:
    """A caption as one line without control characters: the trainers read only a caption file's first line,
    so a model's paragraph breaks would silently cut the caption short."""
    return " ".join(_CONTROL.sub(" ", text).split())


def caption_folders(source: Path, extension: str | None, metadata_jsonl: bool) -> tuple[list[CaptionFolder],
                                                                                       list[str]]:
    """The folders to caption from ``source`` (see :class:`~dreamstep.config.caption.CaptionConfig`), and
    notes about subsets left out."""
    source = Path(source)
    if source.is_file():
        return _toml_folders(source, extension, metadata_jsonl)
    if not source.is_dir():
        raise UserError(f"{source}: no such folder or dataset TOML; give an image folder or a dataset .toml")
    chosen = None if metadata_jsonl else extension or DEFAULT_EXTENSION
    if _has_images(source):
        return [CaptionFolder(source, chosen)], []
    # sd-scripts' DreamBooth layout: the images are in <repeats>_<class tokens> folders.
    folders = [CaptionFolder(sub, chosen) for sub in sorted(p for p in source.iterdir() if p.is_dir())
               if not sub.name.startswith(".") and _has_images(sub)]
    if not folders:
        kinds = ", ".join(IMAGE_EXTENSIONS)
        raise UserError(f"{source}: no images ({kinds}) in the folder or its subfolders; give the image folder")
    return folders, []


def _has_images(folder: Path) -> bool:
    return any(p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS for p in folder.iterdir())


def _toml_folders(toml: Path, extension: str | None, metadata_jsonl: bool) -> tuple[list[CaptionFolder], list[str]]:
    # The captioner needs no resolution; the trainer's own default keeps a TOML without one readable.
    datasets = load_dataset_config(toml, cli={"resolution": 1024})
    folders: list[CaptionFolder] = []
    notes = []
    for dataset in datasets:
        for subset in dataset.subsets:
            if subset.metadata_file is not None:
                notes.append(f"{subset.where}: captions come from {subset.metadata_file}; not captioned")
                continue
            if subset.is_reg and subset.class_tokens:
                # Caption files would replace the class prompt the regularization images train with.
                notes.append(f"{subset.where}: regularization images, captioned by class_tokens "
                             f"'{subset.class_tokens}'; not captioned (give their folder to caption them anyway)")
                continue
            assert subset.image_dir is not None
            list_images(subset.image_dir, f"{subset.where}: image_dir")
            chosen = None if metadata_jsonl else extension or subset.caption_extension or DEFAULT_EXTENSION
            folder = CaptionFolder(subset.image_dir, chosen)
            if folder not in folders:
                folders.append(folder)
    return folders, notes


def read_metadata(folder: Path) -> list[dict]:
    """The rows of ``folder/metadata.jsonl`` (none when there is no such file)."""
    path = folder / METADATA_FILE
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: line {number} is not JSON ({e.msg}); fix or remove that line") from None
        if not isinstance(row, dict) or not isinstance(row.get("file_name"), str):
            raise UserError(f"{path}: line {number} has no file_name; every row names its image in file_name")
        rows.append(row)
    return rows


def _caption_column(rows: list[dict]) -> str:
    return "caption" if rows and "caption" in rows[0] and "text" not in rows[0] else "text"


def read_caption(image: Path, folder: CaptionFolder, metadata: dict[str, str] | None = None) -> str | None:
    """The caption ``image`` has now, or None (an empty caption file counts as none)."""
    if folder.extension is None:
        return (metadata or {}).get(image.name) or None
    path = image.with_suffix(folder.extension)
    if not path.is_file():
        return None
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"{path}: caption file is not UTF-8 text; re-save it as UTF-8") from None
    return lines[0].strip() if lines and lines[0].strip() else None


def find_targets(folders: list[CaptionFolder], redo: bool) -> tuple[list[Target], int]:
    """Images to caption, and how many are skipped because they have a caption (all are taken with ``redo``)."""
    targets, done = [], 0
    for folder in folders:
        rows = read_metadata(folder.path) if folder.extension is None else []
        column = _caption_column(rows)
        metadata = {row["file_name"]: str(row.get(column) or "") for row in rows}
        for image in list_images(folder.path, str(folder.path)):
            existing = read_caption(image, folder, metadata)
            if existing is not None and not redo:
                done += 1
                continue
            _check_caption_path(image, folder)
            targets.append(Target(image, folder, existing))
    return targets, done


def _check_caption_path(image: Path, folder: CaptionFolder) -> None:
    """Refuse, before the captioner loads, a caption path that holds something other than a file (a folder): the
    write would fail after other captions were written."""
    path = image.with_suffix(folder.extension) if folder.extension is not None else folder.path / METADATA_FILE
    if path.exists() and not path.is_file():
        raise UserError(f"{path}: not a file, so the caption of {image.name} cannot be written there; rename or "
                        "remove it, or pick another --caption_extension")


def compose(generated: str, existing: str | None, *, append: bool, prefix: str, tags: bool) -> str:
    """The caption to write: ``generated`` (after ``existing`` with ``append``: for tags only the tags it does
    not have), with ``prefix`` in front unless the caption already starts with it."""
    generated = one_line(generated)
    if append and existing:
        if tags:
            have = [t.strip() for t in existing.split(",") if t.strip()]
            new = [t for t in (t.strip() for t in generated.split(",")) if t and t not in have]
            caption = ", ".join(have + new)
        else:
            caption = existing if generated in existing else f"{existing} {generated}"
    else:
        caption = generated
    if prefix and not caption.startswith(prefix.strip()):
        caption = prefix + caption
    return one_line(caption)


@dataclass
class CaptionWriter:
    """Writes captions as they come (``metadata.jsonl`` at each :meth:`flush`, once per batch), so an
    interrupted run keeps what it finished."""

    written: list[Path] = field(default_factory=list)
    _metadata: dict[Path, list[dict]] = field(default_factory=dict)
    _unsaved: set[Path] = field(default_factory=set)

    def write(self, target: Target, caption: str) -> Path:
        folder = target.folder
        if folder.extension is not None:
            path = target.image.with_suffix(folder.extension)
            write_text_atomic(path, caption + "\n")
        else:
            path = folder.path / METADATA_FILE
            rows = self._metadata.setdefault(folder.path, read_metadata(folder.path))
            column = _caption_column(rows)
            row = next((r for r in rows if r["file_name"] == target.image.name), None)
            if row is None:
                rows.append({"file_name": target.image.name, column: caption})
            else:
                row[column] = caption
            self._unsaved.add(folder.path)
        self.written.append(path)
        return path

    def flush(self) -> None:
        for folder in sorted(self._unsaved):
            rows = self._metadata[folder]
            write_text_atomic(folder / METADATA_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        self._unsaved.clear()
