"""The GPU check: what a session lent one H100 / H200 for a few minutes runs first (``benchmarks/gpu_check.sh``).

At full size with random weights (speed and memory do not depend on their values), through the trainers' own
steps as ``flux_matrix.py`` and ``sdxl_lora.py`` build them: FLUX.1-dev LoRA rank 16 (attention, AdamW,
gradient checkpointing, bf16 autocast, fp32 cached inputs) at 512² and 1024² with a bf16, fp8 and nf4 base,
every block resident and with ``--blocks_to_swap``; then SDXL LoRA rank 16 at 1024². Each row prints s/step
(median of the timed steps after one warm-up step), the allocator's peak and the most it reserved during those
steps, and the memory plan's training phase for the same options beside them (``dreamstep plan``'s figure).

It keeps to its time budget (``--budget`` seconds from its start; the shell wrapper stops it at six minutes):
before each row it predicts the row's time from the rows done so far and skips the row, saying so, when it
would end after the budget. A row that fails (out of memory, a missing kernel) is a row of the table with its
error, and the next row runs. The markdown table is rewritten after every row, so a run cut short keeps the
rows it finished.

``--smoke`` runs the same rows at the tiny test model's widths on any device (the CI runs it on a CPU): it
proves the script runs; its figures mean nothing.

    benchmarks/gpu_check.sh                                   # the GPU check, table in gpu_check.md
    python benchmarks/gpu_check.py --smoke --table /tmp/t.md  # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel
from flux_matrix import Architecture, Row, Run, build_row_model, trainer_step, unavailable
from measure import PeakMemory, timed
from sdxl_lora import CLIP_G, CLIP_L, dreamstep_step
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from dreamstep.config.memory import use_expandable_segments
from dreamstep.diffusion import noise_prediction as noise_math
from dreamstep.lora.kohya_network import NetworkOptions, create_network
from dreamstep.models import memory_plan as mp
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.plans import Estimator
from dreamstep.models.precision import freeze
from dreamstep.models.published_configs import SDXL_UNET
from dreamstep.models.sdxl import plumbing as sdxl
from dreamstep.models.sdxl.tiny import build_tiny_sdxl

RANK = 16
SMOKE_RESOLUTION = {512: 32, 1024: 64}


@dataclass(frozen=True)
class Check:
    """One row of the table: ``family`` "flux" or "sdxl"; ``mode`` the base's precision (bf16, fp8, nf4)."""
    family: str
    mode: str
    resolution: int
    blocks_to_swap: int = 0

    def label(self) -> str:
        swap = f", swap {self.blocks_to_swap}" if self.blocks_to_swap else ""
        return f"{'FLUX.1-dev' if self.family == 'flux' else 'SDXL'} {self.mode}{swap}, {self.resolution}²"


@dataclass
class Result:
    check: Check
    seconds: float | None = None
    peak: float | None = None  # bytes
    reserved: float | None = None
    plan: int | None = None
    note: str = ""
    cost: float = 0.0  # seconds the row took
    stepping: float = 0.0  # of them, in training steps (the rest: building the model, the plan)


def checks(blocks_to_swap: int) -> list[Check]:
    """The rows, most wanted first: FLUX at 1024² (the targets of SPEC C8), SDXL, then FLUX at 512²."""
    def flux_rows(resolution: int) -> list[Check]:
        return [Check("flux", mode, resolution, swap) for swap in (0, blocks_to_swap)
                for mode in ("bf16", "fp8", "nf4")]

    return [*flux_rows(1024), Check("sdxl", "bf16", 1024), *flux_rows(512)]


@dataclass
class Clock:
    """The time budget, and the prediction of a row's time from the rows done (before any: ``first_build``
    seconds to build and 2 s a step at 1024², a guess for an H100)."""
    budget: float
    first_build: float
    start: float = field(default_factory=time.monotonic)
    done: list[Result] = field(default_factory=list)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def predicted(self, check: Check, steps: int) -> float:
        """The most time a finished row of the family spent outside its steps, plus the warm-up and timed steps
        at the s/step of the most alike finished row scaled by the tokens; before any row of the family: the
        guess."""
        alike = [r for r in self.done if r.check.family == check.family and r.seconds is not None]
        if not alike:
            return self.first_build + (steps + 1) * 2.0 * (check.resolution / 1024) ** 2
        nearest = max(alike, key=lambda r: (r.check.mode == check.mode, bool(r.check.blocks_to_swap) ==
                                            bool(check.blocks_to_swap), r.check.resolution == check.resolution))
        step = nearest.seconds * (check.resolution / nearest.check.resolution) ** 2
        return max(r.cost - r.stepping for r in alike) + (steps + 1) * step


@dataclass(frozen=True)
class Setup:
    device: torch.device
    smoke: bool
    steps: int
    folder: Path  # the models' configs, as a model folder the memory plan reads
    flux_run: Run


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(setup: Setup, check: Check, clock: Clock) -> Result:
    """Build the row's model, run one warm-up step and up to ``setup.steps`` timed ones (fewer when the budget
    ends first)."""
    result = Result(check)
    run_step = build_flux(setup, check) if check.family == "flux" else build_sdxl(setup, check)
    release(setup.device)  # what building left in the allocator's cache is not the step's
    first = timed(run_step, setup.device)
    times = []
    with PeakMemory(setup.device) as memory:
        while not times or (len(times) < setup.steps and clock.left() > 2 * first):
            times.append(timed(run_step, setup.device))
    result.seconds = statistics.median(times)
    result.peak, result.reserved = memory.peak_mib * 2**20, memory.reserved_mib * 2**20
    result.stepping = first + sum(times)
    result.note = f"{len(times)} timed step{'s' * (len(times) > 1)}"
    return result


def posterior(channels: int, side: int, device: torch.device) -> torch.Tensor:
    """A VAE posterior as the latent cache gives it: fp32 mean and std, (1, 2C, side, side)."""
    return torch.cat([torch.randn(1, channels, side, side, device=device),
                      torch.full((1, channels, side, side), 0.1, device=device)], dim=1)


def build_flux(setup: Setup, check: Check) -> Callable[[], object]:
    run = setup.flux_run
    row = Row(check.mode, bool(check.blocks_to_swap), False, check.resolution, 1)
    # Built on the card and quantized there (the trainer quantizes on load; quantizing 12B weights on the host would
    # take minutes); the swapper then takes the swapped blocks to host memory.
    model, params = build_row_model(row, run, check.blocks_to_swap, build_device=setup.device)
    tokens = run.arch.tokens
    batch = {"latent_dist": posterior(run.arch.vae["latent_channels"], check.resolution // 8, setup.device),
             "prompt_embeds": torch.randn(1, tokens, run.arch.t5_dim, device=setup.device),
             "pooled": torch.randn(1, run.arch.clip_dim, device=setup.device),
             "text_ids": flux.text_ids(tokens, setup.device, torch.float32),
             "is_reg": torch.zeros(1, dtype=torch.bool, device=setup.device)}
    return trainer_step(model, params, batch)


def sdxl_models(smoke: bool) -> tuple[dict, dict]:
    """The UNet's config and the two CLIP encoders' (the network reads their depths)."""
    if smoke:
        pipe = build_tiny_sdxl(seed=0)
        return dict(pipe.unet.config), {"text_encoder": pipe.text_encoder.config.to_dict(),
                                        "text_encoder_2": pipe.text_encoder_2.config.to_dict()}
    unet = {k: v for k, v in SDXL_UNET.items() if not k.startswith("_")}
    return unet, {"text_encoder": dict(CLIP_L, vocab_size=49408, max_position_embeddings=77),
                  "text_encoder_2": dict(CLIP_G, vocab_size=49408, max_position_embeddings=77)}


def build_sdxl(setup: Setup, check: Check) -> Callable[[], object]:
    unet_config, encoder_configs = sdxl_models(setup.smoke)
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(unet_config)
        encoders = {"text_encoder": CLIPTextModel(CLIPTextConfig(**encoder_configs["text_encoder"])),
                    "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**encoder_configs["text_encoder_2"]))}
    unet = unet.to(torch.bfloat16).to_empty(device=setup.device)
    with torch.no_grad():
        for param in unet.parameters():
            param.normal_(std=0.02)
    freeze(unet)
    unet.enable_gradient_checkpointing()
    network = create_network(unet, encoders, NetworkOptions(dim=RANK, alpha=float(RANK)),
                             train_text_encoder=False).to(torch.float32).train()
    scheduler = noise_math.training_scheduler(build_tiny_sdxl(seed=0).scheduler.config)
    step = dreamstep_step(unet, network, scheduler, "bf16")
    side, config = check.resolution // 8, unet.config
    size = torch.tensor([[check.resolution, check.resolution]])
    pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    batch = {"latent_dist": posterior(config.in_channels, side, setup.device),
             "add_time_ids": sdxl.add_time_ids(size, torch.zeros(1, 2, dtype=torch.long), size).to(setup.device),
             "prompt_embeds": torch.randn(1, 77, config.cross_attention_dim, device=setup.device),
             "pooled": torch.randn(1, pooled, device=setup.device),
             "is_reg": torch.zeros(1, dtype=torch.bool, device=setup.device)}
    return lambda: step(batch)


def write_configs(folder: Path, flux_transformer: dict, smoke: bool) -> None:
    """The models' configs as a model folder, so that the memory plan prices exactly the models measured."""
    unet, _ = sdxl_models(smoke)
    for family, sub, config in (("flux", "transformer", flux_transformer), ("sdxl", "unet", unet)):
        (folder / family / sub).mkdir(parents=True)
        (folder / family / sub / "config.json").write_text(json.dumps(config, default=list), encoding="utf-8")


@dataclass
class Plans:
    """The memory plan's training phase for each row, one estimator per family (built when first asked)."""
    folder: Path
    device_type: str
    estimators: dict[str, Estimator] = field(default_factory=dict)

    def train_phase(self, check: Check, tokens: int) -> int:
        if check.family not in self.estimators:
            self.estimators[check.family] = Estimator(
                check.family, str(self.folder / check.family), rank=RANK, device_type=self.device_type,
                **({"lora_layers": ["attention"]} if check.family == "flux" else {}))
        options = mp.PlanOptions(resolution=check.resolution, rank=RANK, blocks_to_swap=check.blocks_to_swap,
                                 base_quantization="none" if check.mode == "bf16" else check.mode,
                                 validation_images=False, max_sequence_length=tokens)
        return self.estimators[check.family](options).phase("train").device_total


def run_check(setup: Setup, check: Check, clock: Clock, plans: Plans) -> Result:
    """One row, whatever happens in it: skipped (not available here, or past the budget), failed, or measured."""
    reason = unavailable(Row(check.mode, False, False, check.resolution, 1), setup.device)
    if reason:
        return Result(check, note=f"skipped: {reason}")
    predicted = clock.predicted(check, setup.steps)
    if predicted > clock.left():
        return Result(check, note=f"skipped: would take about {predicted:.0f} s, {max(clock.left(), 0):.0f} s left")
    started = time.monotonic()
    try:
        result = measure(setup, check, clock)
        result.plan = plans.train_phase(check, setup.flux_run.arch.tokens)
    except Exception as error:  # noqa: BLE001 - one failing row must not end the check
        first_line = (str(error).strip().splitlines() or [""])[0][:200].replace("|", "/")
        result = Result(check, note=f"failed: {type(error).__name__}: {first_line}")
        traceback.print_exc()
    release(setup.device)
    result.cost = time.monotonic() - started
    return result


def table(results: list[Result], header: str, unit: tuple[str, float]) -> str:
    name, scale = unit
    rows = [header, "", f"| row | s/step | peak {name} | reserved {name} | plan {name} (train) | peak / plan | note |",
            "|---|---:|---:|---:|---:|---:|---|"]

    def size(value: float | None) -> str:
        return "" if value is None else f"{value / scale:.2f}"

    for r in results:
        ratio = f"{r.peak / r.plan:.2f}" if r.peak is not None and r.plan else ""
        seconds = "" if r.seconds is None else f"{r.seconds:.3f}"
        rows.append(f"| {r.check.label()} | {seconds} | {size(r.peak)} | {size(r.reserved)} | {size(r.plan)} | "
                    f"{ratio} | {r.note} |")
    return "\n".join(rows) + "\n"


def environment(device: torch.device, smoke: bool) -> str:
    import diffusers

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    size = "tiny test model widths (smoke run: the figures mean nothing)" if smoke else "full size, random weights"
    return (f"GPU check on {where}: {size}; torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"diffusers {diffusers.__version__}. Rank-16 LoRA, AdamW, gradient checkpointing, bf16 autocast, batch 1; "
            "peak and reserved: the allocator's during the timed steps (on a CPU: the process's peak RSS).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the tiny test model's widths (a CPU run for CI)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole check (default 330; smoke 40)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 3; smoke 1)")
    parser.add_argument("--blocks_to_swap", type=int, default=None,
                        help="the swap rows' count (default: every block but one, the plan's largest)")
    parser.add_argument("--table", type=Path, default=Path("gpu_check.md"), help="markdown file of the table")
    args = parser.parse_args()
    use_expandable_segments()  # as the trainers run (dreamstep's CLI sets it before CUDA initialises)
    clock = Clock(args.budget or (40 if args.smoke else 330), first_build=5 if args.smoke else 40)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    arch = Architecture.smoke() if args.smoke else Architecture()
    depth = (arch.transformer["num_layers"], arch.transformer["num_single_layers"])
    swap = args.blocks_to_swap if args.blocks_to_swap is not None else sum(depth) - 1
    rows = checks(swap)
    if args.smoke:
        rows = [Check(c.family, c.mode, SMOKE_RESOLUTION[c.resolution], c.blocks_to_swap) for c in rows]
    header = environment(device, args.smoke)
    print(header, flush=True)
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        write_configs(Path(tmp), arch.transformer, args.smoke)
        setup = Setup(device, args.smoke, args.steps or (1 if args.smoke else 3), Path(tmp),
                      Run(arch, depth, None, device, 0, 0, "inductor"))
        plans = Plans(Path(tmp), device.type)
        unit = ("MiB", 2**20) if args.smoke else ("GiB", 2**30)
        for check in rows:
            result = run_check(setup, check, clock, plans)
            results.append(result)
            clock.done.append(result)
            print(table([result], "", unit).splitlines()[-1], flush=True)
            args.table.write_text(table(results, header, unit), encoding="utf-8")
    print(f"table written to {args.table} ({time.monotonic() - clock.start:.0f} s)")


if __name__ == "__main__":
    main()
