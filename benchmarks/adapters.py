"""LoKr, LoHa, DoRA and LoCon against LoRA rank 16, at FLUX.1-dev and SDXL base shapes: trainable parameters, file
size, AdamW state bytes and CPU seconds per step; and the same algorithms in LyCORIS and in peft (why dreamstep
trains them through LyCORIS: see ``dreamstep.lora.lycoris_network``).

Shapes come from the released models built on the meta device with each trainer's default layers (flux-lora:
the attention preset; sdxl-lora: sd-scripts' network, UNet attention blocks and both CLIP encoders, LoCon adding
the 3x3 convolutions). The s/step column is the adapted layers' share of a step on the CPU: for each distinct
layer shape, one full-width layer with its adapter runs forward and backward on a batch of tokens (FLUX: 256 of
a 512² image's 1024; SDXL: 256 of a 1024²'s latent pixels at that layer) and AdamW steps the adapter; the time
is multiplied by the number of layers of that shape. The base model's other work is the same for every type.

    python benchmarks/adapters.py                 # both models, every type, and the library comparison
    python benchmarks/adapters.py --model flux --tokens 64 --steps 3
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable

import torch
from torch import nn

from dreamstep.config.lycoris import LycorisOptions
from dreamstep.lora.formats import model_keys
from dreamstep.lora.lycoris_network import create_network, file_names, sdxl_targets
from dreamstep.models.family import get_family
from dreamstep.models.flux.lora_targets import flux_lora_targets

TYPES = {
    "LoRA r16": LycorisOptions("lora", dim=16, alpha=16.0),
    "LoKr f16": LycorisOptions("lokr", dim=10000, alpha=1.0, factor=16),  # full-matrix LoKr, the usual FLUX choice
    "LoKr f8 r16": LycorisOptions("lokr", dim=16, alpha=16.0, factor=8),
    "LoHa r16": LycorisOptions("loha", dim=16, alpha=16.0),
    "DoRA r16": LycorisOptions("lora", dim=16, alpha=16.0, dora_wd=True),
}
SDXL_ONLY = {"LoCon r16/c8": LycorisOptions("lora", dim=16, alpha=16.0, conv_dim=8, conv_alpha=8.0)}


def layers(model: str, conv: bool) -> tuple[dict, dict]:
    """(file names, {diffusers name: layer}) of the trainer's default targets on the released model (meta)."""
    configs = get_family(model).released_configs()
    built = get_family(model).released_components(configs)
    if model == "flux":
        transformer = built["transformer"]
        targets = {f"transformer.{p}": transformer.get_submodule(p)
                   for p in flux_lora_targets(transformer, ["attention"])}
        return file_names(model_keys("flux"), {"transformer": transformer}), targets
    encoders = {"text_encoder": built["text_encoder"], "text_encoder_2": built["text_encoder_2"]}
    names = file_names(model_keys("sdxl"), {"unet": built["unet"], **encoders})
    return names, sdxl_targets(built["unet"], encoders, "full" if conv else "attn-mlp", conv=conv)


def count(options: LycorisOptions, targets: dict[str, nn.Module]) -> int:
    """Trainable parameters, one layer of each distinct shape built on the CPU (DoRA reads the base weight)."""
    by_shape = collections.Counter(_shape_key(layer) for layer in targets.values())
    total = 0
    for key, n in by_shape.items():
        module = _module(options, key)
        total += n * sum(p.numel() for p in module.parameters() if p.requires_grad)
    return total


def _shape_key(layer: nn.Module) -> tuple:
    if isinstance(layer, nn.Conv2d):
        return ("conv", layer.in_channels, layer.out_channels, layer.kernel_size, layer.padding)
    return ("linear", layer.in_features, layer.out_features)


def _real(key: tuple) -> nn.Module:
    with torch.device("meta"):
        layer = (nn.Conv2d(key[1], key[2], key[3], padding=key[4]) if key[0] == "conv"
                 else nn.Linear(key[1], key[2]))
    layer = layer.to_empty(device="cpu")
    with torch.no_grad():
        layer.weight.normal_(0, 0.02)
        layer.bias.zero_()
    return layer.requires_grad_(False)


def _module(options: LycorisOptions, key: tuple, layer: nn.Module | None = None) -> nn.Module:
    layer = layer if layer is not None else _real(key)
    return create_network({"x": ("x", layer)}, {"x": layer}, options).loras["x"]


def _shape_runs(types: dict[str, LycorisOptions], key: tuple, tokens: int) -> dict[str, Callable[[], None]]:
    """One full-width layer per type with its adapter, and a training step over it (forward, backward, AdamW)."""
    side = max(1, int(tokens ** 0.5))
    x = torch.randn((1, key[1], side, side) if key[0] == "conv" else (tokens, key[1]))
    runs = {}
    for label, options in types.items():
        layer = _real(key)
        module = _module(options, key, layer)
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)

        def run(layer: nn.Module = layer, optimizer: torch.optim.Optimizer = optimizer) -> None:
            layer(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        runs[label] = run
    return runs


def step_seconds(types: dict[str, LycorisOptions], targets: dict[str, dict[str, nn.Module]], tokens: int,
                 steps: int) -> dict[str, float]:
    """Seconds per step of each type's adapted layers. Per layer shape the types' steps run in turn, one of each
    per round, so a slow spell on a shared machine slows every type alike."""
    shapes = {label: collections.Counter(_shape_key(layer) for layer in targets[label].values()) for label in types}
    total = dict.fromkeys(types, 0.0)
    for key in sorted({k for counts in shapes.values() for k in counts}, key=str):
        users = {label: types[label] for label in types if shapes[label][key]}
        for label, seconds in time_alternating(_shape_runs(users, key, tokens), steps).items():
            total[label] += shapes[label][key] * seconds
    return total


def time_alternating(runs: dict[str, Callable[[], None]], steps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {label: [] for label in runs}
    for run in runs.values():
        run()
    for _ in range(steps):
        for label, run in runs.items():
            start = time.perf_counter()
            run()
            times[label].append(time.perf_counter() - start)
    return {label: sorted(t)[len(t) // 2] for label, t in times.items()}


def report(model: str, tokens: int, steps: int) -> None:
    print(f"\n{model}: {'type':<14}{'params':>13}{'file (fp32)':>14}{'AdamW state':>14}{'CPU s/step':>12}"
          f"{'x LoRA':>8}")
    types = TYPES | (SDXL_ONLY if model == "sdxl" else {})
    targets = {label: layers(model, conv=options.conv_dim is not None)[1] for label, options in types.items()}
    seconds = step_seconds(types, targets, tokens, steps)
    for label, options in types.items():
        params = count(options, targets[label])
        print(f"{'':<6}{label:<14}{params:>13,}{params * 4 / 2**20:>11.1f} MiB{params * 8 / 2**20:>10.1f} MiB"
              f"{seconds[label]:>12.3f}{seconds[label] / seconds['LoRA r16']:>8.2f}")


def compare_libraries(tokens: int, steps: int) -> None:
    """The same algorithm through LyCORIS and peft on one FLUX.1-dev attention layer (3072 x 3072)."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig, get_peft_model, get_peft_model_state_dict

    configs = {"LoKr f16": LoKrConfig(r=10000, alpha=1, decompose_factor=16, target_modules=["layer"],
                                      decompose_both=False),
               "LoHa r16": LoHaConfig(r=16, alpha=16, target_modules=["layer"]),
               "DoRA r16": LoraConfig(r=16, lora_alpha=16, use_dora=True, target_modules=["layer"])}
    print(f"\nlibraries, one 3072x3072 layer: {'type':<10}{'library':<9}{'params':>10}{'s/step':>10}  file keys")
    for label, peft_config in configs.items():
        key = ("linear", 3072, 3072)
        module = _module(TYPES[label], key)
        lyco_keys = sorted(k.removeprefix("x.") for k in module.state_dict())
        wrapper = nn.Sequential(collections.OrderedDict(layer=_real(key)))
        peft_model = get_peft_model(wrapper, peft_config)
        peft_params = [p for p in peft_model.parameters() if p.requires_grad]
        peft_keys = sorted(k.split("layer.", 1)[1] for k in get_peft_model_state_dict(peft_model))
        x = torch.randn(tokens, 3072)
        optimizer = torch.optim.AdamW(peft_params, lr=1e-4)

        def peft_run(peft_model: nn.Module = peft_model, x: torch.Tensor = x,
                     optimizer: torch.optim.Optimizer = optimizer) -> None:
            peft_model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        runs = _shape_runs({"LyCORIS": TYPES[label]}, key, tokens) | {"peft": peft_run}
        seconds = time_alternating(runs, steps)
        lyco_params = sum(p.numel() for p in module.parameters() if p.requires_grad)
        print(f"{'':<32}{label:<10}{'LyCORIS':<9}{lyco_params:>10,}{seconds['LyCORIS']:>10.4f}  {', '.join(lyco_keys)}")
        print(f"{'':<32}{label:<10}{'peft':<9}{sum(p.numel() for p in peft_params):>10,}"
              f"{seconds['peft']:>10.4f}  {', '.join(peft_keys)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("flux", "sdxl", "both"), default="both")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per layer call")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layer shape (median)")
    parser.add_argument("--no_libraries", action="store_true", help="skip the LyCORIS / peft comparison")
    args = parser.parse_args()
    torch.manual_seed(0)
    for model in (("flux", "sdxl") if args.model == "both" else (args.model,)):
        report(model, args.tokens, args.steps)
    if not args.no_libraries:
        compare_libraries(args.tokens, args.steps)


if __name__ == "__main__":
    main()
