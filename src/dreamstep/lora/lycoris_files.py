"""Reading LyCORIS files (LoKr, LoHa, LoCon/LoRA with Tucker or DoRA): which model they are for, each module's
algorithm and settings as its tensors show them, the diffusers module each one adapts, and the ``lora info``
report for them. Algorithms are told by LyCORIS' own rules (:func:`lycoris.modules.get_module`)."""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from dreamstep.errors import UserError
from dreamstep.lora import formats
from dreamstep.lora.io import LoraFile, read_lora_file
from dreamstep.lora.lycoris_network import ALGORITHM_NAMES, FLUX_PREFIX
from dreamstep.models.family import families, guess_family, model_title
from dreamstep.models.lora_keys import ModelKeys

# Text encoder file prefixes (sd-scripts' names, both models) -> component.
_TEXT_PREFIXES = {"lora_te1": "text_encoder", "lora_te2": "text_encoder_2", "lora_te3": "text_encoder_2"}


@dataclass(frozen=True)
class LycorisModule:
    """One module of a LyCORIS file: its name in the file, the algorithm and its settings, and its tensors."""

    name: str
    algorithm: str
    tensors: dict[str, torch.Tensor]

    @property
    def alpha(self) -> float | None:
        return float(self.tensors["alpha"]) if "alpha" in self.tensors else None

    @property
    def parameters(self) -> int:
        return sum(t.numel() for k, t in self.tensors.items() if k != "alpha")

    @property
    def settings(self) -> str:
        """What the tensors show: rank (or full matrix), LoKr factor, Tucker, DoRA."""
        t = self.tensors
        parts = []
        if self.algorithm == "LoKr":
            w1 = t["lokr_w1"].shape if "lokr_w1" in t else (t["lokr_w1_a"].shape[0], t["lokr_w1_b"].shape[1])
            parts.append(f"factor {max(w1)}")
            parts.append(f"rank {t['lokr_w2_b'].shape[0]}" if "lokr_w2_b" in t else "full matrix")
            if "lokr_w1_a" in t:
                parts.append("decompose both")
        elif self.algorithm == "LoHa":
            parts.append(f"rank {t['hada_w1_b'].shape[0]}")
        else:
            parts.append(f"rank {t['lora_down.weight'].shape[0]}")
        if any(k in t for k in ("lokr_t2", "hada_t1", "lora_mid.weight")):
            parts.append("Tucker")
        if "dora_scale" in t:
            parts.append("DoRA by input column" if self.by_column else "DoRA")
        return ", ".join(parts)

    @property
    def by_column(self) -> bool:
        """A DoRA with one magnitude per input column (``dora_scale`` of shape (1, in, ...))."""
        return "dora_scale" in self.tensors and self.tensors["dora_scale"].shape[0] != self.delta_shape[0]

    @property
    def delta_shape(self) -> tuple[int, int]:
        """(output rows, inputs x kernel) of the weight this module changes."""
        t = self.tensors
        if self.algorithm == "LoHa":
            return t["hada_w1_a"].shape[0], t["hada_w1_b"].shape[1]
        if self.algorithm == "LoKr":
            w1 = t["lokr_w1"].shape if "lokr_w1" in t else (t["lokr_w1_a"].shape[0], t["lokr_w1_b"].shape[1])
            w2 = (t["lokr_w2"].flatten(1).shape if "lokr_w2" in t
                  else (t["lokr_w2_a"].shape[0], t["lokr_w2_b"].flatten(1).shape[1]))
            kernel = t["lokr_t2"][0, 0].numel() if "lokr_t2" in t else 1
            return w1[0] * w2[0], w1[1] * w2[1] * kernel
        down = t["lora_down.weight"]
        kernel = t["lora_mid.weight"][0, 0].numel() if "lora_mid.weight" in t else 1
        return t["lora_up.weight"].shape[0], down[0].numel() * kernel


@dataclass
class LycorisFile:
    """A LyCORIS file read into modules, with the model it is for."""

    path: Path
    container: str
    model: str | None
    modules: dict[str, LycorisModule]
    metadata: dict[str, str]

    @property
    def format(self) -> str:
        """e.g. 'lycoris-flux'."""
        return f"lycoris-{self.model or 'unknown'}"

    @property
    def algorithms(self) -> list[str]:
        return sorted({m.algorithm for m in self.modules.values()})


def read_lycoris(path: str | Path, model: str | None = None, lora_file: LoraFile | None = None) -> LycorisFile:
    """Read a LyCORIS file; every key must belong to a module LyCORIS recognises."""
    from lycoris.modules import get_module

    lora_file = lora_file or read_lora_file(path)
    source = str(lora_file.path)
    names = sorted({key.split(".", 1)[0] for key in lora_file.tensors})
    modules = {}
    for name in names:
        kind, _ = get_module(lora_file.tensors, name)
        if kind is None or kind.__name__ not in ALGORITHM_NAMES:
            raise UserError(f"{source}: module '{name}' is no LoRA, LoHa or LoKr module (keys "
                            f"{', '.join(k for k in lora_file.tensors if k.startswith(name + '.'))})")
        prefix = f"{name}."
        modules[name] = LycorisModule(name, ALGORITHM_NAMES[kind.__name__],
                                      {k[len(prefix):]: v for k, v in lora_file.tensors.items()
                                       if k.startswith(prefix)})
    guessed = guess_family(names)[0]
    if model is not None and guessed is not None and guessed != model:
        raise UserError(f"{source}: this LyCORIS file is for {model_title(guessed)}, not {model_title(model)}")
    return LycorisFile(lora_file.path, lora_file.container, model or guessed, modules, lora_file.metadata)


def lycoris_readers(model: str | None) -> str:
    """Who reads a LyCORIS file of family ``model`` as it is."""
    return families()[model].lycoris_readers if model in families() else "ComfyUI, Forge"


def diffusers_names(keys: ModelKeys, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """{file module name: diffusers module name} for a model: sd-scripts' names from its key table, and the
    FLUX transformer's LyCORIS names (``lycoris_<path>``) from its module list (``shapes``' keys)."""
    out = {m.kohya: m.diffusers[0] for m in keys.maps if len(m.diffusers) == 1}
    out |= {FLUX_PREFIX + name.removeprefix("transformer.").replace(".", "_"): name
            for name in shapes if name.startswith("transformer.")}
    return out


def fit_problem(lycoris: LycorisFile, keys: ModelKeys, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """The first module that is not in the model, or whose weight has another shape; None when all fit."""
    names = diffusers_names(keys, shapes)
    for name, module in lycoris.modules.items():
        diffusers = names.get(name)
        if diffusers is None or diffusers not in shapes:
            return f"module '{name}' does not exist"
        shape = shapes[diffusers]
        weight = (shape[0], int(torch.Size(shape[1:]).numel()))
        if module.delta_shape != weight:
            return f"module '{name}' changes a {module.delta_shape[0]}x{module.delta_shape[1]} weight, " \
                   f"'{diffusers}' is {weight[0]}x{weight[1]}"
    return None


def _group(name: str) -> str:
    match = re.match(r"(.*?)_\d+(?=_|$)", name)
    return match.group(1) if match else name


def _component(name: str, model: str | None) -> str:
    prefix = name.split("_text_model")[0] if name.startswith("lora_te") else None
    if prefix in _TEXT_PREFIXES:
        return _TEXT_PREFIXES[prefix]
    return families()[model].denoiser if model in families() else "denoiser"


def report_lines(lycoris: LycorisFile, fits: str | None) -> list[str]:
    """The ``lora info`` lines after ``file:`` for a LyCORIS file."""
    target = model_title(lycoris.model) if lycoris.model else "unknown (pass --model)"
    components = sorted({_component(n, lycoris.model) for n in lycoris.modules})
    tensors = [t for m in lycoris.modules.values() for k, t in m.tensors.items() if k != "alpha"]
    readers = lycoris_readers(lycoris.model)
    layout = f"LyCORIS layout ({', '.join(lycoris.algorithms)}; {readers})"
    lines = [f"format:    lycoris-{lycoris.model or 'unknown'}: {layout}",
             f"target:    {target}: {', '.join(components)}"]
    if fits is not None:
        lines.append(f"fits:      {fits}")
    lines += [f"modules:   {len(lycoris.modules)}",
              f"params:    {sum(m.parameters for m in lycoris.modules.values()):,}",
              f"dtype:     {', '.join(sorted({str(t.dtype).removeprefix('torch.') for t in tensors}))}",
              "groups:"]
    groups: dict[tuple[str, str, str], list[LycorisModule]] = collections.defaultdict(list)
    for name, module in lycoris.modules.items():
        groups[(_group(name), module.algorithm, module.settings)].append(module)
    width = max(len(g[0]) for g in groups)
    for (group, algorithm, settings), modules in groups.items():
        alphas = sorted({m.alpha for m in modules if m.alpha is not None})
        alpha = f"  alpha {', '.join(f'{a:g}' for a in alphas)}" if alphas else ""
        count = f"{len(modules):>4} module{'s' if len(modules) != 1 else ' '}"
        lines.append(f"  {group:<{width}}  {count}  {algorithm} ({settings}){alpha}  "
                     f"{sum(m.parameters for m in modules):,} params")
    return lines


def dora_as_diffusers(lycoris: LycorisFile, keys: ModelKeys, shapes: Mapping[str, tuple[int, ...]]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """A LyCORIS DoRA (or plain LoRA) file as the diffusers/PEFT layout that ``load_lora_weights`` reads into
    peft's DoRA layers: ``<component>.<module>.lora_A.weight`` / ``.lora_B.weight`` (alpha / rank folded in) and
    ``.lora_magnitude_vector`` (LyCORIS' ``dora_scale``, one per output row, the norm peft divides by being the
    same one), with ``use_dora`` in the adapter header. None when a module is no plain LoRA (LoKr, LoHa,
    Tucker, or a per-input-column DoRA), which peft cannot hold."""
    from dreamstep.lora.layouts import LoraWeights, diffusers_adapter_metadata, fold_alpha

    names = diffusers_names(keys, shapes)
    modules, magnitudes = {}, {}
    for name, module in lycoris.modules.items():
        t = module.tensors
        if module.algorithm != "LoRA" or "lora_mid.weight" in t or name not in names:
            return None
        down, up = t["lora_down.weight"], t["lora_up.weight"]
        if "dora_scale" in t:
            if module.by_column:
                return None
            spatial = [1] * (down.dim() - 2)  # peft keeps a convolution's magnitudes as (1, out, 1, 1)
            magnitudes[names[name]] = t["dora_scale"].reshape(1, -1, *spatial) if spatial else t["dora_scale"].flatten()
        modules[names[name]] = LoraWeights(down, up, module.alpha or float(down.shape[0]))
    folded = fold_alpha(modules)
    tensors = {}
    for name, m in folded.items():
        tensors |= {f"{name}.lora_A.weight": m.down.contiguous(), f"{name}.lora_B.weight": m.up.contiguous()}
        if name in magnitudes:
            tensors[f"{name}.lora_magnitude_vector"] = magnitudes[name].contiguous()
    header = json.loads(diffusers_adapter_metadata(folded)[formats.ADAPTER_METADATA_KEY])
    components = {name.partition(".")[0] for name in magnitudes}
    header |= {f"{component}.use_dora": True for component in components}
    return tensors, {formats.ADAPTER_METADATA_KEY: json.dumps(header, indent=2, sort_keys=True)}
