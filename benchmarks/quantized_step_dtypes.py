"""The dtypes and peak memory of the trainer's FLUX LoRA step over a quantized frozen base (issue 37, item 7).

The step is flux-lora's own (``FluxLoraStep`` over ``FluxLoraModel``, bf16 autocast, rank-16 fp32 attention LoRA,
gradient checkpointing, AdamW), fed what the caches give it (fp32 posteriors and embeddings), over a FLUX
transformer of 2 double + 4 single blocks with random bf16 weights quantized as the trainer loads them. Printed
per base: the dtype the transformer's ``hidden_states`` arrive in, the dtype of the residual stream (each block's
output), the peak bytes of the tensors the second step creates (activations, gradients, the dequantized weights
while their matmuls run; ``LiveTensorBytes``, the plan's own count), the plan's training pass for the same model
(CPU policy) and its ratio to the measured figure, and the seconds of that step. Then the bytes one frozen linear
of each base holds per weight element while its matmul runs, with an fp32 and with a bf16 input under bf16
autocast, and the dtype it returns; and the full-size plan's training pass (FLUX.1-dev, 1024 px, CUDA policy).

    python benchmarks/quantized_step_dtypes.py                       # width 1536, 512 px, 128 text tokens
    python benchmarks/quantized_step_dtypes.py --width 3072 --resolution 1024 --text_tokens 512   # a GPU

Measured on the development CPU (torch 2.13, diffusers 0.42.1, torchao 0.18, bitsandbytes 0.50.2; 2 shared cores,
so the seconds are rough), before the step cast its inputs and the quantized linears theirs -> after:

    base  input            stream           step MiB        plan MiB        plan/step
    none  fp32 -> bf16     bf16             123.6 -> 123.6  124.7 -> 124.7  1.01 -> 1.01
    fp8   fp32 -> bf16     bf16             226.1 -> 226.1  230.5 -> 230.5  1.02 -> 1.02
    int8  fp32 -> bf16     fp32 -> bf16     284.3 -> 150.7  283.4 -> 168.7  1.00 -> 1.12
    nf4   fp32 -> bf16     fp32 -> bf16     221.6 -> 123.6  238.4 -> 143.9  1.08 -> 1.16

One frozen int8 linear's forward: 5.92 -> 2.00 bytes per weight for an fp32 input (fp32 then bf16 copies -> bf16
alone), returning bf16 instead of fp32; fp8 9.92 either way (torchao dequantizes through fp32); nf4 0.00 here because
bitsandbytes dequantizes inside one op, out of LiveTensorBytes' sight (the plan prices the bf16 weight it makes).
The full-size plan's training pass (FLUX.1-dev, 1024 px, CUDA policy): int8 4.66 -> 2.48 GiB, nf4 4.48 -> 2.48,
beside bf16's 2.36 and fp8's 2.80.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models import memory_plan as mp
from dreamstep.models import quantization
from dreamstep.models.blocks import enable_checkpointing
from dreamstep.models.flux.lora_targets import flux_lora_targets
from dreamstep.models.plans import Estimator
from dreamstep.models.precision import cast_trainable_params_to_fp32
from dreamstep.models.published_configs import FLUX_DEV_TRANSFORMER
from dreamstep.recipes.flux_lora import FluxLoraModel, FluxLoraStep

RANK = 16


def small_config(width: int) -> dict:
    return dict(FLUX_DEV_TRANSFORMER, num_layers=2, num_single_layers=4, num_attention_heads=width // 128)


def quantized_transformer(config: dict, mode: str, device: torch.device) -> FluxTransformer2DModel:
    """Random bf16 weights (the same for every mode), quantized as ``--base_quantization`` loads them."""
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel.from_config(config).to(torch.bfloat16).to(device)
    quantization.quantize_built_model(transformer, mode)
    transformer.requires_grad_(False)
    return transformer


def trainer_step(transformer: FluxTransformer2DModel, device: torch.device) -> FluxLoraStep:
    add_lora(transformer, flux_lora_targets(transformer, ["attention"]), RANK, RANK)
    cast_trainable_params_to_fp32(transformer)
    enable_checkpointing(transformer, offload_to_host=False, device=device)
    transformer.train()
    model = FluxLoraModel(transformer)
    optimizer = build_optimizer("AdamW", [{"params": [p for p in model.parameters() if p.requires_grad]}], 1e-4)
    return FluxLoraStep(model, optimizer=optimizer, accelerator=make_accelerator(mixed_precision="bf16"),
                        sigmas=torch.linspace(1, 0, 1000), objective=FlowMatchingObjective(),
                        guidance_scale=3.5, prior_loss_weight=1.0)


def cached_batch(resolution: int, text_tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
    """What FluxConditioner gives the step: fp32 posteriors and embeddings from the caches."""
    side = resolution // 8
    return {"latent_dist": torch.randn(1, 32, side, side, device=device),
            "prompt_embeds": torch.randn(1, text_tokens, 4096, device=device),
            "pooled": torch.randn(1, 768, device=device), "text_ids": torch.zeros(text_tokens, 3, device=device),
            "is_reg": torch.zeros(1, dtype=torch.bool, device=device)}


def measure_step(config: dict, mode: str, resolution: int, text_tokens: int,
                 device: torch.device) -> tuple[str, str, int, float]:
    """(the transformer's input dtype, the residual stream's dtypes, the second step's created peak, its seconds)."""
    transformer = quantized_transformer(config, mode, device)
    seen: dict[str, set[str]] = {"input": set(), "stream": set()}
    transformer.register_forward_pre_hook(
        lambda _, args, kwargs: seen["input"].add(str(kwargs["hidden_states"].dtype)[6:]), with_kwargs=True)
    for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
        block.register_forward_hook(lambda _, args, out: seen["stream"].update(
            str(t.dtype)[6:] for t in (out if isinstance(out, tuple) else (out,))))
    step = trainer_step(transformer, device)
    batch = cached_batch(resolution, text_tokens, device)
    step(batch)  # the first step makes AdamW's state
    model = step.unwrapped_model
    state = [t for per_param in step.optimizer.state.values() for t in per_param.values()]
    start = time.perf_counter()
    with mp.LiveTensorBytes([*mp.tensors_of(model), *state]) as tracker:
        step(batch)
    return "/".join(sorted(seen["input"])), "/".join(sorted(seen["stream"])), tracker.peak, \
        time.perf_counter() - start


def linear_bytes(mode: str, width: int, device: torch.device) -> list[tuple[str, float, str]]:
    """Per input dtype (fp32, bf16) under bf16 autocast: bytes per weight element that one frozen linear of the
    base creates in its forward, and the dtype it returns."""
    layer = torch.nn.Linear(width, 4 * width, dtype=torch.bfloat16, device=device)
    holder = torch.nn.Sequential(layer)
    quantization.quantize_built_model(holder, mode)
    holder.requires_grad_(False)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(64, width, dtype=dtype, device=device, requires_grad=True)  # rows: no single-row kernel
        with mp.LiveTensorBytes([*mp.tensors_of(holder), x]) as tracker, \
                torch.autocast(device.type, dtype=torch.bfloat16):
            out = holder(x)
        made = tracker.peak - out.nbytes - (x.numel() * 2 if dtype != torch.bfloat16 else 0)  # less x's bf16 copy
        rows.append((str(dtype)[6:], made / (width * 4 * width), str(out.dtype)[6:]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--text_tokens", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=["none", "fp8", "int8", "nf4"])
    parser.add_argument("--full_size_plan", action=argparse.BooleanOptionalAction, default=True,
                        help="also the full-size plan's training pass (tens of seconds a mode without the plan cache)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = small_config(args.width)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "transformer").mkdir()
        (Path(tmp) / "transformer" / "config.json").write_text(json.dumps(config))
        estimator = Estimator("flux", tmp, rank=RANK, device_type=device.type)
        print(f"FLUX 2+4 blocks, width {args.width}, {args.resolution} px, {args.text_tokens} text tokens, "
              f"rank {RANK} attention LoRA, checkpointing, bf16 autocast, on {device.type}:")
        print(f"  {'base':<5} {'input':>6} {'stream':>11} {'step MiB':>9} {'plan MiB':>9} {'plan/step':>9} "
              f"{'s/step':>7}")
        for mode in args.modes:
            input_dtype, stream, peak, seconds = measure_step(config, mode, args.resolution, args.text_tokens,
                                                              device)
            planned = estimator.activations(args.resolution, 1, True, args.text_tokens, mode)
            print(f"  {mode:<5} {input_dtype:>6} {stream:>11} {peak / 2**20:9.1f} {planned / 2**20:9.1f} "
                  f"{planned / peak:9.2f} {seconds:7.1f}")
    print(f"\none frozen linear {args.width} -> {4 * args.width} under bf16 autocast: bytes per weight element "
          "its forward creates, and its output's dtype")
    for mode in args.modes:
        cells = ", ".join(f"{dtype} input {nbytes:.2f} B -> {out}" for dtype, nbytes, out in
                          linear_bytes(mode, args.width, device))
        print(f"  {mode:<5} {cells}")
    if not args.full_size_plan:
        return
    print("\nFLUX.1-dev LoRA rank 16, 1024 px, batch 1, checkpointing: the plan's training pass (CUDA policy), GiB")
    full = Estimator("flux", None, rank=RANK, device_type="cuda")
    for mode in args.modes:
        print(f"  {mode:<5} {full.activations(1024, 1, True, 512, mode) / mp.GIB:6.2f}")


if __name__ == "__main__":
    main()
