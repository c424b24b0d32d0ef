"""Reading and writing LoRA tensor files: ``.safetensors`` (with its string header), torch ``.ckpt``/``.pt``
pickles, and MindSpore ``.ckpt`` protobufs. The container is told from the file's first bytes, not its name,
because sd-scripts and MindSpore both call theirs ``.ckpt``.
"""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from dreamstep.errors import UserError, is_refused_pickle
from dreamstep.files import atomic_path
from dreamstep.lora.formats import ADAPTER_METADATA_KEY
from dreamstep.lora.mindspore_ckpt import load_mindspore_ckpt, save_mindspore_ckpt

CONTAINERS = ("safetensors", "torch", "mindspore")
_SUFFIX_CONTAINER = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch",
                     ".ckpt": "torch"}


@dataclass
class LoraFile:
    """The raw contents of a LoRA file: tensors by key, and the header's string metadata (safetensors only)."""

    path: Path
    container: str
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)


def sniff_container(path: Path) -> str:
    """'safetensors', 'torch' or 'mindspore' from the first bytes of ``path``."""
    with open(path, "rb") as f:
        head = f.read(16)
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"  # u64 little-endian header size, then the JSON header
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return "torch"  # torch.save's zip archive, or a legacy pickle
    if head[:1] == b"\x0a":
        return "mindspore"  # protobuf field 1 (Checkpoint.value), length-delimited
    raise UserError(f"{path}: not a LoRA file dreamstep can read (expected .safetensors, a torch .ckpt/.pt "
                    f"or a MindSpore .ckpt)")


def _read_safetensors(path: Path) -> LoraFile:
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
        tensors = safetensors.torch.load_file(str(path))
    except (safetensors.SafetensorError, OSError, ValueError, struct.error) as e:
        raise UserError(f"{path}: not a readable safetensors file (truncated or corrupt: {e})") from None
    return LoraFile(path, "safetensors", tensors, metadata)


def _read_torch(path: Path) -> LoraFile:
    try:
        # A file object, not the path: torch.load hands any *.safetensors path to safetensors, and a pickle
        # renamed to .safetensors must still be read as the pickle it is.
        with open(path, "rb") as f:
            obj = torch.load(f, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile, OSError) as e:
        if is_refused_pickle(e):
            raise UserError(f"{path}: the torch checkpoint holds pickled objects other than tensors, which may "
                            "run code, so dreamstep does not load it; get the LoRA as a .safetensors file") from None
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: not a readable torch checkpoint (truncated, corrupt or not plain tensors: "
                        f"{first_line})") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise UserError(f"{path}: the torch checkpoint holds a {type(obj).__name__}, not a dict of tensors")
    for key, value in obj.items():
        if not isinstance(value, torch.Tensor):
            raise UserError(f"{path}: entry '{key}' is a {type(value).__name__}, not a tensor")
    return LoraFile(path, "torch", dict(obj))


def read_lora_file(path: str | Path) -> LoraFile:
    """Read any supported container; a missing, truncated or corrupt file is a UserError naming it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    container = sniff_container(path)
    if container == "safetensors":
        return _read_safetensors(path)
    if container == "torch":
        return _read_torch(path)
    return LoraFile(path, "mindspore", load_mindspore_ckpt(path))


def container_for(path: str | Path) -> str:
    """The container a path's suffix asks for: .safetensors, .ckpt/.pt/.pth/.bin (torch)."""
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIX_CONTAINER:
        raise UserError(f"{path}: unknown output suffix '{suffix}'; use .safetensors, .ckpt, .pt or .pth")
    return _SUFFIX_CONTAINER[suffix]


def write_lora_file(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                    container: str) -> None:
    """Write atomically (a temporary file renamed into place). Only safetensors keeps ``metadata``."""
    path = Path(path)
    # Own copies: split or shared tensors (one down behind q, k and v) are views of one storage,
    # which safetensors refuses to write.
    tensors = {k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}
    if container not in CONTAINERS:
        raise ValueError(f"unknown container {container!r}; expected one of {CONTAINERS}")
    with atomic_path(path) as tmp:
        if container == "safetensors":
            safetensors.torch.save_file(tensors, str(tmp), metadata={"format": "pt", **metadata})
        elif container == "torch":
            torch.save(tensors, tmp)
        else:
            save_mindspore_ckpt(tensors, tmp)


def adapter_metadata(lora_file: LoraFile) -> dict | None:
    """The PEFT adapter configs diffusers stores in a safetensors header, or None when there are none."""
    raw = lora_file.metadata.get(ADAPTER_METADATA_KEY)
    if not raw:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise UserError(f"{lora_file.path}: the '{ADAPTER_METADATA_KEY}' header is not valid JSON ({e})") from None
