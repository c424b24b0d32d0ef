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
printed as estimates. ``--size smoke`` runs the same rows on the tiny test model's widths (seconds on a CPU):
it proves the script runs, its numbers mean nothing.

Each row builds its own transformer and frees it before the next row starts (checked: the previous row's
transformer must be gone once garbage is collected, and the CUDA cache is emptied), so no row's memory or
compiled code is measured in another.

    python benchmarks/flux_matrix.py                          # default rows (CPU: a subset that takes minutes)
    python benchmarks/flux_matrix.py --modes bf16 fp8 --resolutions 512 1024 --batches 1 4 --offload both --compile both
    python benchmarks/flux_matrix.py --size smoke --compile both --compile_backend aot_eager   # the whole matrix, fast
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from flux_lora import CLIP_DIM, FULL_TRANSFORMER, FULL_VAE, T5_DIM, T5_TOKENS, add_benchmark_lora, reference_step
from measure import time_steps

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.models import quantization
from dreamstep.models.blocks import compile_blocks, prepare_blocks
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.flux.tiny import build_tiny_flux
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


@dataclass(frozen=True)
class Architecture:
    """The transformer and VAE configs a run builds, and the text embeddings it feeds."""
    transformer: dict = field(default_factory=lambda: dict(FULL_TRANSFORMER))
    vae: dict = field(default_factory=lambda: dict(FULL_VAE))
    tokens: int = T5_TOKENS
    t5_dim: int = T5_DIM
    clip_dim: int = CLIP_DIM

    @classmethod
    def smoke(cls) -> Architecture:
        """The widths of the tiny test model (``dreamstep tiny-model flux``)."""
        pipe = build_tiny_flux(seed=0, guidance_embeds=True)
        return cls(dict(pipe.transformer.config), dict(pipe.vae.config), 16, pipe.text_encoder_2.config.d_model,
                   pipe.text_encoder.config.hidden_size)


def unavailable(row: Row, device: torch.device) -> str | None:
    """Why ``row`` cannot run here, or ``None``."""
    if row.compile and row.mode in ("fp8", "int8"):
        # torch 2.13's AOT autograd (every backend) refuses a graph with tensor-subclass inputs whose outputs
        # alias each other, and the single-stream block returns two slices of one tensor.
        return "torch.compile refuses torchao weights in these blocks (aliased outputs)"
    if row.mode != "nf4":
        return None
    try:
        import bitsandbytes as bnb

        bnb.functional.quantize_4bit(torch.zeros(64, device=device, dtype=torch.bfloat16), quant_type="nf4")
    except Exception as error:  # noqa: BLE001 - any failure means this bitsandbytes cannot run nf4 here
        return f"needs bitsandbytes with nf4 kernels for {device.type} ({type(error).__name__})"
    return None


def build_transformer(arch: Architecture, depth: tuple[int, int], device: torch.device | str
                      ) -> FluxTransformer2DModel:
    """The transformer of ``arch`` with ``depth`` (double, single) blocks, bf16, random values, on ``device``."""
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(arch.transformer, num_layers=depth[0], num_single_layers=depth[1])
    model = model.to(torch.bfloat16).to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.02)
    freeze(model)
    return model


@dataclass(frozen=True)
class Shape:
    """Parameter counts of the transformer's parts, read from the architecture built on the meta device."""
    double: int  # one double-stream block
    single: int  # one single-stream block
    other: int  # embedders, final norm and projection
    width: int

    @classmethod
    def read(cls, arch: Architecture) -> Shape:
        with torch.device("meta"):
            model = FluxTransformer2DModel.from_config(arch.transformer, num_layers=1, num_single_layers=1)
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


def inputs(arch: Architecture, resolution: int, batch: int, device: torch.device) -> tuple[dict, torch.Tensor]:
    """Text embeddings of a batch in the dtype the trainer's caches give them, fp32 (the trainer's step casts them to
    the compute dtype, as diffusers' scripts do), and pixels in the VAE's."""
    pixels = torch.rand(batch, 3, resolution, resolution, device=device, dtype=torch.bfloat16) * 2 - 1
    embeds = {"prompt_embeds": torch.randn(batch, arch.tokens, arch.t5_dim, device=device),
              "pooled": torch.randn(batch, arch.clip_dim, device=device),
              "text_ids": flux.text_ids(arch.tokens, device, torch.float32)}
    return embeds, pixels


@dataclass(frozen=True)
class Run:
    """What every row of one run shares."""
    arch: Architecture
    depth: tuple[int, int]
    vae: AutoencoderKL
    device: torch.device
    steps: int
    warmup: int
    compile_backend: str


def build_row_model(row: Row, run: Run, blocks_to_swap: int | None = None,
                    build_device: torch.device | str | None = None
                    ) -> tuple[FluxTransformer2DModel, list[torch.nn.Parameter]]:
    """The row's transformer as the trainer prepares it (quantized, gradient checkpointing, the benchmark's LoRA,
    ``prepare_blocks``' swapping, compiled blocks as the row says) and its trainable parameters.
    ``blocks_to_swap``: default every block when the row offloads. It is built on ``build_device`` (default: the
    host when swapping, else the run's device); the swapper takes the swapped blocks' weights from wherever they
    are into host memory and moves the rest to the device."""
    swap = sum(run.depth) if blocks_to_swap is None and row.offload else blocks_to_swap or 0
    model = build_transformer(run.arch, run.depth, build_device or ("cpu" if swap else run.device))
    quantization.quantize_built_model(model, row.mode if row.mode in ("fp8", "int8", "nf4") else "none")
    model.enable_gradient_checkpointing()
    params = add_benchmark_lora(model)
    prepare_blocks(model, blocks_to_swap=swap, compile=False, device=run.device)
    if row.compile:
        compile_blocks(model, backend=run.compile_backend)
    return model, params


def sigmas() -> torch.Tensor:
    return FlowMatchEulerDiscreteScheduler(shift=3.0).sigmas[:1000]


def cached_batch(row: Row, run: Run) -> dict:
    """A batch of the row's size as the caches give it: the VAE's fp32 posterior of random pixels (encoded once,
    as caching latents does) and fp32 text embeddings."""
    embeds, pixels = inputs(run.arch, row.resolution, row.batch, run.device)
    with torch.no_grad():
        return {"latent_dist": flux.encode_posterior(run.vae, pixels),
                "is_reg": torch.zeros(row.batch, dtype=torch.bool, device=run.device), **embeds}


def trainer_step(model: FluxTransformer2DModel, params: list[torch.nn.Parameter], batch: dict
                 ) -> Callable[[], object]:
    """One call of the trainer's ``FluxLoraStep`` (AdamW, clipping, bf16 autocast) on ``batch``."""
    step = FluxLoraStep(FluxLoraModel(model), optimizer=build_optimizer("AdamW", params, 1e-4),
                        accelerator=make_accelerator(mixed_precision="bf16"), max_grad_norm=1.0, sigmas=sigmas(),
                        objective=FlowMatchingObjective(), guidance_scale=3.5, prior_loss_weight=1.0)
    return lambda: step(batch)


def measure_row(row: Row, run: Run) -> tuple[float, float, weakref.ref]:
    """(s/step, peak MiB, a weak reference to the row's transformer); mode "reference" is the reference loop
    at the row's size."""
    model, params = build_row_model(row, run)
    if row.mode == "reference":
        embeds, pixels = inputs(run.arch, row.resolution, row.batch, run.device)
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        autocast = torch.autocast(run.device.type, dtype=torch.bfloat16)
        seconds, peak = time_steps(lambda: reference_step(model, run.vae, sigmas(), optimizer, pixels, embeds,
                                                          autocast), run.steps, run.warmup, run.device)
    else:
        seconds, peak = time_steps(trainer_step(model, params, cached_batch(row, run)), run.steps, run.warmup,
                                   run.device)
    return seconds, peak, weakref.ref(model)


def release(row: Row, transformer: weakref.ref, device: torch.device) -> None:
    """Free everything of a finished row before the next one starts; a row whose transformer outlived it
    would leak its memory (and its compiled graphs) into the next row's figures."""
    torch._dynamo.reset()  # compiled blocks' graphs and guards
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if transformer() is not None:
        name = " ".join(row.label().split())
        raise RuntimeError(f"row '{name}': its transformer is still referenced after the row ended")


def measure_isolated(row: Row, run: Run) -> tuple[float, float]:
    seconds, peak, transformer = measure_row(row, run)
    release(row, transformer, run.device)
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["full", "smoke"], default="full",
                        help="full: FLUX.1-dev's widths; smoke: the tiny test model's (proves the script runs)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--resolutions", nargs="+", type=int, default=None,
                        help="default: 512 1024 (CPU: 512; smoke: 32)")
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="default: 1 4 (CPU: 1)")
    parser.add_argument("--offload", choices=["off", "on", "both"], default="both")
    parser.add_argument("--compile", choices=["off", "on", "both"], default=None, help="default: both (CPU: off)")
    parser.add_argument("--compile_backend", default="inductor",
                        help="torch.compile backend (aot_eager traces without generating code: a quick check)")
    parser.add_argument("--cpu_depth", type=int, nargs=2, default=(1, 1), metavar=("DOUBLE", "SINGLE"),
                        help="blocks of the reduced-depth model on a CPU (default 1 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 5 GPU, 1 CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3 GPU, 1 CPU)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    smoke = args.size == "smoke"
    depth = FULL_DEPTH if gpu and not smoke else tuple(args.cpu_depth)
    resolutions = args.resolutions or ([32] if smoke else [512, 1024] if gpu else [512])
    batches = args.batches or ([1, 4] if gpu else [1])
    choice = {"off": [False], "on": [True], "both": [False, True]}
    compiles = choice[args.compile or ("both" if gpu else "off")]
    steps, warmup = args.steps or (5 if gpu else 1), args.warmup or (3 if gpu else 1)
    torch.manual_seed(0)
    arch = Architecture.smoke() if smoke else Architecture()
    with torch.device(device):
        vae = AutoencoderKL.from_config(arch.vae).to(torch.bfloat16).eval().requires_grad_(False)
    run = Run(arch, depth, vae, device, steps, warmup, args.compile_backend)
    peak_flops = card_peak(device)
    shape = Shape.read(arch)

    where = torch.cuda.get_device_name(device) if gpu else f"CPU, {depth[0]} double + {depth[1]} single blocks"
    model_name = "tiny test model (smoke run: the figures mean nothing)" if smoke else "FLUX.1-dev"
    print(f"{model_name} LoRA matrix ({where}); rank 16 attention LoRA, AdamW, gradient checkpointing, bf16 compute")
    header = f"  {'row':<34}{'s/step':>9}{'peak MiB':>10}{'MFU':>7}{'x ref':>7}"
    if depth != FULL_DEPTH:
        header += f"{'est. s/step 19+38':>19}{'est. MiB 19+38':>16}"
    print(header)
    for resolution, batch in itertools.product(resolutions, batches):
        tokens = (resolution // 16) ** 2 + arch.tokens
        ref = Row("reference", False, False, resolution, batch)
        ref_seconds, ref_peak = measure_isolated(ref, run)
        print_row("reference (seed 000: VAE every step)", ref_seconds, ref_peak, ref_seconds, shape, depth, tokens,
                  batch, peak_flops, offload=False)
        for mode, offload, compiled in itertools.product(args.modes, choice[args.offload], compiles):
            row = Row(mode, offload, compiled, resolution, batch)
            reason = unavailable(row, device)
            if reason:
                print(f"  {row.label():<34}{reason}")
                continue
            seconds, peak = measure_isolated(row, run)
            print_row(row.label(), seconds, peak, ref_seconds, shape, depth, tokens, batch, peak_flops,
                      offload=offload)
            sys.stdout.flush()
    if not gpu:
        print("  (CPU: peak MiB is the process's peak RSS; GPU rows not measured on this machine)")


def print_row(label: str, seconds: float, peak_mib: float, ref_seconds: float, shape: Shape,
              depth: tuple[int, int], tokens: int, batch: int, peak_flops: float | None, *, offload: bool) -> None:
    flops = shape.step_flops(depth, tokens, batch)
    mfu = f"{flops / seconds / peak_flops:.0%}" if peak_flops else "-"
    line = f"  {label:<34}{seconds:>9.3f}{peak_mib:>10.0f}{mfu:>7}{ref_seconds / seconds:>7.2f}"
    if depth != FULL_DEPTH:
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
