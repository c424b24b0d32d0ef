"""dreamstep: fine-tune FLUX.1 and SDXL with LoRA, DreamBooth and ControlNet."""

from dreamstep.engine.train_step import DynamicLossScaler, StaticLossScaler, TrainStep

__all__ = ["TrainStep", "StaticLossScaler", "DynamicLossScaler"]
__version__ = "0.1.0"
