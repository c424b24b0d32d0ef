"""FLUX.1 (with Kontext and ControlNet) as a model family: see :mod:`dreamstep.models.flux.family`."""
