"""How ComfyUI reads and applies a LyCORIS file, written by us from its code, so tests can check every key of a
file we write lands, and with the trained weight.

``comfy/lora.py`` ``load_lora``: per mapped module name ``x``, ``x.alpha`` and ``x.dora_scale`` are read, then
each weight adapter tries its keys (``comfy/weight_adapter/lora.py``: ``x.lora_up.weight``/``x.lora_down.weight``
(``x.lora_mid.weight``); ``loha.py``: ``x.hada_w1_a``, ``_w1_b``, ``_w2_a``, ``_w2_b`` (``x.hada_t1``, ``_t2``);
``lokr.py``: ``x.lokr_w1`` or ``x.lokr_w1_a``/``_b``, ``x.lokr_w2`` or ``x.lokr_w2_a``/``_b`` (``x.lokr_t2``)); a
key nothing consumed is "lora key not loaded". ``calculate_weight``: LoRA ``up @ down · alpha/rank`` (rank:
down's rows); LoHa ``(w1_a @ w1_b) * (w2_a @ w2_b) · alpha/rank`` (rank: ``w1_b``'s rows); LoKr
``kron(w1, w2) · alpha/rank`` (rank: the rows of the last decomposed factor's ``_b``; no decomposed factor: scale
1); no alpha: scale 1. With ``dora_scale``, ``weight_decompose`` (``comfy/weight_adapter/base.py``):
``W' = (W + ΔW) · dora_scale / ‖·‖``, where the norm is the *base* weight's per output row when ``dora_scale``
has a row per output (``dora_scale.shape[0] == weight.shape[0]``), else the adapted weight's per input column.
ComfyUI before that branch and A1111's ``network.py`` ``apply_weight_decompose`` always take the column norm of
the adapted weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

LOHA_KEYS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
LOKR_KEYS = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


@dataclass
class ComfyPatch:
    """One module as ComfyUI's loader holds it: the adapter kind, its tensors, alpha and dora_scale."""

    kind: str
    tensors: dict[str, torch.Tensor]
    alpha: float | None
    dora_scale: torch.Tensor | None


def comfy_load_lycoris(tensors: Mapping[str, torch.Tensor], names: Mapping[str, object]
                       ) -> tuple[dict[str, ComfyPatch], list[str]]:
    """``load_lora`` over the module names ComfyUI maps (``names``): {name: patch}, and the keys not loaded."""
    patches, loaded = {}, set()
    for x in names:
        alpha = tensors.get(f"{x}.alpha")
        dora = tensors.get(f"{x}.dora_scale")
        own = {}
        if f"{x}.lora_up.weight" in tensors:
            own = {k: tensors[f"{x}.{k}"] for k in ("lora_up.weight", "lora_down.weight", "lora_mid.weight")
                   if f"{x}.{k}" in tensors}
            kind = "lora"
        elif f"{x}.hada_w1_a" in tensors:
            own = {k: tensors[f"{x}.{k}"] for k in (*LOHA_KEYS, "hada_t1", "hada_t2") if f"{x}.{k}" in tensors}
            kind = "loha"
        elif any(f"{x}.{k}" in tensors for k in ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w2_a")):
            own = {k: tensors[f"{x}.{k}"] for k in LOKR_KEYS if f"{x}.{k}" in tensors}
            kind = "lokr"
        if not own:
            continue
        loaded |= {f"{x}.{k}" for k in own} | {f"{x}.alpha", f"{x}.dora_scale"}
        patches[x] = ComfyPatch(kind, own, None if alpha is None else alpha, dora)
    return patches, sorted(k for k in tensors if k not in loaded)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.flatten(1) @ b.flatten(1)


def diff_shape(patch: ComfyPatch) -> tuple[int, int]:
    """(rows, columns) of the delta ComfyUI builds, before it reshapes it to the weight (works on meta tensors)."""
    t = patch.tensors
    if patch.kind == "lora":
        return t["lora_up.weight"].shape[0], t["lora_down.weight"].flatten(1).shape[1]
    if patch.kind == "loha":
        return t["hada_w1_a"].shape[0], t["hada_w1_b"].shape[1]
    w1 = t["lokr_w1"].shape if "lokr_w1" in t else (t["lokr_w1_a"].shape[0], t["lokr_w1_b"].shape[1])
    w2 = t["lokr_w2"].flatten(1).shape if "lokr_w2" in t else (t["lokr_w2_a"].shape[0],
                                                               t["lokr_w2_b"].flatten(1).shape[1])
    return w1[0] * w2[0], w1[1] * w2[1]


def comfy_weight(patch: ComfyPatch, weight: torch.Tensor) -> torch.Tensor:
    """The weight ComfyUI computes (``calculate_weight`` at strength 1), in float64."""
    t = {k: v.double() for k, v in patch.tensors.items()}
    rank = None
    if patch.kind == "lora":
        diff, rank = _mm(t["lora_up.weight"], t["lora_down.weight"]), t["lora_down.weight"].shape[0]
    elif patch.kind == "loha":
        diff = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
        rank = t["hada_w1_b"].shape[0]
    else:
        w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
        rank = t["lokr_w1_b"].shape[0] if "lokr_w1_a" in t else None
        if "lokr_w2" in t:
            w2 = t["lokr_w2"]
        else:
            w2, rank = t["lokr_w2_a"] @ t["lokr_w2_b"], t["lokr_w2_b"].shape[0]
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        diff = torch.kron(w1, w2)
    scale = float(patch.alpha) / rank if patch.alpha is not None and rank is not None else 1.0
    weight = weight.double()
    diff = diff.reshape(weight.shape) * scale
    if patch.dora_scale is None:
        return weight + diff
    dora = patch.dora_scale.double()
    adapted = weight + diff
    if dora.shape[0] == weight.shape[0]:
        norm = weight.reshape(weight.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (weight.dim() - 1))
    else:
        norm = adapted.transpose(0, 1).reshape(weight.shape[1], -1).norm(dim=1).reshape(
            weight.shape[1], *[1] * (weight.dim() - 1)).transpose(0, 1)
    return adapted * (dora / (norm + torch.finfo(torch.float64).eps))
