"""dreamstep: fine-tune FLUX.1 and SDXL with LoRA, DreamBooth and ControlNet."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["TrainStep", "StaticLossScaler", "DynamicLossScaler"]


def __getattr__(name: str) -> Any:
    # Imported on first use so that `dreamstep --help` does not pay for importing torch.
    if name in __all__:
        from dreamstep.engine import train_step

        return getattr(train_step, name)
    raise AttributeError(f"module 'dreamstep' has no attribute {name!r}")
