"""LoRA training on a quantized frozen FLUX transformer: each backend that could serve ``--base_quantization``
against the unquantized base, in one run (one subprocess per mode, so peaks do not mix).

A FLUX-shaped transformer (random weights, saved once in bf16) is loaded through diffusers'
``quantization_config`` the way dreamstep loads it, a rank-16 LoRA is added to the attention with peft, and
AdamW steps run under bf16 autocast with gradient checkpointing. Printed per mode: the median step time,
its ratio to the unquantized base, the bytes of the frozen weights as stored (quantized tensors' inner
data and scales), and the loss of each step (it must fall, and stay close to the unquantized run's).

    python benchmarks/quantized_base.py                      # CPU: 768 wide, 2 double + 4 single blocks
    python benchmarks/quantized_base.py --width 3072 --tokens 4096   # a GPU, FLUX.1 width at 1024 px

Measured on the development CPU (torch 2.13, diffusers 0.42.1, torchao 0.18, optimum-quanto 0.2.7; 2 cores
shared with other jobs, load average about 11, so times are rough): step time none 37 s, torchao int8
70 s, quanto int8 71 s, torchao fp8 55 s, quanto fp8 48 s; losses of all five within 0.001 of each other
at every step, all falling. On a CPU the weight-only kernels dequantize per matmul, so they are slower
than bf16 there; their point is memory on the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODES = ("none", "torchao-int8", "torchao-fp8", "quanto-int8", "quanto-fp8")


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a (possibly quantized) tensor keeps: the sum over its inner tensors for a tensor subclass."""
    if hasattr(tensor, "__tensor_flatten__") and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def quantization_config(mode: str):
    from diffusers import QuantoConfig, TorchAoConfig

    if mode == "none":
        return None
    backend, kind = mode.split("-")
    if backend == "torchao":
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

        return TorchAoConfig(Int8WeightOnlyConfig() if kind == "int8" else Float8WeightOnlyConfig())
    return QuantoConfig(weights_dtype="int8" if kind == "int8" else "float8")


def one_mode(folder: Path, mode: str, tokens: int, text_tokens: int, steps: int) -> dict:
    from diffusers import FluxTransformer2DModel

    from dreamstep.lora.inject import add_lora
    from dreamstep.models.flux.lora_targets import flux_lora_targets

    config = quantization_config(mode)
    model = FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16,
                                                   **({"quantization_config": config} if config else {}))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).requires_grad_(False)
    frozen = sum(stored_bytes(p) for p in model.parameters())
    add_lora(model, flux_lora_targets(model, ["attention"]), 16, 16)
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    model.enable_gradient_checkpointing()
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    c = model.config

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device)

    inputs = dict(hidden_states=randn(1, tokens, c.in_channels),
                  encoder_hidden_states=randn(1, text_tokens, c.joint_attention_dim),
                  pooled_projections=randn(1, c.pooled_projection_dim), timestep=torch.full((1,), 0.5, device=device),
                  guidance=torch.full((1,), 3.5, device=device), img_ids=torch.zeros(tokens, 3, device=device),
                  txt_ids=torch.zeros(text_tokens, 3, device=device))
    target = randn(1, tokens, c.in_channels)
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(**inputs, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(out.float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"mode": mode, "step_s": statistics.median(times[1:]), "frozen_mib": frozen / 2**20, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=768, help="attention heads x 128")
    parser.add_argument("--double", type=int, default=2)
    parser.add_argument("--single", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="image tokens (4096 at 1024 px)")
    parser.add_argument("--text_tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--one", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_mode(Path(args.one[0]), args.one[1], args.tokens, args.text_tokens, args.steps)))
        return
    from diffusers import FluxTransformer2DModel

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = FluxTransformer2DModel(num_layers=args.double, num_single_layers=args.single, attention_head_dim=128,
                                       num_attention_heads=args.width // 128, joint_attention_dim=1024,
                                       pooled_projection_dim=256, guidance_embeds=True)
        model.to(torch.bfloat16).save_pretrained(tmp)
        del model
        rows = []
        for mode in args.modes:
            result = subprocess.run([sys.executable, __file__, "--one", tmp, mode, "--tokens", str(args.tokens),
                                     "--text_tokens", str(args.text_tokens), "--steps", str(args.steps)],
                                    capture_output=True, text=True, check=True)
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    reference = rows[0]["step_s"] if rows[0]["mode"] == "none" else None
    print(f"{'mode':<14} {'s/step':>8} {'ratio':>6} {'frozen MiB':>11}  losses")
    for row in rows:
        ratio = f"{row['step_s'] / reference:.2f}" if reference else "-"
        print(f"{row['mode']:<14} {row['step_s']:8.2f} {ratio:>6} {row['frozen_mib']:11.1f}  "
              f"{' '.join(f'{x:.4f}' for x in row['losses'])}")


if __name__ == "__main__":
    main()
