"""``dreamstep generate``: the run (:mod:`.generate`), LoRA specs and loading (:mod:`.loras`), pipelines on a
device and precision (:mod:`.pipelines`), and PNGs that carry their parameters (:mod:`.outputs`,
:mod:`dreamstep.png_text`)."""

from dreamstep.generation.loras import LoraSpec, apply_loras, parse_lora_spec
from dreamstep.generation.outputs import save_png
from dreamstep.generation.pipelines import build_pipeline, choose_dtype
from dreamstep.models.precision import choose_device
from dreamstep.png_text import a1111_parameters, read_parameters

__all__ = ["LoraSpec", "a1111_parameters", "apply_loras", "build_pipeline", "choose_device", "choose_dtype",
           "parse_lora_spec", "read_parameters", "save_png"]
