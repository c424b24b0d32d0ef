"""The memory plan: parameter counts of the full-size models on the meta device, the plan command and --dry_run,
and bad sizes (the estimate against measured steps: test_plan_phases.py)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dreamstep.cli import main
from dreamstep.config.memory import parse_bytes
from dreamstep.models import memory_plan as mp
from dreamstep.models.family import get_family
from dreamstep.models.phases import PHASES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT  # noqa: E402


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_full_size_parameter_counts_on_the_meta_device() -> None:
    flux = get_family("flux").meta_components(None)
    sdxl = get_family("sdxl").meta_components(None)
    transformer = flux["transformer"]
    assert round(_count(transformer) / 1e9, 2) == 11.90
    assert round(_count(transformer.transformer_blocks[0]) / 1e6) == 340
    assert round(_count(transformer.single_transformer_blocks[0]) / 1e6) == 142
    assert (len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)) == (19, 38)
    assert round(_count(flux["text_encoder_2"]) / 1e9, 2) == 4.76
    assert round(_count(flux["text_encoder"]) / 1e6) == 123
    assert round(_count(flux["vae"]) / 1e6) == 84
    assert round(_count(sdxl["unet"]) / 1e9, 2) == 2.57
    assert round(_count(sdxl["text_encoder_2"]) / 1e6) == 695
    assert all(p.device.type == "meta" for m in (*flux.values(), *sdxl.values()) for p in m.parameters())


def test_nf4_t5_keeps_its_wo_layers_out_of_4_bit() -> None:
    """transformers' bitsandbytes loader skips T5's _keep_in_fp32_modules (``wo``): 1.0B weights stay bf16, 1.35 GiB
    more than 4-bit would take."""
    t5 = get_family("flux").meta_components(None)["text_encoder_2"].requires_grad_(False)
    linears = {name: m.weight.numel() for name, m in t5.named_modules() if isinstance(m, torch.nn.Linear)}
    wo = sum(n for name, n in linears.items() if name.endswith(".wo"))
    four_bit = sum(linears.values()) - wo
    assert round(wo / 1e9, 2) == 1.01
    expected = (_count(t5) - four_bit) * 2 + four_bit * (0.5 + 4 / 64)
    assert mp.weight_bytes(t5, "nf4", 2) == int(expected)
    assert (expected - (_count(t5) - wo - four_bit) * 2 - (wo + four_bit) * (0.5 + 4 / 64)) / 2**30 == pytest.approx(
        1.35, abs=0.01)


def test_plan_command_says_what_fits(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "flux", "--device_memory", "12GB", "--base_quantization", "int8"]) == 0
    out = capsys.readouterr().out
    assert "11.90B" in out and "int8" in out and "does NOT fit" in out
    assert "would fit: --text_encoder_quantization int8 + --cpu_offload_checkpointing + --blocks_to_swap" in out
    # Every phase, with T5 priced while it encodes and waiting in host memory while the transformer trains.
    assert all(f"  {phase}: on the device" in out for phase in PHASES)
    assert "peak device memory" in out and "peak host memory" in out
    # SDXL encodes before its UNet loads, so it fits 8 GB; 6 GB needs a smaller UNet.
    assert main(["plan", "sdxl", "--device_memory", "8GB"]) == 0
    assert ": fits" in capsys.readouterr().out
    assert main(["plan", "sdxl", "--device_memory", "6GB"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "would fit: --base_quantization fp8 (or int8)" in out


def test_a_small_card_is_told_to_offload_the_checkpointed_inputs(capsys: pytest.CaptureFixture) -> None:
    """FLUX.1-dev at 1024 px with nf4, T5 in int8 and every block but one swapped: one image per step trains in 3.9
    GiB (the step feeds the transformer bf16 inputs, so its residual stream is bf16; 5.9 GiB with the fp32 stream it
    had), under T5's text encoding (5.3 GiB). Two images per step need 6.2 GiB; with --cpu_offload_checkpointing
    3.3, and the peak is the text encoding again. A card keeps 1 GiB free beside the plan: 6.5 GB takes the
    offloaded run of two images, and one image as it is; 6 GB (SPEC C8's smallest) takes neither, and no option
    lowers the text encoding's peak."""
    from dreamstep.models.plans import Estimator

    flags = ["--base_quantization", "nf4", "--text_encoder_quantization", "int8", "--blocks_to_swap", "56"]
    assert main(["plan", "flux", *flags, "--train_batch_size", "2", "--device_memory", "6.5GB"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "(5.5 GiB usable)" in out
    suggestion = next(line for line in out.splitlines() if line.startswith("  would fit:"))
    assert suggestion.startswith("  would fit: --cpu_offload_checkpointing (")
    estimator = Estimator("flux", None, rank=16)
    one = mp.PlanOptions(base_quantization="nf4", text_encoder_quantization="int8", blocks_to_swap=56)
    assert 3.5 * 2**30 < estimator(one).phase("train").device_total < 4.5 * 2**30
    assert mp.fits(estimator(one), parse_bytes("6.5GB", "--device_memory"))
    options = replace(one, batch_size=2)
    offloaded = estimator(replace(options, cpu_offload_checkpointing=True))
    assert mp.fits(offloaded, parse_bytes("6.5GB", "--device_memory"))
    assert not mp.fits(estimator(options), parse_bytes("6.5GB", "--device_memory"))
    assert not mp.fits(offloaded, parse_bytes("6GB", "--device_memory"))
    assert max(offloaded.phases, key=lambda phase: phase.device_total).name == "encode text"


def test_the_plan_says_whether_the_machines_memory_holds_its_host_side(capsys: pytest.CaptureFixture) -> None:
    """bf16 FLUX.1-dev with 56 swapped blocks: 21 GiB of blocks and the parked encoders wait in host memory."""
    from dreamstep.models.plans import Estimator

    plan = Estimator("flux", None, rank=16)(mp.PlanOptions(blocks_to_swap=56))
    assert 30 * 2**30 < plan.host_total < 32 * 2**30
    assert mp.format_plan(plan, None, host_memory=64 * 2**30).endswith(
        "host memory 64.0 GiB, 4 GiB kept for the system and this process: enough")
    assert mp.format_plan(plan, None, host_memory=32 * 2**30).endswith(
        "host memory 32.0 GiB, 4 GiB kept for the system and this process: NOT enough (fewer --blocks_to_swap, "
        "or quantized encoders, hold less there)")
    assert main(["plan", "flux", "--blocks_to_swap", "56"]) == 0  # this machine's memory
    assert "  host memory " in capsys.readouterr().out


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_flux_dev_dir: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "flux-lora", "--pretrained_model_name_or_path", str(tiny_flux_dev_dir),
                 "--output_dir", str(tmp_path / "out"), "--instance_data_dir", str(ROBOT_DIR),
                 "--instance_prompt", ROBOT_PROMPT, "--resolution", "32", "--dry_run", "--device_memory", "2GB"]) == 0
    out = capsys.readouterr().out
    assert "memory plan" in out and "transformer (frozen)" in out and ": fits" in out
    assert not (tmp_path / "out").exists()


def test_a_bad_memory_size_is_one_line(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert main(["plan", "sdxl", "--device_memory", "12XB"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--device_memory '12XB'" in err and "12GB" in err
    assert parse_bytes("24 GiB", "x") == 24 * 2**30 and parse_bytes("8000MB", "x") == 8000 * 2**20


@pytest.mark.parametrize("argv, message", [
    (["--resolution", "0"], "--resolution 0: give a positive multiple of 16"),
    (["--resolution=-512"], "--resolution -512: give a positive multiple of 16"),
    (["--resolution", "100"], "--resolution 100: give a positive multiple of 16 (e.g. 96)"),
    (["--device_memory", "0GB"], "--device_memory '0GB': a memory size must be above 0"),
    (["--max_sequence_length", "0"], "--max_sequence_length 0: T5 reads 1 to 512 tokens"),
    (["--max_sequence_length", "100000"], "--max_sequence_length 100000: T5 reads 1 to 512 tokens"),
    (["--blocks_to_swap", "4", "--no_gradient_checkpointing"], "--blocks_to_swap needs gradient checkpointing"),
    (["--rank", "0"], "--rank 0: must be at least 1"),
    (["--train_batch_size", "0"], "--train_batch_size 0: must be at least 1"),
    (["--pretrained_model_name_or_path", "./no/such/model"], "./no/such/model: no such folder"),
])
def test_a_plan_no_run_could_train_with_is_one_line(argv: list[str], message: str, capsys) -> None:
    assert main(["plan", "flux", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


@pytest.mark.parametrize("argv, message", [
    (["--text_encoder_quantization", "int8"], "--text_encoder_quantization applies to FLUX's T5 encoder"),
    (["--cpu_offload_checkpointing"], "--cpu_offload_checkpointing is a FLUX trainers' option"),
])
def test_an_sdxl_plan_refuses_options_sdxl_lora_does_not_have(argv: list[str], message: str, capsys) -> None:
    assert main(["plan", "sdxl", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {message}")


def test_a_model_folder_of_the_other_family_is_named(tiny_sdxl_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["plan", "flux", "--pretrained_model_name_or_path", str(tiny_sdxl_dir)]) == 2
    assert capsys.readouterr().err == (f"error: --pretrained_model_name_or_path {tiny_sdxl_dir}: a "
                                       "StableDiffusionXLPipeline folder, not a FLUX.1 pipeline; plan it with "
                                       "'dreamstep plan sdxl'\n")
    (tmp_path / "loose").mkdir()
    assert main(["plan", "sdxl", "--pretrained_model_name_or_path", str(tmp_path / "loose")]) == 2
    assert "no model_index.json there" in capsys.readouterr().err


def test_nf4_without_a_gpu_is_planned_for_another_machine(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["plan", "flux", "--base_quantization", "nf4", "--resolution", "512"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(
        "note: nf4 (bitsandbytes) trains only on a CUDA GPU; this machine has none, so this plan is for another "
        "machine")
