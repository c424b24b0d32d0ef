"""``dreamstep dashboard``: a local, read-only web page over run folders and a dataset check.

- :mod:`.runs`: run folders (status, curves, samples, metrics, config, LoRA files, log tail);
- :mod:`.scalars`: the run's scalars, read incrementally from ``train.log`` or TensorBoard files;
- :mod:`.dataset_check`: what the trainer's data code makes of a dataset, with every problem;
- :mod:`.paths`: the only way from a URL to a file;
- :mod:`.app`: the Starlette application; ``static/``: the page (plain HTML, CSS and JS, no build step).
"""
