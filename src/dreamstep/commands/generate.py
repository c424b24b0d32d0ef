"""``dreamstep generate flux|sdxl``: the command line of :mod:`dreamstep.generation.generate`; its flags are
:mod:`dreamstep.config.generate`'s."""

from __future__ import annotations

from dreamstep.config.generate import GenerateConfig
from dreamstep.generation.generate import generate_images


def run(config: GenerateConfig) -> None:
    written = generate_images(config)
    folder = written[0].parent
    names = ", ".join(p.name for p in written[:3]) + (", ..." if len(written) > 3 else "")
    print(f"wrote {len(written)} image{'s' * (len(written) != 1)} to {folder}: {names} "
          f"(generation parameters in each PNG's 'parameters' and 'dreamstep' text chunks)")
