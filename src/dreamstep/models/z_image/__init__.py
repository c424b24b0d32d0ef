"""Z-Image (Tongyi-MAI's 6B single-stream DiT with a Qwen3-4B text encoder; base and Turbo) as a model family."""
