"""One ``train flux-kohya`` step has the loss sd-scripts' FLUX trainer computes for the same draws, for every
``--timestep_sampling`` and ``--model_prediction_type`` (and σ weightings, Huber losses, a regularization image's
``--prior_loss_weight``, ``--apply_t5_attn_mask`` against sd-scripts' own FLUX model). The expected numbers come
from sd-scripts' own functions, run once on the same tiny transformer and inputs
(``tests/fixtures/sd_scripts/make_flux_step_losses.py`` says how)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dreamstep.config.flux_kohya import FluxKohyaConfig
from dreamstep.config.flux_network_args import FluxNetworkOptions
from dreamstep.config.schema import build_config
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.kohya_flux_network import create_flux_network
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.flux.tiny import build_tiny_flux
from dreamstep.models.vae import posterior_mean
from dreamstep.recipes.flux_kohya import FluxKohyaModel, FluxKohyaStep, sd_scripts_sigmas

FIXTURES = Path(__file__).parents[1] / "fixtures" / "sd_scripts"
EXPECTED = json.loads((FIXTURES / "flux_step_losses.json").read_text())
sys.path.insert(0, str(FIXTURES))
from make_flux_step_losses import inputs  # noqa: E402  (the fixture's own inputs, made the same way)


class GivenLatentsStep(FluxKohyaStep):
    """sd-scripts trains on the latents its cache holds; the step here takes them as given (the posterior's mean,
    with no draw), so the noise and σ are the next draws of the seeded generator on both sides."""

    def target(self, batch: dict[str, Any]) -> torch.Tensor:
        return posterior_mean(batch["latent_dist"])


@pytest.fixture(scope="module")
def transformer() -> torch.nn.Module:
    return build_tiny_flux(seed=0, guidance_embeds=True).transformer


def _config(flags: dict[str, Any], files: dict[str, Path], model_config: Path, tmp_path: Path) -> FluxKohyaConfig:
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[[datasets]]\nresolution = 32\n[[datasets.subsets]]\nimage_dir = "{tmp_path}"\n')
    return build_config(FluxKohyaConfig, {
        "pretrained_model_name_or_path": str(files["transformer"]), "clip_l": str(files["clip_l"]),
        "t5xxl": str(files["t5xxl"]), "ae": str(files["ae"]), "model_config": str(model_config),
        "dataset_config": str(toml), "output_dir": str(tmp_path / "out"), "prior_loss_weight": "0.5",
        **{k: str(v) for k, v in flags.items()}})


def _step_loss(flags: dict[str, Any], transformer: torch.nn.Module, files: dict[str, Path], model_config: Path,
               tmp_path: Path, **changes: torch.Tensor) -> float:
    """One FluxKohyaStep step's loss on the fixture's inputs and draws (``changes``: batch entries replaced)."""
    config = _config(flags, files, model_config, tmp_path)
    network = create_flux_network(transformer, None, FluxNetworkOptions(dim=4, alpha=1.0))
    try:
        step = GivenLatentsStep(
            FluxKohyaModel(transformer, network, None), accelerator=make_accelerator(mixed_precision="no"),
            optimizer=build_optimizer("AdamW", list(network.parameters()), 1e-4),
            sigmas=sd_scripts_sigmas(config.discrete_flow_shift), objective=config.flow_matching_objective(),
            prior_loss_weight=config.prior_loss_weight, per_sample_prior_weight=True,
            guidance_scale=config.guidance_scale)
        given = inputs()
        batch = {"latent_dist": torch.cat([given["latents"], torch.zeros_like(given["latents"])], dim=1),
                 "pooled": given["pooled"], "prompt_embeds": given["prompt_embeds"],
                 "text_ids": flux.text_ids(6, "cpu", torch.float32), "is_reg": torch.tensor(EXPECTED["is_reg"])}
        if config.apply_t5_attn_mask:  # what FluxConditioner gives with the flag: the cached T5 mask
            batch["text_mask"] = torch.tensor(EXPECTED["t5_mask"])
        torch.manual_seed(EXPECTED["seed"])
        with torch.no_grad():
            return step.forward(batch | changes).item()
    finally:
        network.detach()


@pytest.mark.parametrize("case", EXPECTED["cases"])
def test_one_step_has_sd_scripts_loss(case: str, transformer: torch.nn.Module, tiny_flux_files: dict[str, Path],
                                      tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    expected = EXPECTED["cases"][case]
    loss = _step_loss(expected["flags"], transformer, tiny_flux_files, tiny_flux_dev_dir, tmp_path)
    assert loss == pytest.approx(expected["loss"], rel=1e-5)


def test_the_t5_mask_hides_the_padding_tokens(transformer: torch.nn.Module, tiny_flux_files: dict[str, Path],
                                              tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    # --apply_t5_attn_mask: the padded positions' embeddings change nothing; without the mask they change the loss.
    case = EXPECTED["cases"]["sigma + sigma_scaled + t5 attention mask"]
    padding = torch.tensor(EXPECTED["t5_mask"]) == 0
    embeds = inputs()["prompt_embeds"]
    noise = 10 * torch.randn(embeds.shape, generator=torch.Generator().manual_seed(1))
    changed = torch.where(padding[..., None], noise, embeds)
    masked = _step_loss(case["flags"], transformer, tiny_flux_files, tiny_flux_dev_dir, tmp_path)
    masked_changed = _step_loss(case["flags"], transformer, tiny_flux_files, tiny_flux_dev_dir, tmp_path,
                                prompt_embeds=changed)
    assert masked_changed == masked and masked == pytest.approx(case["loss"], rel=1e-5)  # bit for bit
    unmasked = {k: v for k, v in case["flags"].items() if k != "apply_t5_attn_mask"}
    plain = _step_loss(unmasked, transformer, tiny_flux_files, tiny_flux_dev_dir, tmp_path)
    plain_changed = _step_loss(unmasked, transformer, tiny_flux_files, tiny_flux_dev_dir, tmp_path,
                               prompt_embeds=changed)
    # (the tiny model's text moves its loss a little: 2e-4 here, where the mask lets nothing through)
    assert abs(plain_changed - plain) > 1e-4 and abs(plain - masked) > 1e-5


def test_the_sigma_table_is_sd_scripts_shifted_table() -> None:
    # sd-scripts' FlowMatchEulerDiscreteScheduler(1000, shift): σ_i = s·t/(1 + (s-1)·t), t = (1000 - i)/1000.
    table = sd_scripts_sigmas(3.1582)
    t = torch.arange(1000, 0, -1) / 1000
    torch.testing.assert_close(table, 3.1582 * t / (1 + 2.1582 * t))
    # The fixture's σ of "sigma" sampling are entries of that table.
    sigmas = EXPECTED["cases"]["sigma + sigma_scaled + sigma_sqrt"]["sigmas"]
    assert all(torch.isclose(table, torch.tensor(s)).any() for s in sigmas)
