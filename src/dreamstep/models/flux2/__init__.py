"""FLUX.2 ([klein] 4B/9B with a Qwen3 text encoder, [dev] with Mistral Small 3.1): the family package."""
