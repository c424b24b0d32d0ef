"""The layer shapes of the released FLUX.1-dev and SDXL base 1.0 that ``lora info`` reads from a table
shipped with the package are those of the models built on the meta device from the published configs."""

from __future__ import annotations

import pytest

from dreamstep.models.full_size import built_released_shapes, weight_shapes


@pytest.mark.parametrize("model, layers, example", [
    ("flux", 744, ("transformer.transformer_blocks.0.attn.to_q", (3072, 3072))),
    ("sdxl", 1059, ("unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k", (640, 2048))),
])
def test_the_shipped_table_is_the_meta_build(model: str, layers: int, example: tuple) -> None:
    shipped = weight_shapes(model)
    assert shipped == built_released_shapes(model)
    assert len(shipped) == layers and shipped[example[0]] == example[1]
