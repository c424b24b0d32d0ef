"""Training data: Kohya dataset TOMLs and diffusers-style flags become one pipeline of validated,
bucketed, captioned samples, with a content-keyed cache for latents and text embeddings.

Typical use (see each module for details)::

    configs = load_dataset_config("dataset.toml", cli=vars(args))      # or dreambooth_from_flags(...)
    dataset = build_dataset(configs, seed=args.seed)                    # validates every image up front
    loader = make_dataloader(dataset, seed=args.seed, epoch=0, skip_batches=0)
"""

from dreamstep.data.buckets import BucketSpec, Placement, make_bucket_resolutions
from dreamstep.data.cache import (
                                    TensorCache,
                                    image_content_key,
                                    latents_for_batch,
                                    text_content_key,
)
from dreamstep.data.captions import CaptionOptions, process_caption
from dreamstep.data.dataset import (
                                    BucketBatchSampler,
                                    BucketDataset,
                                    ConditionedBatches,
                                    build_dataset,
                                    collate,
                                    make_dataloader,
)
from dreamstep.data.dataset_config import (
                                    DatasetConfig,
                                    SubsetConfig,
                                    load_dataset_config,
                                    parse_dataset_config,
                                    require_methods,
)
from dreamstep.data.images import load_rgb, validate_images
from dreamstep.data.sources import (
                                    bucket_spec,
                                    controlnet_from_flags,
                                    dreambooth_from_flags,
)

__all__ = [
    "BucketBatchSampler", "BucketDataset", "BucketSpec", "CaptionOptions", "ConditionedBatches", "DatasetConfig",
    "Placement",
    "SubsetConfig", "TensorCache", "bucket_spec", "build_dataset", "collate", "controlnet_from_flags",
    "dreambooth_from_flags", "image_content_key", "latents_for_batch", "load_dataset_config", "load_rgb",
    "make_bucket_resolutions", "make_dataloader", "parse_dataset_config", "process_caption",
    "require_methods", "text_content_key", "validate_images",
]
