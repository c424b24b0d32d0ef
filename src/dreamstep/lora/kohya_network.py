"""The Kohya LoRA network (sd-scripts ``networks.lora``) for SDXL: modules, key names and files as
sd-scripts writes them, so its files load in sd-scripts, ComfyUI, A1111 and diffusers.

Targets (sd-scripts' rule, on the diffusers modules):

- UNet: every ``nn.Linear`` and 1x1 ``nn.Conv2d`` inside a ``Transformer2DModel`` (attn1/attn2 to_q/k/v/out.0,
  ff.net.0.proj, ff.net.2, proj_in, proj_out), at ``dim``/``alpha``. With ``conv_dim`` (LoCon) also the
  ``ResnetBlock2D``, ``Downsample2D`` and ``Upsample2D`` modules: their 3x3 convolutions at
  ``conv_dim``/``conv_alpha``, their Linear (time embedding) and 1x1 shortcut at ``dim``/``alpha``.
- Text encoders: the CLIP attention and MLP linears (q/k/v/out_proj, fc1, fc2).

Names come from the key tables of :mod:`dreamstep.lora.formats`, which compute the UNet's SGM paths from the
UNet config, so ``down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`` is saved as
``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight`` / ``.lora_up.weight`` /
``.alpha`` for tiny and full-size UNets alike.

Each module adds ``up(dropout(down(x))) · multiplier · alpha/dim`` to its layer's output through a forward
hook, so the base model keeps its own modules and state dict, and the same hooked UNet runs in diffusers'
pipelines for samples.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from dreamstep.config.schema import parse_key_values
from dreamstep.errors import UserError, did_you_mean
from dreamstep.lora.io import container_for, read_lora_file, write_lora_file
from dreamstep.models.lora_keys import ModelKeys
from dreamstep.models.sdxl.lora_keys import sdxl_keys

UNET_TARGETS = ("Transformer2DModel",)
UNET_CONV_TARGETS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
# --network_args keys of sd-scripts' networks.lora that dreamstep implements, and their types.
NETWORK_ARGS = {"conv_dim": int, "conv_alpha": float, "dropout": float, "rank_dropout": float,
                "module_dropout": float}
# sd-scripts network_args that this network does not implement: named as such, never taken for typos.
UNSUPPORTED_NETWORK_ARGS = frozenset({"block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas",
                                      "down_lr_weight", "mid_lr_weight", "up_lr_weight", "block_lr_zero_threshold",
                                      "loraplus_lr_ratio", "loraplus_unet_lr_ratio",
                                      "loraplus_text_encoder_lr_ratio", "train_blocks"})


@dataclass(frozen=True)
class NetworkOptions:
    """Shape and regularisation of the network (sd-scripts' --network_dim, --network_alpha,
    --network_dropout and --network_args)."""

    dim: int = 4
    alpha: float = 1.0
    conv_dim: int | None = None
    conv_alpha: float | None = None
    dropout: float | None = None  # on the down projection's output
    rank_dropout: float | None = None  # zero whole rank channels, rescale by 1 / (1 - p)
    module_dropout: float | None = None  # skip the whole module for a sample batch

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise UserError(f"--network_dim must be at least 1 (got {self.dim})")
        if self.conv_dim is not None and self.conv_dim < 1:
            raise UserError(f"--network_args conv_dim must be at least 1 (got {self.conv_dim})")
        for name in ("dropout", "rank_dropout", "module_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                flag = "--network_dropout" if name == "dropout" else f"--network_args {name}"
                raise UserError(f"{flag} must be in [0, 1) (got {value})")

    @classmethod
    def from_flags(cls, dim: int, alpha: float, dropout: float | None, network_args: Iterable[str]
                   ) -> tuple[NetworkOptions, dict[str, Any]]:
        """sd-scripts' --network_dim/alpha/dropout and --network_args as checked options, and the parsed args."""
        args = parse_network_args(network_args)
        options = cls(dim=dim, alpha=alpha, dropout=dropout or args.get("dropout"), conv_dim=args.get("conv_dim"),
                      conv_alpha=args.get("conv_alpha"), rank_dropout=args.get("rank_dropout"),
                      module_dropout=args.get("module_dropout"))
        return options, args


def parse_network_args(items: Iterable[str]) -> dict[str, Any]:
    """sd-scripts' ``--network_args conv_dim=4 conv_alpha=1 rank_dropout=0.1`` as typed values."""
    parsed: dict[str, Any] = {}
    for key, text in parse_key_values(items, "--network_args", "conv_dim=4 conv_alpha=1").items():
        if key in UNSUPPORTED_NETWORK_ARGS:
            raise UserError(f"--network_args: '{key}' is an sd-scripts option dreamstep does not support; remove it")
        if key not in NETWORK_ARGS:
            raise UserError(f"--network_args: unknown key '{key}'{did_you_mean(key, NETWORK_ARGS)}; "
                            f"valid keys: {', '.join(NETWORK_ARGS)}")
        try:
            parsed[key] = NETWORK_ARGS[key](text)
        except ValueError:
            raise UserError(f"--network_args: {key}={text} is not a number") from None
    return parsed


class LoRAModule(nn.Module):
    """One low-rank adapter for a Linear or Conv2d layer ``org``: ``down`` (dim, in[, kh, kw]) is
    Kaiming-uniform initialised, ``up`` (out, dim[, 1, 1]) zero-initialised, so training starts from the
    base model. ``alpha`` is a buffer, saved as ``<name>.alpha``."""

    def __init__(self, org: nn.Module, dim: int, alpha: float, dropout: float | None = None,
                 rank_dropout: float | None = None, module_dropout: float | None = None,
                 out_features: int | None = None):
        super().__init__()
        if isinstance(org, nn.Conv2d):
            self.lora_down = nn.Conv2d(org.in_channels, dim, org.kernel_size, org.stride, org.padding, bias=False)
            self.lora_up = nn.Conv2d(dim, org.out_channels, (1, 1), (1, 1), bias=False)
        else:  # out_features: a fused module's rows (several Linears of one input; see kohya_flux_network)
            self.lora_down = nn.Linear(org.in_features, dim, bias=False)
            self.lora_up = nn.Linear(dim, out_features or org.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_up.weight)
        self.dim = dim
        alpha = dim if not alpha else alpha  # sd-scripts: alpha 0 or None means alpha = dim (scale 1)
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.scale = float(alpha) / dim
        self.dropout, self.rank_dropout, self.module_dropout = dropout, rank_dropout, module_dropout
        self.multiplier = 1.0
        self._org = (org,)  # a tuple keeps the base layer out of this module's parameters and state dict
        self._handle: Any = None

    def refresh_scale(self) -> None:
        """Recompute alpha / dim after ``alpha`` was loaded (one host read, not one per forward)."""
        self.scale = float(self.alpha) / self.dim

    def attach(self) -> None:
        """Add this module's output to its layer's output, from now on."""
        if self._handle is None:
            self._handle = self._org[0].register_forward_hook(self._hook)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return output + self(args[0]).to(output.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution (not including the base layer's output)."""
        if self.training and self.module_dropout and torch.rand(()) < self.module_dropout:
            return torch.zeros((), device=x.device, dtype=x.dtype)
        hidden, scale = self.hidden(x)
        return self.lora_up(hidden) * (self.multiplier * scale)

    def hidden(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The down projection of ``x`` with dropout and rank dropout applied, and the scale of its up
        projection (alpha / dim, raised by rank dropout)."""
        hidden = self.lora_down(x.to(self.lora_down.weight.dtype))  # (..., dim) or (B, dim, h, w)
        scale = self.scale
        if self.training and self.dropout:
            hidden = nn.functional.dropout(hidden, p=self.dropout)
        if self.training and self.rank_dropout:
            keep = torch.rand(hidden.shape[0], self.dim, device=hidden.device) > self.rank_dropout
            if isinstance(self.lora_down, nn.Conv2d):
                keep = keep[:, :, None, None]
            elif hidden.ndim == 3:
                keep = keep[:, None, :]
            hidden = hidden * keep.to(hidden.dtype)
            scale = scale / (1.0 - self.rank_dropout)  # as if the rank were smaller
        return hidden, scale


class LoRANetwork(nn.Module):
    """Kohya-named LoRA modules over an SDXL UNet and/or its text encoders; its ``state_dict`` is the file."""

    def __init__(self, modules: Mapping[str, LoRAModule]):
        super().__init__()
        if not modules:
            raise UserError("the LoRA network has no modules: nothing would train")
        self.loras = nn.ModuleDict(modules)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """Keys as sd-scripts writes them: ``lora_unet_….lora_down.weight`` (no container prefix)."""
        return {key.removeprefix("loras."): value for key, value in super().state_dict(*args, **kwargs).items()}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        result = super().load_state_dict({f"loras.{k}": v for k, v in state_dict.items()}, strict, assign)
        for module in self.loras.values():
            module.refresh_scale()
        return result

    def attach(self) -> None:
        for module in self.loras.values():
            module.attach()

    def detach(self) -> None:
        for module in self.loras.values():
            module.detach()

    def names(self, prefix: str) -> list[str]:
        return [name for name in self.loras if name.startswith(prefix)]

    def param_groups(self, unet_lr: float, text_encoder_lr: float,
                     loraplus: tuple[float | None, float | None] = (None, None)) -> list[dict[str, Any]]:
        """One optimizer group for the UNet (FLUX: transformer) modules and one for the text encoders' (as
        sd-scripts); with a LoRA+ ratio for a part (``loraplus``: UNet's, text encoders'), its up weights get a
        group of their own at the learning rate times the ratio (Hayou et al. 2024, arXiv 2402.12354)."""
        groups = []
        for prefix, lr, ratio in (("lora_unet", unet_lr, loraplus[0]), ("lora_te", text_encoder_lr, loraplus[1])):
            named = [(n, p) for name in self.names(prefix) for n, p in self.loras[name].named_parameters()]
            up = [p for n, p in named if ratio and "lora_up" in n]
            rest = [p for n, p in named if not (ratio and "lora_up" in n)]
            groups += [{"params": params, "lr": rate} for params, rate in ((rest, lr), (up, lr * (ratio or 1)))
                       if params]
        return groups

    def load_weights(self, path: str | Path) -> None:
        """Continue from a saved network file (--network_weights): every tensor must fit this network."""
        tensors = self.check_weights(path)
        own = self.state_dict()
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()}, strict=False)

    def check_weights(self, path: str | Path) -> dict[str, torch.Tensor]:
        """The tensors of a saved network file, each checked to be one of this network's, in its shape (the
        network may be on the meta device: a check before anything loads)."""
        file = read_lora_file(path)
        own = self.state_dict()
        unknown = [k for k in file.tensors if k not in own]
        if unknown:
            raise UserError(f"--network_weights {path}: {len(unknown)} tensors do not belong to this network "
                            f"(first: '{unknown[0]}'); match --network_dim, --network_args and "
                            "--network_train_unet_only / --network_train_text_encoder_only to the file")
        for key, value in file.tensors.items():
            if value.shape != own[key].shape:
                raise UserError(f"--network_weights {path}: '{key}' has shape {tuple(value.shape)}, the network "
                                f"needs {tuple(own[key].shape)}; use the file's --network_dim / conv_dim")
        return file.tensors

    def save_weights(self, path: str | Path, dtype: torch.dtype | None, metadata: Mapping[str, str]) -> Path:
        """Write ``path`` (.safetensors with ``metadata`` and its hashes, or a torch .ckpt/.pt) atomically."""
        path = Path(path)
        tensors = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in self.state_dict().items()}
        container = container_for(path)
        metadata = dict(metadata)
        if container == "safetensors":
            metadata.update(weight_hashes(tensors, metadata))
        write_lora_file(path, tensors, metadata, container)
        return path


def text_model_path(path: str) -> str:
    """The module path as sd-scripts sees CLIP (``text_model.encoder…``); transformers 5 dropped the prefix."""
    return path if path.startswith("text_model.") else f"text_model.{path}"


def _unet_targets(unet: nn.Module, options: NetworkOptions) -> Iterable[tuple[str, nn.Module, int, float]]:
    """(diffusers path, layer, dim, alpha) of every UNet layer sd-scripts adapts."""
    classes = UNET_TARGETS + (UNET_CONV_TARGETS if options.conv_dim else ())
    for name, block in unet.named_modules():
        if type(block).__name__ not in classes:
            continue
        for child_name, layer in block.named_modules():
            if isinstance(layer, nn.Linear) or (isinstance(layer, nn.Conv2d) and layer.kernel_size == (1, 1)):
                yield f"{name}.{child_name}", layer, options.dim, options.alpha
            elif isinstance(layer, nn.Conv2d) and options.conv_dim:
                conv_alpha = options.conv_alpha if options.conv_alpha is not None else 1.0
                yield f"{name}.{child_name}", layer, options.conv_dim, conv_alpha


def _table_name(keys: ModelKeys, component: str, path: str) -> str:
    """sd-scripts' name of ``component.path`` from the model's key table."""
    entry = keys.by_diffusers.get(f"{component}.{path}")
    if entry is None:
        raise ValueError(f"no Kohya name for {component}.{path}; the key table does not cover this model")
    return entry.kohya


def create_network(unet: nn.Module, text_encoders: Mapping[str, nn.Module], options: NetworkOptions, *,
                   train_unet: bool = True, train_text_encoder: bool = True) -> LoRANetwork:
    """The network over ``unet`` and ``text_encoders`` ({"text_encoder": CLIP-L, "text_encoder_2": CLIP-G}),
    attached (its hooks are active). The modules take the dtype and device of the layers they adapt."""
    keys = sdxl_keys(dict(unet.config), text_encoders["text_encoder"].config.num_hidden_layers,
                     text_encoders["text_encoder_2"].config.num_hidden_layers)
    common = {"dropout": options.dropout, "rank_dropout": options.rank_dropout,
              "module_dropout": options.module_dropout}
    modules: dict[str, LoRAModule] = {}
    if train_unet:
        for path, layer, dim, alpha in _unet_targets(unet, options):
            modules[_table_name(keys, "unet", path)] = LoRAModule(layer, dim, alpha, **common)
    if train_text_encoder:
        for component, encoder in text_encoders.items():
            for path, layer in encoder.named_modules():
                name = keys.by_diffusers.get(f"{component}.{text_model_path(path)}")
                if name is not None:
                    modules[name.kohya] = LoRAModule(layer, options.dim, options.alpha, **common)
    network = LoRANetwork(modules)
    for module in network.loras.values():
        module.to(device=module._org[0].weight.device)
    network.attach()
    return network


# ------------------------------------------------------------------------------------ sd-scripts metadata

def weight_hashes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> dict[str, str]:
    """sd-scripts' ``sshs_model_hash`` (sha256 of the tensor bytes of the file written with only the ``ss_*``
    metadata, the training facts that never change) and ``sshs_legacy_hash`` (its 8-hex legacy form)."""
    training = {k: v for k, v in metadata.items() if k.startswith("ss_")}
    data = safetensors.torch.save(dict(tensors), training)
    header_size = int.from_bytes(data[:8], "little")
    model_hash = hashlib.sha256(data[8 + header_size:]).hexdigest()
    legacy_hash = hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]
    return {"sshs_model_hash": model_hash, "sshs_legacy_hash": legacy_hash}
