"""FLUX.1-dev LoRA memory and speed matrix: base precision x block swapping x compile x resolution x batch.

Every row trains the seed's LoRA (rank 16 on attention, AdamW, gradient checkpointing) through dreamstep's
``FluxLoraStep`` on random weights of FLUX.1-dev's width (speed does not depend on weight values), and
prints s/step, peak device memory, model-FLOPs utilisation against the card's bf16 peak, and the speed
ratio to the reference loop measured in the same run for the same resolution and batch. The reference is
seed 000's step: VAE-encode the batch every step, text embeddings computed once (as the seed does), no
compilation, every block on the device.

On a GPU the transformer has FLUX.1-dev's 19 double and 38 single blocks. On a CPU it keeps the full
width (3072, 24 heads; 4096 image + 512 text tokens at 1024²) but only ``--cpu_depth`` blocks, and the
19 + 38-block figures are extrapolated by model FLOPs per block (time) and by bytes per block (memory),
printed as estimates.

    python benchmarks/flux_matrix.py                          # default rows (CPU: a subset that takes minutes)
    python benchmarks/flux_matrix.py --modes bf16 fp8 --resolutions 512 1024 --batches 1 4 --offload both --compile both
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from flux_lora import FULL_TRANSFORMER, FULL_VAE, T5_DIM, T5_TOKENS, CLIP_DIM, add_benchmark_lora, reference_step
from measure import time_steps

from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.models import flux, quantization
from dreamstep.models.blocks import BlockSwapper, compile_blocks
from dreamstep.models.precision import freeze
from dreamstep.recipes.flux_lora import FluxLoraModel, FluxLoraStep

FULL_DEPTH = (19, 38)
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12, "A10": 125e12}
MODES = ("bf16", "fp8", "int8", "nf4")


@dataclass(frozen=True)
class Row:
    mode: str
    offload: bool
    compile: bool
    resolution: int
    batch: int

    def label(self) -> str:
        return (f"{self.mode:<5}{' offload' if self.offload else '':<9}{' compile' if self.compile else '':<9}"
                f"{self.resolution:>5}² b{self.batch}")


def unavailable(mode: str, device: torch.device) -> str | None:
    """Why ``mode`` cannot run here, or ``None``."""
    if mode == "nf4" and device.type != "cuda":
        return "needs CUDA (bitsandbytes nf4 has no CPU kernels)"
    return None


def quantize(model: FluxTransformer2DModel, mode: str) -> None:
    """Quantize the linear weights of an already built ``model`` the way ``--base_quantization`` loads
    them: torchao's weight-only int8 / fp8, or bitsandbytes NF4 (CUDA)."""
    if mode in ("int8", "fp8"):
        from torchao.quantization import quantize_

        quantize_(model, quantization.torchao_weight_config(mode))
    elif mode == "nf4":
        import bitsandbytes as bnb

        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              compute_dtype=torch.bfloat16, quant_type="nf4")
                    layer.weight = bnb.nn.Params4bit(child.weight.data.cpu(), requires_grad=False, quant_type="nf4")
                    if child.bias is not None:
                        layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                    setattr(parent, name, layer.to(child.weight.device))


def build_transformer(depth: tuple[int, int], device: torch.device | str) -> FluxTransformer2DModel:
    """FLUX.1-dev's transformer with ``depth`` (double, single) blocks, bf16, random values, on ``device``."""
    with torch.device("meta"):
        model = FluxTransformer2DModel(**dict(FULL_TRANSFORMER, num_layers=depth[0], num_single_layers=depth[1]))
    model = model.to(torch.bfloat16).to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.02)
    freeze(model)
    return model


@dataclass(frozen=True)
class Shape:
    """Parameter counts of FLUX.1-dev's parts, read from the architecture built on the meta device."""
    double: int  # one double-stream block
    single: int  # one single-stream block
    other: int  # embedders, final norm and projection
    width: int

    @classmethod
    def read(cls) -> Shape:
        with torch.device("meta"):
            model = FluxTransformer2DModel(**dict(FULL_TRANSFORMER, num_layers=1, num_single_layers=1))
        count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
        double, single = count(model.transformer_blocks[0]), count(model.single_transformer_blocks[0])
        return cls(double, single, count(model) - double - single, model.inner_dim)

    def step_flops(self, depth: tuple[int, int], tokens: int, batch: int) -> float:
        """Model FLOPs of one training step (forward + backward; recomputation not counted): 6 per
        parameter and token, plus attention scores and mixing (4·tokens²·width per block forward, x3)."""
        params = self.other + depth[0] * self.double + depth[1] * self.single
        return batch * (6 * params * tokens + 3 * 4 * tokens**2 * self.width * sum(depth))


def card_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK.items() if key in name), None)


def inputs(vae: AutoencoderKL, resolution: int, batch: int, device: torch.device) -> tuple[dict, torch.Tensor]:
    pixels = torch.rand(batch, 3, resolution, resolution, device=device, dtype=torch.bfloat16) * 2 - 1
    embeds = {"prompt_embeds": torch.randn(batch, T5_TOKENS, T5_DIM, device=device, dtype=torch.bfloat16),
              "pooled": torch.randn(batch, CLIP_DIM, device=device, dtype=torch.bfloat16),
              "text_ids": flux.text_ids(T5_TOKENS, device, torch.bfloat16)}
    return embeds, pixels


def measure_row(row: Row | None, depth: tuple[int, int], vae: AutoencoderKL, device: torch.device,
                steps: int, warmup: int) -> tuple[float, float]:
    """(s/step, peak MiB) of one row; mode "reference" is the reference loop at the row's size."""
    reference = row.mode == "reference"
    model = build_transformer(depth, "cpu" if row.offload else device)
    if row.mode in ("fp8", "int8", "nf4"):
        quantize(model, row.mode)
    model.enable_gradient_checkpointing()
    params = add_benchmark_lora(model)
    if row.offload:  # every block swapped: the smallest footprint
        BlockSwapper.for_model(model, sum(depth), device)
    if row.compile:
        compile_blocks(model)
    sigmas = FlowMatchEulerDiscreteScheduler(shift=3.0).sigmas[:1000]
    embeds, pixels = inputs(vae, row.resolution, row.batch, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    if reference:
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        seconds, peak = time_steps(lambda: reference_step(model, vae, sigmas, optimizer, pixels, embeds, autocast),
                                   steps, warmup, device)
    else:
        step = FluxLoraStep(FluxLoraModel(model), optimizer=build_optimizer("AdamW", params, 1e-4),
                            accelerator=make_accelerator(mixed_precision="bf16"), max_grad_norm=1.0, sigmas=sigmas,
                            weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                            guidance_scale=3.5, prior_loss_weight=1.0)
        with torch.no_grad():
            batch = {"latent_dist": flux.encode_posterior(vae, pixels).to(torch.bfloat16),
                     "is_reg": torch.zeros(row.batch, dtype=torch.bool, device=device), **embeds}
        seconds, peak = time_steps(lambda: step(batch), steps, warmup, device)
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--resolutions", nargs="+", type=int, default=None, help="default: 512 1024 (CPU: 512)")
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="default: 1 4 (CPU: 1)")
    parser.add_argument("--offload", choices=["off", "on", "both"], default="both")
    parser.add_argument("--compile", choices=["off", "on", "both"], default=None, help="default: both (CPU: off)")
    parser.add_argument("--cpu_depth", type=int, nargs=2, default=(1, 1), metavar=("DOUBLE", "SINGLE"),
                        help="blocks of the reduced-depth model on a CPU (default 1 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 5 GPU, 1 CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3 GPU, 1 CPU)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    depth = FULL_DEPTH if gpu else tuple(args.cpu_depth)
    resolutions = args.resolutions or ([512, 1024] if gpu else [512])
    batches = args.batches or ([1, 4] if gpu else [1])
    choice = {"off": [False], "on": [True], "both": [False, True]}
    compiles = choice[args.compile or ("both" if gpu else "off")]
    steps, warmup = args.steps or (5 if gpu else 1), args.warmup or (3 if gpu else 1)
    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKL(**FULL_VAE).to(torch.bfloat16).eval().requires_grad_(False)
    peak_flops = card_peak(device)
    shape = Shape.read()

    where = torch.cuda.get_device_name(device) if gpu else f"CPU, {depth[0]} double + {depth[1]} single blocks"
    print(f"FLUX.1-dev LoRA matrix ({where}); rank 16 attention LoRA, AdamW, gradient checkpointing, bf16 compute")
    header = f"  {'row':<34}{'s/step':>9}{'peak MiB':>10}{'MFU':>7}{'x ref':>7}"
    if not gpu:
        header += f"{'est. s/step 19+38':>19}{'est. MiB 19+38':>16}"
    print(header)
    for resolution, batch in itertools.product(resolutions, batches):
        tokens = (resolution // 16) ** 2 + T5_TOKENS
        ref = Row("reference", False, False, resolution, batch)
        ref_seconds, ref_peak = measure_row(ref, depth, vae, device, steps, warmup)
        print_row("reference (seed 000: VAE every step)", ref_seconds, ref_peak, ref_seconds, shape, depth, tokens,
                  batch, peak_flops, offload=False, gpu=gpu)
        for mode, offload, compiled in itertools.product(args.modes, choice[args.offload], compiles):
            row = Row(mode, offload, compiled, resolution, batch)
            reason = unavailable(mode, device)
            if reason:
                print(f"  {row.label():<34}{reason}")
                continue
            seconds, peak = measure_row(row, depth, vae, device, steps, warmup)
            print_row(row.label(), seconds, peak, ref_seconds, shape, depth, tokens, batch, peak_flops,
                      offload=offload, gpu=gpu)
            sys.stdout.flush()
    if not gpu:
        print("  (CPU: peak MiB is the process's peak RSS; GPU rows not measured on this machine)")


def print_row(label: str, seconds: float, peak_mib: float, ref_seconds: float, shape: Shape,
              depth: tuple[int, int], tokens: int, batch: int, peak_flops: float | None, *, offload: bool,
              gpu: bool) -> None:
    flops = shape.step_flops(depth, tokens, batch)
    mfu = f"{flops / seconds / peak_flops:.0%}" if peak_flops else "-"
    line = f"  {label:<34}{seconds:>9.3f}{peak_mib:>10.0f}{mfu:>7}{ref_seconds / seconds:>7.2f}"
    if not gpu:
        # Time scales with model FLOPs; memory with the bytes of the blocks that stay resident (with
        # swapping: none but the two in flight, already in the measured peak).
        full_seconds = seconds * shape.step_flops(FULL_DEPTH, tokens, batch) / flops
        bf16 = 2
        extra_blocks = 0 if offload else bf16 * ((FULL_DEPTH[0] - depth[0]) * shape.double
                                                 + (FULL_DEPTH[1] - depth[1]) * shape.single)
        # Gradient checkpointing keeps each block's input: (B, tokens, width) bf16, one per extra block.
        saved_inputs = (sum(FULL_DEPTH) - sum(depth)) * batch * tokens * shape.width * bf16
        line += f"{full_seconds:>19.1f}{peak_mib + (extra_blocks + saved_inputs) / 2**20:>16.0f}"
    print(line)


if __name__ == "__main__":
    main()
