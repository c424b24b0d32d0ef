"""Tiny random captioners for offline tests and demos, written as their publishers ship them so that
``dreamstep caption --model FOLDER`` loads them with the code that loads the real ones:

- ``florence2/``, ``blip/``: ``save_pretrained`` folders of transformers' Florence-2 and BLIP with their
  processors; ``qwen2_5_vl/``: Qwen2.5-VL's model, image processor, tokenizer and chat template (its processor
  is written part by part, because transformers' Qwen-VL processor object cannot be built without torchvision;
  the files are the ones its ``save_pretrained`` writes).
- ``llava/``: a LLaVA-layout instruction model (CLIP vision tower, Qwen2 language model, a Qwen-style chat
  template), the same ``--captioner qwen-vl`` path (any image-text-to-text model with a chat template) with a
  processor that needs no torchvision.
- ``wd14/``: ``model.onnx`` and ``selected_tags.csv``, SmilingWolf's layout: a small convolutional net over the
  tagger's input (NHWC BGR 0..255) ending in a sigmoid, one output per row of the tag list.

Random weights with the usual small initialisation make a language model stop at once (an empty caption);
the weights are drawn wider so the tiny models write text, and it depends on the picture.
"""

from __future__ import annotations

import contextlib
import csv
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dreamstep.files import honour_umask
from dreamstep.models.tiny import QWEN_CHAT_TEMPLATE, byte_vocab, write_tiny_qwen2_5_vl

IMAGE_SIZE = 32
TAGGER_SIDE = 32
_INIT = 0.5
FOLDERS = ("florence2", "blip", "qwen2_5_vl", "llava", "wd14")
# Tags of the tiny tagger, with Danbooru's categories: 9 rating, 0 general, 4 character.
TINY_TAGS = [("general", "9"), ("sensitive", "9"), ("questionable", "9"), ("explicit", "9"),
             ("1girl", "0"), ("solo", "0"), ("long_hair", "0"), ("smile", "0"), ("red_background", "0"),
             ("blue_sky", "0"), ("outdoors", "0"), ("^_^", "0"), ("hatsune_miku", "4"), ("kirby", "4")]


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def write_tiny_florence2(out: Path, seed: int = 0) -> Path:
    from transformers import (
        BartTokenizer,
        CLIPImageProcessorPil,
        Florence2Config,
        Florence2ForConditionalGeneration,
        Florence2Processor,
    )

    tokenizer = BartTokenizer(vocab=byte_vocab(["<s>", "<pad>", "</s>", "<unk>", "<mask>"]), merges=[],
                              extra_special_tokens={"image_token": "<image>"})
    text = dict(vocab_size=len(tokenizer), d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.eos_token_id, init_std=_INIT)
    # Two DaViT stages (strides 4 and 2): an 8x8 grid of image tokens at 32 px, plus the pooled one.
    vision = dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                  patch_prenorm=[False, True], embed_dim=[16, 32], num_heads=[2, 2], num_groups=[2, 2], window_size=2,
                  projection_dim=32, drop_path_rate=0.0, initializer_range=_INIT)
    config = Florence2Config(text_config=text, vision_config=vision, image_token_id=tokenizer.image_token_id)
    with _seeded(seed):
        model = Florence2ForConditionalGeneration(config).eval()
    image_processor = CLIPImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_center_crop=False)
    image_processor.image_seq_length = (IMAGE_SIZE // 8) ** 2 + 1
    processor = Florence2Processor(image_processor=image_processor, tokenizer=tokenizer)
    folder = out / "florence2"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def write_tiny_blip(out: Path, seed: int = 0) -> Path:
    from transformers import (
        BertTokenizer,
        BlipConfig,
        BlipForConditionalGeneration,
        BlipImageProcessorPil,
        BlipProcessor,
    )

    letters = list("abcdefghijklmnopqrstuvwxyz0123456789.,'-")
    words = ["a", "photo", "of", "dog", "cat", "red", "blue", "the", "in", "on", "with"]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]"] + words + letters + ["##" + c for c in letters]
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}, bos_token="[DEC]")
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                pad_token_id=tokenizer.pad_token_id, sep_token_id=tokenizer.sep_token_id,
                eos_token_id=tokenizer.sep_token_id, initializer_range=_INIT)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=8, initializer_range=_INIT)
    with _seeded(seed):
        model = BlipForConditionalGeneration(BlipConfig(text_config=text, vision_config=vision,
                                                        projection_dim=16)).eval()
    processor = BlipProcessor(image_processor=BlipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
                              tokenizer=tokenizer)
    folder = out / "blip"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


# Qwen's chat format: the image as vision-start, image-pad, vision-end before the text of the user's turn.
def write_tiny_llava(out: Path, seed: int = 0) -> Path:
    from transformers import (
        CLIPImageProcessorPil,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2Tokenizer,
    )

    tokenizer = Qwen2Tokenizer(vocab=byte_vocab([]), merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>"]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<image>")}
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8, initializer_range=_INIT)
    text = dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                initializer_range=_INIT, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])
    patches = (IMAGE_SIZE // 8) ** 2
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=ids["<image>"],
                         image_seq_length=patches, vision_feature_layer=-1)
    with _seeded(seed):
        model = LlavaForConditionalGeneration(config).eval()
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    template = QWEN_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
    # The CLIP tower's class token is dropped ("default" feature selection): one image token per patch.
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", chat_template=template,
                               num_additional_image_tokens=1)
    folder = out / "llava"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def write_tiny_wd14(out: Path, seed: int = 0) -> Path:
    """A WD14-layout tagger: NHWC BGR 0..255 in, one sigmoid score per tag out."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    channels, tags = 8, len(TINY_TAGS)
    weights = {
        "scale": np.array(1 / 127.5, dtype=np.float32), "shift": np.array(-1.0, dtype=np.float32),
        "conv_w": rng.normal(0, _INIT, (channels, 3, 3, 3)).astype(np.float32),
        "conv_b": np.zeros(channels, dtype=np.float32),
        "fc_w": rng.normal(0, 1.0, (channels, tags)).astype(np.float32),
        "fc_b": rng.normal(0, 0.5, tags).astype(np.float32),
    }
    nodes = [
        helper.make_node("Transpose", ["input_1:0"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Mul", ["nchw", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "shift"], ["centred"]),
        helper.make_node("Conv", ["centred", "conv_w", "conv_b"], ["conv"], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["features"]),
        helper.make_node("MatMul", ["features", "fc_w"], ["logits_nobias"]),
        helper.make_node("Add", ["logits_nobias", "fc_b"], ["logits"]),
        helper.make_node("Sigmoid", ["logits"], ["predictions_sigmoid"]),
    ]
    graph = helper.make_graph(
        nodes, "tiny_wd14_tagger",
        [helper.make_tensor_value_info("input_1:0", TensorProto.FLOAT, ["batch", TAGGER_SIDE, TAGGER_SIDE, 3])],
        [helper.make_tensor_value_info("predictions_sigmoid", TensorProto.FLOAT, ["batch", tags])],
        [numpy_helper.from_array(value, name) for name, value in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    folder = out / "wd14"
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / "model.onnx"))
    with open(folder / "selected_tags.csv", "w", encoding="utf-8", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(["tag_id", "name", "category", "count"])
        rows.writerows([i, name, category, 1000 - i] for i, (name, category) in enumerate(TINY_TAGS))
    return folder


def write_tiny_captioners(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write ``OUT/florence2``, ``OUT/blip``, ``OUT/qwen2_5_vl``, ``OUT/llava`` and ``OUT/wd14``; return each
    folder."""
    out = Path(out_dir)
    writers = {"florence2": write_tiny_florence2, "blip": write_tiny_blip, "qwen2_5_vl": write_tiny_qwen2_5_vl,
               "llava": write_tiny_llava, "wd14": write_tiny_wd14}
    folders = {name: write(out, seed) for name, write in writers.items()}
    for folder in folders.values():
        honour_umask(folder)
    return folders
