"""The MindSpore port's LoRA checkpoints load to their exact stored values, without MindSpore."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lora_testkit import MINDSPORE_DIR

from dreamstep.errors import UserError
from dreamstep.lora.convert import convert_lora, read_lora
from dreamstep.lora.mindspore_ckpt import load_mindspore_ckpt, save_mindspore_ckpt

KEY = "lora_unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_down.weight"


def _raw_values(path, key: str, dtype, count: int) -> np.ndarray:
    """An independent decode: the ``count`` values right after the key's ``tensor_content`` field header
    (protobuf field 3, length-delimited: 0x1a and the byte count as a varint)."""
    data = path.read_bytes()
    nbytes = count * np.dtype(dtype).itemsize
    varint = bytes([nbytes & 0x7F | 0x80, nbytes >> 7]) if nbytes >= 128 else bytes([nbytes])
    start = data.index(b"\x1a" + varint, data.index(key.encode())) + 1 + len(varint)
    return np.frombuffer(data, dtype=dtype, count=count, offset=start)


@pytest.mark.parametrize("name, dtype", [("mindspore_lora_fp32.ckpt", np.float32),
                                         ("mindspore_lora_fp16.ckpt", np.float16)])
def test_port_files_load_exact_values(name, dtype, tmp_path):
    path = MINDSPORE_DIR / name
    tensors = load_mindspore_ckpt(path)
    assert len(tensors) == 12
    down = tensors[KEY]
    assert down.shape == (4, 32) and down.dtype == torch.from_numpy(np.zeros(1, dtype)).dtype
    assert np.array_equal(down.numpy().ravel(), _raw_values(path, KEY, dtype, 128))
    assert float(tensors[KEY.replace("lora_down.weight", "alpha")]) == 4.0

    lora = read_lora(path)
    assert lora.format == "mindspore-sdxl" and len(lora.modules) == 4

    # Written back in the same layout, the file is byte for byte the port's.
    save_mindspore_ckpt(tensors, tmp_path / "again.ckpt")
    assert (tmp_path / "again.ckpt").read_bytes() == path.read_bytes()


def test_port_file_converts_to_kohya_with_values_kept(tmp_path):
    src = MINDSPORE_DIR / "mindspore_lora_fp16.ckpt"
    convert_lora(src, tmp_path / "kohya.safetensors", "kohya")
    kohya = read_lora(tmp_path / "kohya.safetensors").modules
    source = load_mindspore_ckpt(src)
    assert torch.equal(kohya["lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"].down, source[KEY])
    assert torch.equal(kohya["lora_unet_middle_block_1_proj_in"].up,
                       source["lora_unet.mid_block.attentions.0.proj_in.lora_up.weight"])
    assert kohya["lora_te1_text_model_encoder_layers_0_self_attn_q_proj"].alpha == 4.0


def test_bf16_file_loads_exactly(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {KEY: torch.randn(4, 32, generator=g).to(torch.bfloat16),
               KEY.replace("lora_down", "lora_up"): torch.randn(32, 4, generator=g).to(torch.bfloat16),
               KEY.replace("lora_down.weight", "alpha"): torch.tensor(2.0, dtype=torch.bfloat16)}
    save_mindspore_ckpt(tensors, tmp_path / "bf16.ckpt")
    raw = (tmp_path / "bf16.ckpt").read_bytes()
    assert b"BFloat16" in raw
    loaded = load_mindspore_ckpt(tmp_path / "bf16.ckpt")
    for key, tensor in tensors.items():
        assert loaded[key].dtype == torch.bfloat16 and torch.equal(loaded[key], tensor)
    # bf16 bit patterns, decoded independently as uint16.
    assert np.array_equal(_raw_values(tmp_path / "bf16.ckpt", KEY, np.uint16, 128),
                          tensors[KEY].view(torch.int16).numpy().view(np.uint16).ravel())
    assert read_lora(tmp_path / "bf16.ckpt").modules[KEY.removesuffix(".lora_down.weight")].scale == 0.5


def test_truncated_checkpoint_names_the_file(tmp_path):
    data = (MINDSPORE_DIR / "mindspore_lora_fp32.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"cut\.ckpt: not a readable MindSpore checkpoint \(truncated"):
        load_mindspore_ckpt(tmp_path / "cut.ckpt")
