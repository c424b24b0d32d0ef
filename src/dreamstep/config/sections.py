"""The sections of a trainer's options, in the order a user reads them: the model and the data first, what
trains and how, then memory, validation and output. ``--help``, the resolved ``config.toml`` and the dashboard's
new-run form show the options in this order; a flag's section follows from its name."""

from __future__ import annotations

import re
from collections.abc import Iterable

# Matched in this order (a name takes the first section whose pattern it holds); the rest is optimization.
_PATTERNS = (
    ("model", r"pretrained|revision|variant|single_file|model_config|^clip_l$|^t5xxl$|^ae$|controlnet_model|"
              r"quantization|fp8_base|no_half_vae|v_parameterization|num_(double|single)_layers|max_sequence_length|"
              r"t5xxl_max_token_length|apply_t5_attn_mask"),
    ("data", r"data_dir|dataset|caption|^instance_|^class_|prior|num_class_images|^sample_batch_size|_crop|"
             r"random_flip|repeats|^resolution|bucket|in_json|jsonl|_column|proportion_empty|data_?loader"),
    ("LoRA / adapter", r"^rank$|^lora_|^network_|kohya|text_encoder_lr|train_text_encoder|text_encoder$|"
                       r"controlnet_weights"),
    ("validation / evaluation", r"validat|^eval_|^sample_|dino|clip_model"),
    ("memory", r"checkpointing$|blocks_to_swap|mixed_precision|^full_|^cache_|compile|device_memory|tf32|sdpa|"
               r"flash_attn|xformers|shard_base|zero_stage|dry_run"),
    ("output", r"^output_|^save_|checkpoint|^logging|report_to|log_with|overwrite|^resume"),
)
OTHERWISE = "optimization"
SECTIONS = ("model", "data", "LoRA / adapter", OTHERWISE, "memory", "validation / evaluation", "output")


def section_of(name: str) -> str:
    return next((title for title, pattern in _PATTERNS if re.search(pattern, name)), OTHERWISE)


def in_section_order(names: Iterable[str]) -> list[str]:
    """``names`` by section, each section's names in the order given."""
    return sorted(names, key=lambda name: SECTIONS.index(section_of(name)))
