"""A tiny random SDXL pipeline with the real UNet topology in miniature, and its single-file checkpoint (see
:mod:`dreamstep.models.tiny` for what is kept from the real models)."""

from __future__ import annotations

from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from dreamstep.config.choices import TINY_SDXL_SINGLE_FILE
from dreamstep.models.tiny import build_clip_tokenizer, clip_config, seeded, tiny_vae, to_eval

SINGLE_FILE_NAME = TINY_SDXL_SINGLE_FILE


def _sdxl_scheduler() -> EulerDiscreteScheduler:
    """The scheduler config shipped with stabilityai/stable-diffusion-xl-base-1.0."""
    return EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", interpolation_type="linear", use_karras_sigmas=False,
        timestep_spacing="leading", steps_offset=1,
    )


def _sdxl_unet(cross_attention_dim: int, pooled_dim: int) -> UNet2DConditionModel:
    """SDXL's UNet topology in miniature (real: channels 320/640/1280, heads 5/10/20, depth 1/2/10).

    The added conditioning takes the pooled CLIP-G embedding plus six Fourier-embedded size/crop
    numbers, hence ``projection_class_embeddings_input_dim = 6 * addition_time_embed_dim + pooled``.
    """
    addition_time_embed_dim = 8
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(16, 32, 32), norm_num_groups=8, attention_head_dim=(1, 2, 2),
        transformer_layers_per_block=(1, 1, 2), cross_attention_dim=cross_attention_dim,
        use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=addition_time_embed_dim,
        projection_class_embeddings_input_dim=6 * addition_time_embed_dim + pooled_dim,
    )


def build_tiny_sdxl(seed: int = 0) -> StableDiffusionXLPipeline:
    """A random SDXL base pipeline with the real UNet topology in miniature, in fp32 on the CPU."""
    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_clip_tokenizer(pad_token="!")
    with seeded(seed):
        # Widths differ (real: 768 and 1280) because diffusers' single-file loader tells CLIP-L and
        # CLIP-G apart by their position-embedding width; the projection is narrower than the
        # width so that a transposed text_projection cannot go unnoticed.
        text_encoder = CLIPTextModel(clip_config(tokenizer, "quick_gelu", 32, projection_dim=32))
        text_encoder_2 = CLIPTextModelWithProjection(
            clip_config(tokenizer_2, "gelu", 64, projection_dim=32))
        vae = tiny_vae(latent_channels=4, scaling_factor=0.13025, shift_factor=None, quant_conv=True)
        # The UNet attends to the concatenated penultimate hidden states of both encoders.
        unet = _sdxl_unet(
            cross_attention_dim=text_encoder.config.hidden_size + text_encoder_2.config.hidden_size,
            pooled_dim=text_encoder_2.config.projection_dim,
        )
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=text_encoder,
                                     text_encoder_2=text_encoder_2, tokenizer=tokenizer,
                                     tokenizer_2=tokenizer_2, unet=unet, scheduler=_sdxl_scheduler(),
                                     add_watermarker=False)
    to_eval(pipe)
    return pipe


