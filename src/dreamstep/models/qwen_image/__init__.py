"""Qwen-Image and Qwen-Image-Edit (a 20B MMDiT with a Qwen2.5-VL text encoder and a 16-channel causal-video VAE)."""
