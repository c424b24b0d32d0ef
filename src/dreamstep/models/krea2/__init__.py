"""Krea 2 (Krea's 12B single-stream DiT with Qwen-Image's VAE and a Qwen3-VL text encoder; RAW and Turbo) as a model
family."""
