"""Training data: Kohya dataset TOMLs and diffusers-style flags become one pipeline of validated,
bucketed, captioned samples, with a content-keyed cache for latents and text embeddings.

Typical use (see each module for details)::

    configs = load_dataset_config("dataset.toml", cli=vars(args))      # or dreambooth_from_flags(...)
    dataset = build_dataset(configs, seed=args.seed)                    # validates every image up front
    loader = make_dataloader(dataset, seed=args.seed, epoch=0, skip_batches=0)

The names below are imported on first use, so a command that needs one torch-free module of this package
(``dataset from-hf --help``) does not pay for importing torch.
"""

import importlib
from typing import Any

_SOURCES = {
    "buckets": ("BucketSpec", "Placement", "make_bucket_resolutions"),
    "cache": ("TensorCache", "image_content_key", "latents_for_batch", "text_content_key"),
    "captions": ("CaptionOptions", "process_caption"),
    "dataset": ("BucketBatchSampler", "BucketDataset", "ConditionedBatches", "build_dataset", "collate",
                "make_dataloader"),
    "dataset_config": ("DatasetConfig", "SubsetConfig", "load_dataset_config", "parse_dataset_config",
                       "require_methods"),
    "images": ("load_rgb", "validate_images"),
    "sources": ("bucket_spec", "controlnet_from_flags", "dreambooth_from_flags"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'dreamstep.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dreamstep.data.{_MODULE_OF[name]}"), name)
