"""SDXL as a model family: see :mod:`dreamstep.models.sdxl.family`."""
