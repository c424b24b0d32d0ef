"""LoKr, LoHa, LoCon/LoRA and DoRA adapters through LyCORIS (``lycoris-lora``), named as ComfyUI, Forge and
sd-scripts with LyCORIS read them.

Why LyCORIS and not peft (``benchmarks/adapters.py``, one FLUX.1-dev 3072x3072 attention layer, 256 tokens, CPU,
2026-11-25): both have the same parameters per layer (LoKr factor 16: 37,120; LoHa rank 16: 196,608; DoRA rank 16:
101,376), and peft's training step is faster on the CPU (LoKr 1.1 vs 1.6 s, LoHa 1.0 vs 2.3 s, DoRA 0.7 vs 1.1 s:
LyCORIS rebuilds the whole weight every forward). The files decide: LyCORIS' modules save exactly the tensors
ComfyUI's ``weight_adapter`` and sd-scripts' ``lycoris.kohya`` read (``lokr_w1``, ``lokr_w2_a``, ``hada_w1_a``,
``lora_down.weight``, a scalar ``alpha`` per module, ``dora_scale``), its arguments are the ones sd-scripts users
pass (``algo=lokr factor=16 ...``), and it reads its files back (:func:`lycoris.modules.get_module`). peft's LoKr
and LoHa save no alpha (so a reader cannot tell their scale), and peft's DoRA saves ``lora_magnitude_vector``,
which neither ComfyUI nor sd-scripts reads. LyCORIS' network wrappers are not
used: their presets match class names of sd-scripts' own UNet and, on diffusers' SDXL UNet, name
``time_embedding.linear_1`` twice and stop; so the layers are chosen here (by sd-scripts' and LyCORIS' rules,
see :func:`sdxl_targets`) and each gets a LyCORIS module class.

Names: an SDXL module is named as sd-scripts names it (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``,
``lora_te1_text_model_encoder_layers_0_self_attn_q_proj``), from the key tables of :mod:`dreamstep.lora.formats`;
a FLUX transformer module as LyCORIS names a diffusers model (``lycoris_transformer_blocks_0_attn_to_q``, what
SimpleTuner writes and ComfyUI maps onto BFL's fused weights), CLIP as sd-scripts (``lora_te1_…``).

DoRA: dreamstep trains LyCORIS' DoRA with one magnitude per *input column* (``wd_on_out=False``, ``dora_scale`` of
shape (1, in[, 1, 1])): W' = (W + dW) · m / ‖W + dW‖ per column. That is the form every reader applies exactly: A1111
and ComfyUI before its per-row branch always use column norms of the adapted weight, and today's ComfyUI and Forge
keep that branch for a (1, in) ``dora_scale``. LyCORIS' default, one magnitude per output row (``wd_on_output=True``,
as peft), is still there for files meant for diffusers/peft; ComfyUI and Forge then divide by the norm of the
*base* row instead of the adapted one (their weight is the trained one times ‖W + dW‖ / ‖W‖ per row) and A1111's
column formula does not fit it at all. LyCORIS' ``make_module`` cannot rebuild a per-column DoRA, so
:func:`modules_from_tensors` gives the magnitude back to the module it builds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dreamstep.config.lycoris import LycorisOptions
from dreamstep.errors import UserError
from dreamstep.lora.io import container_for, read_lora_file, write_lora_file
from dreamstep.models.lora_keys import ModelKeys

# LyCORIS' algo names that dreamstep trains, and the LyCORIS module class of each (imported when used: importing
# lycoris takes seconds, as it imports peft and bitsandbytes, and most commands never need it).
MODULE_CLASSES = {"lora": "LoConModule", "locon": "LoConModule", "loha": "LohaModule", "lokr": "LokrModule"}
ALGORITHM_NAMES = {"LoConModule": "LoRA", "LohaModule": "LoHa", "LokrModule": "LoKr"}  # LyCORIS class -> name
# LoHa and LoKr classes whose merge applies alpha / rank twice (see apply_lycoris).
_DOUBLE_SCALED_MERGE = ("LohaModule", "LokrModule")
FLUX_PREFIX = "lycoris_"
# Tensor names only LyCORIS files have (a plain LoRA file has lora_down/lora_up/alpha or lora_A/lora_B).
LYCORIS_SUFFIXES = (".lokr_w1", ".lokr_w1_a", ".lokr_w1_b", ".lokr_w2", ".lokr_w2_a", ".lokr_w2_b", ".lokr_t1",
                    ".lokr_t2", ".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b", ".hada_t1", ".hada_t2",
                    ".dora_scale", ".lora_mid.weight")


def is_lycoris(keys: Iterable[str]) -> bool:
    """Whether a file's tensor names are LyCORIS' (LoKr, LoHa, DoRA, Tucker, or LyCORIS' module prefix)."""
    return any(k.startswith(FLUX_PREFIX) or k.endswith(LYCORIS_SUFFIXES) for k in keys)


# ------------------------------------------------------------------------------------------- names


def _text_model_path(path: str) -> str:
    """A CLIP module path with ``text_model.``, as sd-scripts sees CLIP (transformers 5 dropped the level)."""
    return path if path.startswith("text_model.") else f"text_model.{path}"


def _adaptable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear | nn.Conv2d)


def file_names(keys: ModelKeys, components: Mapping[str, nn.Module]) -> dict[str, tuple[str, nn.Module]]:
    """Every Linear and Conv2d of ``components`` ({"unet"|"transformer"|"text_encoder"|"text_encoder_2": model})
    by its name in the file: {file name: (diffusers name, layer)}."""
    out = {}
    for component, model in components.items():
        for path, layer in model.named_modules():
            if not _adaptable(layer):
                continue
            if component == "transformer":
                out[FLUX_PREFIX + path.replace(".", "_")] = (f"transformer.{path}", layer)
                continue
            diffusers = f"{component}.{_text_model_path(path) if component.startswith('text_') else path}"
            entry = keys.by_diffusers.get(diffusers)
            if entry is not None and len(entry.diffusers) == 1:
                out[entry.kohya] = (diffusers, layer)
    return out


# ------------------------------------------------------------------------------------- SDXL targets

# LyCORIS' presets as they act in sd-scripts: UNet block classes whose layers are adapted, whether 3x3
# convolutions are (LoCon), and the CLIP classes. sd-scripts' SDXL UNet names its attention CrossAttention,
# diffusers' Attention; LyCORIS' target names (conv_in, time_embedding.linear_1) do not exist in sd-scripts' UNet.
_FULL_UNET = ("Transformer2DModel", "ResnetBlock2D", "Downsample2D", "Upsample2D")
_CLIP = ("CLIPAttention", "CLIPSdpaAttention", "CLIPMLP")
SDXL_PRESETS: dict[str, tuple[tuple[str, ...], bool, tuple[str, ...]]] = {
    "full": (_FULL_UNET, True, _CLIP),
    "full-lin": (("Transformer2DModel", "ResnetBlock2D"), False, _CLIP),
    "attn-mlp": (("Transformer2DModel",), False, _CLIP),
    "attn-only": (("Attention",), False, ("CLIPAttention", "CLIPSdpaAttention")),
    "unet-only": (_FULL_UNET, True, ()),
    "unet-transformer-only": (("Transformer2DModel",), False, ()),
    "unet-convblock-only": (("ResnetBlock2D", "Downsample2D", "Upsample2D"), True, ()),
}


def _layers_in(model: nn.Module, classes: tuple[str, ...]) -> dict[str, nn.Module]:
    """Every Linear and Conv2d inside a block of one of ``classes``, by its path in ``model``."""
    out: dict[str, nn.Module] = {}
    for name, block in model.named_modules():
        if type(block).__name__ in classes:
            out |= {f"{name}.{child}": layer for child, layer in block.named_modules() if _adaptable(layer)}
    return out


def sdxl_targets(unet: nn.Module | None, text_encoders: Mapping[str, nn.Module], preset: str,
                 conv: bool) -> dict[str, nn.Module]:
    """{diffusers name: layer} that sd-scripts with LyCORIS adapts for ``preset``; 3x3 convolutions only when
    the preset enables them and ``conv`` (conv_dim > 0)."""
    unet_classes, preset_conv, clip_classes = SDXL_PRESETS[preset]
    out = {}
    if unet is not None:
        for path, layer in _layers_in(unet, unet_classes).items():
            if isinstance(layer, nn.Conv2d) and layer.kernel_size != (1, 1) and not (preset_conv and conv):
                continue
            out[f"unet.{path}"] = layer
    for component, encoder in text_encoders.items():
        out |= {f"{component}.{_text_model_path(path)}": layer
                for path, layer in _layers_in(encoder, clip_classes).items()}
    return out


# ---------------------------------------------------------------------------------------- network


class LycorisNetwork(nn.Module):
    """LyCORIS modules over named layers; its ``state_dict`` is the file (``<name>.lokr_w1``, ``<name>.alpha``)."""

    def __init__(self, modules: Mapping[str, nn.Module], options: LycorisOptions):
        super().__init__()
        if not modules:
            raise UserError("the adapter network has no modules: nothing would train")
        self.loras = nn.ModuleDict(modules)
        self.options = options

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        return {key.removeprefix("loras."): value for key, value in super().state_dict(*args, **kwargs).items()}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        return super().load_state_dict({f"loras.{k}": v for k, v in state_dict.items()}, strict, assign)

    def attach(self) -> None:
        """Route each adapted layer's forward through its module (LyCORIS' ``apply_to``)."""
        for module in self.loras.values():
            if getattr(module.org_module[0], "_lycoris_wrappers", None) != [module]:
                module.apply_to()

    def detach(self) -> None:
        for module in self.loras.values():
            module.restore()

    def names(self, prefix: str) -> list[str]:
        return [name for name in self.loras if name.startswith(prefix)]

    def param_groups(self, main_lr: float, text_encoder_lr: float) -> list[dict[str, Any]]:
        """One optimizer group for the UNet/transformer modules, one for the text encoders' (as sd-scripts)."""
        groups = []
        text = [name for name in self.loras if name.startswith("lora_te")]
        main = [name for name in self.loras if name not in text]
        for names, lr in ((main, main_lr), (text, text_encoder_lr)):
            params = [p for name in names for p in self.loras[name].parameters() if p.requires_grad]
            if params:
                groups.append({"params": params, "lr": lr})
        return groups

    def load_weights(self, path: str | Path, flag: str = "--network_weights") -> None:
        """Continue from a saved file: every tensor must belong to this network, with its shape and alpha."""
        tensors = self.check_weights(path, flag)
        own = self.state_dict()
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()}, strict=False)

    def check_weights(self, path: str | Path, flag: str = "--network_weights") -> dict[str, torch.Tensor]:
        """The tensors of a saved file, each checked to be one of this network's, in its shape, with its alpha
        (not on the meta device, which holds no values: a check of names and shapes before anything loads)."""
        file = read_lora_file(path)
        own = self.state_dict()
        for key, value in file.tensors.items():
            if key not in own:
                raise UserError(f"{flag} {path}: tensor '{key}' does not belong to this network; train with the "
                                "file's algorithm, rank, factor and layers")
            if value.shape != own[key].shape:
                raise UserError(f"{flag} {path}: '{key}' has shape {tuple(value.shape)}, the network needs "
                                f"{tuple(own[key].shape)}; use the file's rank, factor and options")
            if key.endswith(".alpha") and not own[key].is_meta and float(value) != float(own[key]):
                raise UserError(f"{flag} {path}: '{key}' is {float(value):g}, the network's alpha is "
                                f"{float(own[key]):g}; use the file's alpha")
        return file.tensors

    def save_weights(self, path: str | Path, dtype: torch.dtype | None, metadata: Mapping[str, str]) -> Path:
        """Write ``path`` (.safetensors with ``metadata``, or a torch .ckpt/.pt) atomically."""
        path = Path(path)
        tensors = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in self.state_dict().items()}
        write_lora_file(path, tensors, dict(metadata), container_for(path))
        return path


def is_quantized(layer: nn.Module) -> bool:
    """Whether a layer's weight is quantized (a torchao tensor subclass, or a bitsandbytes 4-bit parameter)."""
    return type(layer.weight) not in (torch.Tensor, nn.Parameter) or hasattr(layer.weight, "quant_state")


def _module_for(name: str, layer: nn.Module, options: LycorisOptions) -> nn.Module:
    conv = isinstance(layer, nn.Conv2d) and layer.kernel_size != (1, 1)
    dim, alpha = (options.conv_rank, options.conv_alpha or options.alpha) if conv else (options.dim, options.alpha)
    import lycoris.modules

    module_class = getattr(lycoris.modules, MODULE_CLASSES[options.algo])
    # On a quantized weight LyCORIS' default forward (W + dW rebuilt, then the layer's op) cannot add to the
    # weight (torchao's Int8Tensor/Float8Tensor have no aten.add); its bypass forward, layer(x) + dW x, computes
    # the same output without touching the weight. DoRA needs the weight's norms: refused by the configs.
    bypass = True if is_quantized(layer) else None
    module = module_class(name, layer, 1.0, dim, alpha, bypass_mode=bypass, **options.module_kwargs())
    return module.to(device=layer.weight.device)


def create_network(names: Mapping[str, tuple[str, nn.Module]], targets: Mapping[str, nn.Module],
                   options: LycorisOptions) -> LycorisNetwork:
    """A LyCORIS module for every layer of ``targets`` ({diffusers name: layer}), named as in ``names``
    (:func:`file_names`), attached. Modules are fp32 on their layer's device."""
    by_layer = {id(layer): name for name, (_, layer) in names.items()}
    modules = {}
    for diffusers, layer in targets.items():
        name = by_layer.get(id(layer))
        if name is None:
            raise ValueError(f"no file name for {diffusers}; the key table does not cover this model")
        modules[name] = _module_for(name, layer, options)
    network = LycorisNetwork(modules, options)
    network.attach()
    return network


def create_sdxl_network(unet: nn.Module, text_encoders: Mapping[str, nn.Module], options: LycorisOptions, *,
                        train_unet: bool = True, train_text_encoder: bool = True) -> LycorisNetwork:
    """sd-scripts' ``lycoris.kohya`` network over an SDXL UNet and its CLIP encoders ({"text_encoder": CLIP-L,
    "text_encoder_2": CLIP-G}), with sd-scripts' names, attached."""
    from dreamstep.models.sdxl.lora_keys import sdxl_keys

    keys = sdxl_keys(dict(unet.config), text_encoders["text_encoder"].config.num_hidden_layers,
                     text_encoders["text_encoder_2"].config.num_hidden_layers)
    names = file_names(keys, {"unet": unet, **text_encoders})
    targets = sdxl_targets(unet if train_unet else None, text_encoders if train_text_encoder else {},
                           options.preset, conv=options.conv_rank > 0)
    return create_network(names, targets, options)


def create_flux_network(transformer: nn.Module, targets: Iterable[str], text_encoder: nn.Module | None,
                        text_encoder_targets: Iterable[str], options: LycorisOptions) -> LycorisNetwork:
    """A network over the FLUX transformer's ``targets`` (module paths) and, when given, the CLIP text encoder's
    modules whose paths end with one of ``text_encoder_targets``, attached."""
    from dreamstep.models.flux.lora_keys import flux_keys

    components = {"transformer": transformer} | ({"text_encoder": text_encoder} if text_encoder is not None else {})
    clip_layers = text_encoder.config.num_hidden_layers if text_encoder is not None else 12
    names = file_names(flux_keys(dict(transformer.config), clip_layers), components)
    chosen = {f"transformer.{path}": transformer.get_submodule(path) for path in targets}
    if text_encoder is not None:
        suffixes = tuple(text_encoder_targets)
        chosen |= {f"text_encoder.{path}": layer for path, layer in text_encoder.named_modules()
                   if _adaptable(layer) and path.endswith(suffixes)}
    return create_network(names, chosen, options)


# ------------------------------------------------------------------------------------ applying files


def modules_from_tensors(tensors: Mapping[str, torch.Tensor], names: Mapping[str, tuple[str, nn.Module]],
                         source: str) -> dict[str, nn.Module]:
    """LyCORIS' own modules rebuilt from a file's tensors onto the layers ``names`` gives, by LyCORIS'
    ``get_module``/``make_module``; a module name that no layer has is a UserError naming it."""
    from lycoris.modules import get_module, make_module

    module_names = sorted({key.split(".", 1)[0] for key in tensors})
    modules = {}
    for name in module_names:
        if name not in names:
            raise UserError(f"{source}: module '{name}' does not exist in this model; the adapter was made for "
                            "another model or model size")
        layer = names[name][1]
        # LyCORIS' make_module builds a per-output-row DoRA, so a per-input-column one (dreamstep's default) is
        # built without its magnitude, which is then given back in the column form LyCORIS' modules also compute.
        magnitude = tensors.get(f"{name}.dora_scale")
        by_column = magnitude is not None and magnitude.shape[0] != layer.weight.shape[0]
        kind, params = get_module({k: v for k, v in tensors.items() if not (by_column and k.endswith(".dora_scale"))},
                                  name)
        module = make_module(kind, params, name, layer) if kind is not None else None
        if module is None:
            raise UserError(f"{source}: module '{name}' is of no algorithm LyCORIS rebuilds (LoRA, LoHa, LoKr)")
        if by_column:
            module.wd, module.wd_on_out = True, False
            module.dora_norm_dims = layer.weight.dim() - 1  # set by LyCORIS only for the DoRA it builds (3.2 reads it)
            module.dora_scale = nn.Parameter(magnitude.float().reshape(1, -1, *[1] * (layer.weight.dim() - 2)))
        modules[name] = module.to(layer.weight.device)
    return modules


@torch.no_grad()
def apply_lycoris(tensors: Mapping[str, torch.Tensor], names: Mapping[str, tuple[str, nn.Module]], weight: float,
                  merge: bool, source: str) -> list[nn.Module]:
    """Apply a LyCORIS file to the model layers ``names`` gives, at ``weight``: merged into the weights (LyCORIS'
    ``merge_to``) or as modules on the forward (``apply_to``). Returns the modules.

    lycoris-lora's LoHa and LoKr (3.2 to 4.1.3) apply alpha / rank twice when merging (``get_weight`` already holds it,
    ``get_diff_weight`` multiplies again) but once on the forward, which is what trained and what ComfyUI
    computes; so their merge is asked for ``weight / scale``. With DoRA that cannot be corrected so, and such a
    module stays on the forward."""
    modules = list(modules_from_tensors(tensors, names, source).values())
    for module in modules:
        module.eval()
        double_scaled = type(module).__name__ in _DOUBLE_SCALED_MERGE
        if merge and not (double_scaled and module.wd):
            module.merge_to(weight / module.scale if double_scaled else weight)
        else:
            module.multiplier = weight
            module.apply_to()
    return modules
