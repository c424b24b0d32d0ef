"""sd-scripts' ``networks.lora_flux`` on diffusers' FLUX transformer: the modules, names and file sd-scripts has,
so its files load in sd-scripts, ComfyUI, Forge and diffusers.

sd-scripts adapts every Linear of Black Forest Labs' blocks (``double_blocks.{i}.img_attn.qkv`` …, ``single_blocks.
{i}.linear1`` …; :data:`dreamstep.models.flux.lora_keys.FLUX_DOUBLE_BLOCK`), where q, k and v (and a single block's
MLP input) are one fused Linear. diffusers keeps them as separate Linears of the same input, so a fused module here is
one ``lora_down`` (dim, in) and one ``lora_up`` (Σ rows, dim) whose row slices are added to each part's output through
forward hooks (:class:`FusedLoRAModule`): the same function and the same tensors as sd-scripts', computed on
diffusers' modules. With ``split_qkv=True`` each part has its own LoRA (sd-scripts' split form) and the file holds
them as sd-scripts saves them: the downs stacked (parts·dim, in), the ups block-diagonal (Σ rows, parts·dim), one
alpha (whose scale stays alpha / dim, as sd-scripts trains it).

CLIP-L gets sd-scripts' ``lora_te1_text_model_…`` modules unless ``--network_train_unet_only``; T5-XXL its
``lora_te3_encoder_block_…`` modules (attention q/k/v/o, the gated MLP's wi_0/wi_1/wo) with ``train_t5xxl=True``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dreamstep.config.flux_network_args import IN_DIM_NAMES, FluxNetworkOptions, block_selection
from dreamstep.lora.kohya_network import LoRAModule, LoRANetwork, text_model_path
from dreamstep.models.flux.lora_keys import FLUX_DOUBLE_BLOCK, FLUX_GLOBAL, FLUX_GUIDANCE, FLUX_SINGLE_BLOCK, flux_keys

# Where each kind of BFL block is in diffusers' transformer.
_BLOCKS = {"double_blocks": ("transformer_blocks", FLUX_DOUBLE_BLOCK),
           "single_blocks": ("single_transformer_blocks", FLUX_SINGLE_BLOCK)}


class FusedLoRAModule(LoRAModule):
    """sd-scripts' LoRA on a fused BFL Linear (``img_attn.qkv``, ``linear1``) over the diffusers Linears it is made
    of (``parts``, which all read the same input): ``lora_up``'s rows are the parts' outputs, in order. The down
    projection (with its dropout) is computed once per input and shared by the parts, as the fused Linear's is."""

    def __init__(self, parts: list[nn.Linear], dim: int, alpha: float, **dropouts: float | None):
        super().__init__(parts[0], dim, alpha, out_features=sum(p.out_features for p in parts), **dropouts)
        self._parts = tuple(parts)
        self._handles: list[Any] = []
        self._shared: list[Any] | None = None  # [input, (hidden, scale) or None, parts served]

    def attach(self) -> None:
        if not self._handles:
            offset = 0
            for part in self._parts:
                rows = slice(offset, offset + part.out_features)
                self._handles.append(part.register_forward_hook(functools.partial(self._part_hook, rows)))
                offset += part.out_features

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _part_hook(self, rows: slice, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        shared = self._shared_hidden(args[0])
        if shared is None:  # module dropout left the whole fused module out for this input
            return output
        hidden, scale = shared
        part = nn.functional.linear(hidden, self.lora_up.weight[rows])
        return output + (part * (self.multiplier * scale)).to(output.dtype)

    def _shared_hidden(self, x: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        if self._shared is None or self._shared[0] is not x:
            dropped = self.training and self.module_dropout and torch.rand(()) < self.module_dropout
            self._shared = [x, None if dropped else self.hidden(x), 0]
        self._shared[2] += 1
        result = self._shared[1]
        if self._shared[2] == len(self._parts):
            self._shared = None  # every part has its share: hold no activation past this point
        return result


class SplitLoRAModule(nn.Module):
    """sd-scripts' ``split_qkv`` form of a fused module: one LoRA per part, each at ``dim`` and ``alpha``."""

    def __init__(self, parts: list[nn.Linear], dim: int, alpha: float, **dropouts: float | None):
        super().__init__()
        self.parts = nn.ModuleList(LoRAModule(part, dim, alpha, **dropouts) for part in parts)

    def attach(self) -> None:
        for part in self.parts:
            part.attach()

    def detach(self) -> None:
        for part in self.parts:
            part.detach()

    def refresh_scale(self) -> None:
        for part in self.parts:
            part.refresh_scale()

    def to_file(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This module's tensors (``state``: its own state dict) as sd-scripts saves a split module."""
        downs = [state[f"parts.{i}.lora_down.weight"] for i in range(len(self.parts))]
        ups = [state[f"parts.{i}.lora_up.weight"] for i in range(len(self.parts))]
        return {"lora_down.weight": torch.cat(downs), "lora_up.weight": torch.block_diag(*ups),
                "alpha": state["parts.0.alpha"]}

    def from_file(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`to_file`: each part's down rows and diagonal block of the up weight."""
        state, row, dim = {}, 0, tensors["lora_down.weight"].shape[0] // len(self.parts)
        for i, part in enumerate(self.parts):
            rows = part.lora_up.weight.shape[0]
            state[f"parts.{i}.lora_down.weight"] = tensors["lora_down.weight"][i * dim:(i + 1) * dim]
            state[f"parts.{i}.lora_up.weight"] = tensors["lora_up.weight"][row:row + rows, i * dim:(i + 1) * dim]
            state[f"parts.{i}.alpha"] = tensors["alpha"]
            row += rows
        return state


class FluxLoRANetwork(LoRANetwork):
    """:class:`LoRANetwork` whose state dict is sd-scripts' FLUX file: split modules saved and read fused."""

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        own = super().state_dict(*args, **kwargs)
        for name, module in self.loras.items():
            if isinstance(module, SplitLoRAModule):
                mine = {k.removeprefix(f"{name}."): own.pop(k) for k in list(own) if k.startswith(f"{name}.")}
                own |= {f"{name}.{k}": v for k, v in module.to_file(mine).items()}
        return own

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        state = dict(state_dict)
        for name, module in self.loras.items():
            if isinstance(module, SplitLoRAModule) and f"{name}.lora_down.weight" in state:
                mine = {k.removeprefix(f"{name}."): state.pop(k) for k in list(state) if k.startswith(f"{name}.")}
                state |= {f"{name}.{k}": v for k, v in module.from_file(mine).items()}
        return super().load_state_dict(state, strict, assign)


def create_flux_network(transformer: nn.Module | None, clip: nn.Module | None,
                        options: FluxNetworkOptions, t5: nn.Module | None = None) -> FluxLoRANetwork:
    """sd-scripts' network over a diffusers FLUX ``transformer``, the CLIP-L ``clip`` and T5-XXL ``t5`` (``None``:
    not trained), attached (its hooks are active); the modules take the device of the layers they adapt."""
    dropouts = {"dropout": options.dropout, "rank_dropout": options.rank_dropout,
                "module_dropout": options.module_dropout}
    modules: dict[str, nn.Module] = {}
    if transformer is not None:
        for name, parts, dim in _transformer_targets(transformer, options):
            layers = [transformer.get_submodule(p) for p in parts]
            if len(layers) == 1:
                modules[name] = LoRAModule(layers[0], dim, options.alpha, **dropouts)
            elif options.split_qkv:
                modules[name] = SplitLoRAModule(layers, dim, options.alpha, **dropouts)
            else:
                modules[name] = FusedLoRAModule(layers, dim, options.alpha, **dropouts)
    if clip is not None:
        keys = flux_keys(clip_layers=clip.config.num_hidden_layers)
        for path, layer in clip.named_modules():
            found = keys.by_diffusers.get(f"text_encoder.{text_model_path(path)}")
            if found is not None:
                modules[found.kohya] = LoRAModule(layer, options.dim, options.alpha, **dropouts)
    if t5 is not None:  # train_t5xxl: sd-scripts' lora_te3_encoder_block_{i}_layer_0_SelfAttention_q …
        keys = flux_keys(t5_layers=t5.config.num_layers)
        for path, layer in t5.named_modules():
            found = keys.by_diffusers.get(f"text_encoder_2.{path}")
            if found is not None:
                modules[found.kohya] = LoRAModule(layer, options.dim, options.alpha, **dropouts)
    network = FluxLoRANetwork(modules)
    for module in network.modules():
        if isinstance(module, LoRAModule):
            module.to(device=module._org[0].weight.device)
    network.attach()
    return network


@dataclasses.dataclass(frozen=True)
class FluxNetworkPlan:
    """The network a flux-kohya run builds, for the memory plan (``Estimator(lora_network=...)``): built by
    :func:`create_flux_network` on the meta-built components, so the plan counts what the run trains."""

    options: FluxNetworkOptions
    transformer: bool = True
    clip: bool = True
    t5: bool = False

    def __call__(self, components: Mapping[str, nn.Module]) -> FluxLoRANetwork:
        return create_flux_network(components["transformer"] if self.transformer else None,
                                   components["text_encoder"] if self.clip else None, self.options,
                                   components["text_encoder_2"] if self.t5 else None)


def _transformer_targets(transformer: nn.Module, options: FluxNetworkOptions
                         ) -> list[tuple[str, tuple[str, ...], int]]:
    """(sd-scripts name, diffusers module paths, rank) of every transformer module the options adapt."""
    config = transformer.config
    counts = {"double_blocks": config.num_layers, "single_blocks": config.num_single_layers}
    chosen = {"double_blocks": options.double_blocks, "single_blocks": options.single_blocks}
    kinds = {"all": ("double_blocks", "single_blocks"), "double": ("double_blocks",),
             "single": ("single_blocks",)}[options.train_blocks]
    targets = []
    for kind in kinds:
        ours, table = _BLOCKS[kind]
        selected = block_selection(chosen[kind] or "all", counts[kind], f"train_{kind[:6]}_block_indices")
        for i in range(counts[kind]):
            for bfl, parts in table.items():
                name = f"lora_unet_{kind}_{i}_{bfl.replace('.', '_')}"
                dim = options.rank_of(name) if selected[i] else 0
                if dim:
                    targets.append((name, tuple(f"{ours}.{i}.{p}" for p in parts), dim))
    if options.in_dims:
        inputs = {**FLUX_GLOBAL, **(FLUX_GUIDANCE if config.guidance_embeds else {})}
        for fragment, dim in zip(IN_DIM_NAMES, options.in_dims):
            for bfl, ours in inputs.items():
                name = f"lora_unet_{bfl.replace('.', '_')}"
                if dim and fragment in name:
                    targets.append((name, (ours,), dim))
    return targets
