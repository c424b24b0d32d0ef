"""sd-scripts' ``networks.lora_flux`` on diffusers' FLUX: a fused BFL module's LoRA adds to each diffusers part the
rows the fused Linear's would; ``split_qkv`` keeps a LoRA per part and saves them as sd-scripts does; the
``--network_args`` choose modules and ranks as sd-scripts does; at FLUX.1-dev's full size (meta device) every key
loads in ComfyUI's and sd-scripts' key rules with the shape of the weight it names."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights
from diffusers import FluxTransformer2DModel
from loader_rules import comfy_flux_key_map, comfy_load, sd_scripts_load
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from dreamstep.config.flux_network_args import FluxNetworkOptions
from dreamstep.errors import UserError
from dreamstep.lora.kohya_flux_network import create_flux_network
from dreamstep.models.flux.lora_keys import FLUX_DOUBLE_BLOCK, FLUX_SINGLE_BLOCK
from dreamstep.models.flux.tiny import build_tiny_flux
from dreamstep.models.published_configs import CLIP_L_TEXT, T5_XXL_ENCODER


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_flux(seed=0, guidance_embeds=True)


def _randomize(network: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in network.named_parameters():
            if "lora_up" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _part_deltas(transformer, names: tuple[str, ...], x: torch.Tensor, network) -> list[torch.Tensor]:
    """What the network adds to each diffusers part's output, all parts fed the same input tensor."""
    parts = [transformer.get_submodule(n) for n in names]
    with torch.no_grad():
        with_lora = [p(x) for p in parts]
        network.detach()
        try:
            plain = [p(x) for p in parts]
        finally:
            network.attach()
    return [a - b for a, b in zip(with_lora, plain)]


@pytest.mark.parametrize(("bfl", "parts"), [("double_blocks_0_img_attn_qkv", FLUX_DOUBLE_BLOCK["img_attn.qkv"]),
                                            ("single_blocks_0_linear1", FLUX_SINGLE_BLOCK["linear1"])])
def test_a_fused_module_adds_its_rows_to_each_diffusers_part(tiny, bfl: str, parts: tuple[str, ...]) -> None:
    transformer = tiny.transformer
    network = create_flux_network(transformer, None, FluxNetworkOptions(dim=4, alpha=2.0))
    try:
        _randomize(network)
        state = network.state_dict()
        down, up = state[f"lora_unet_{bfl}.lora_down.weight"], state[f"lora_unet_{bfl}.lora_up.weight"]
        prefix = ("transformer_blocks.0." if bfl.startswith("double") else "single_transformer_blocks.0.")
        x = torch.randn(2, 5, down.shape[1])
        fused = x @ down.T @ up.T * (2.0 / 4)  # the BFL Linear's LoRA: (B, T, Σ rows)
        got = torch.cat(_part_deltas(transformer, tuple(prefix + p for p in parts), x, network), dim=-1)
        torch.testing.assert_close(got, fused, rtol=1e-5, atol=1e-6)
    finally:
        network.detach()


def test_split_qkv_trains_a_lora_per_part_and_saves_sd_scripts_merged_layout(tiny) -> None:
    transformer = tiny.transformer
    network = create_flux_network(transformer, None, FluxNetworkOptions(dim=4, alpha=2.0, split_qkv=True))
    try:
        _randomize(network)
        module = network.loras["lora_unet_double_blocks_0_img_attn_qkv"]
        state = network.state_dict()
        down = state["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"]
        up = state["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"]
        hidden = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        assert down.shape == (12, hidden) and up.shape == (3 * hidden, 12)
        # sd-scripts' merged form: downs stacked, ups block-diagonal, one alpha (the per-part scale alpha / dim).
        for i, part in enumerate(module.parts):
            torch.testing.assert_close(down[4 * i:4 * i + 4], part.lora_down.weight)
            torch.testing.assert_close(up[hidden * i:hidden * (i + 1), 4 * i:4 * i + 4], part.lora_up.weight)
            assert not up[hidden * i:hidden * (i + 1)].index_fill(1, torch.arange(4 * i, 4 * i + 4), 0).any()
        x = torch.randn(2, 5, hidden)
        prefixed = [f"transformer_blocks.0.{p}" for p in FLUX_DOUBLE_BLOCK["img_attn.qkv"]]
        deltas = _part_deltas(transformer, tuple(prefixed), x, network)
        torch.testing.assert_close(torch.cat(deltas, -1), x @ down.T @ up.T * 0.5, rtol=1e-5, atol=1e-6)
        # The file reads back into the parts exactly.
        again = create_flux_network(transformer, None, FluxNetworkOptions(dim=4, alpha=2.0, split_qkv=True))
        again.load_state_dict(state)
        for key, value in again.state_dict().items():
            torch.testing.assert_close(value, state[key])
        again.detach()
    finally:
        network.detach()


def test_network_args_choose_modules_and_ranks_as_sd_scripts(tiny) -> None:
    def names(*args: str) -> dict[str, int]:
        options, _ = FluxNetworkOptions.from_flags(4, 1.0, None, args)
        network = create_flux_network(tiny.transformer, None, options)
        network.detach()
        return {k.removesuffix(".lora_down.weight"): v.shape[0] for k, v in network.state_dict().items()
                if k.endswith("lora_down.weight")}

    default = names()
    assert len(default) == 10 + 3  # the tiny model: 1 double and 1 single block
    assert all(k.startswith("lora_unet_single") for k in names("train_blocks=single"))
    assert all(k.startswith("lora_unet_double") for k in names("train_blocks=double"))
    ranks = names("img_attn_dim=8", "txt_mod_dim=0", "single_dim=2")
    assert ranks["lora_unet_double_blocks_0_img_attn_qkv"] == ranks["lora_unet_double_blocks_0_img_attn_proj"] == 8
    assert not any("txt_mod" in k for k in ranks)
    assert ranks["lora_unet_single_blocks_0_linear1"] == 2 and ranks["lora_unet_single_blocks_0_modulation_lin"] == 4
    chosen = names("train_double_block_indices=0", "train_single_block_indices=none")
    assert chosen and all(k.startswith("lora_unet_double_blocks_0_") for k in chosen)
    assert names("train_double_block_indices=none", "train_single_block_indices=all").keys() == {
        k for k in default if "single" in k}
    with_inputs = names("in_dims=[3,0,0,2,5]")
    assert with_inputs["lora_unet_img_in"] == 3 and with_inputs["lora_unet_txt_in"] == 5
    assert with_inputs["lora_unet_guidance_in_in_layer"] == 2 and "lora_unet_time_in_in_layer" not in with_inputs


@pytest.mark.parametrize(("args", "message"), [
    (["train_t5xxl=yes"], "train_t5xxl=yes: give True or False"),
    (["ggpo_beta=0.01"], "'ggpo_beta' (LoRA-GGPO) is an sd-scripts option dreamstep does not support"),
    (["train_block=single"], "unknown key 'train_block' (did you mean 'train_blocks'?)"),
    (["train_blocks=some"], "train_blocks=some: use all, single or double"),
    (["split_qkv=yes"], "split_qkv=yes: give True or False"),
    (["in_dims=[4,4]"], "in_dims=[4,4]: give five ranks"),
    (["train_double_block_indices=3-x"], "'3-x' is not a block index or range"),
    (["loraplus_lr_ratio=-2"], "loraplus_lr_ratio must be positive"),
])
def test_bad_network_args_get_one_line(args: list[str], message: str) -> None:
    with pytest.raises(UserError) as error:
        FluxNetworkOptions.from_flags(4, 1.0, None, args)
    assert message in str(error.value) and str(error.value).startswith("--network_args")


def test_block_indices_outside_the_model_are_named(tiny) -> None:
    options, _ = FluxNetworkOptions.from_flags(4, 1.0, None, ["train_single_block_indices=0-5"])
    with pytest.raises(UserError, match="'0-5' is outside blocks 0-0"):
        create_flux_network(tiny.transformer, None, options)


def test_loraplus_gives_the_up_weights_their_ratio(tiny) -> None:
    options, _ = FluxNetworkOptions.from_flags(4, 1.0, None, ["loraplus_lr_ratio=16"])
    network = create_flux_network(tiny.transformer, tiny.text_encoder, options)
    network.detach()
    groups = network.param_groups(1e-4, 5e-5, (options.loraplus_unet, options.loraplus_text_encoder))
    assert [g["lr"] for g in groups] == [1e-4, 16e-4, 5e-5, 80e-5]
    ups = {id(p) for n, p in network.named_parameters() if "lora_up" in n}
    assert all(id(p) in ups for g in groups[1::2] for p in g["params"])
    assert not any(id(p) in ups for g in groups[0::2] for p in g["params"])


@pytest.mark.parametrize("args", [[], ["split_qkv=True"], ["train_blocks=single", "single_mod_dim=0"],
                                  ["in_dims=[4,4,4,4,4]"]])
def test_full_size_files_load_whole_in_comfyui_and_sd_scripts(args: list[str]) -> None:
    with init_empty_weights():
        transformer = FluxTransformer2DModel(guidance_embeds=True)  # diffusers' defaults: FLUX.1's shapes
        clip = CLIPTextModel(CLIPTextConfig(**CLIP_L_TEXT))
    options, _ = FluxNetworkOptions.from_flags(16, 8.0, None, args)
    network = create_flux_network(transformer, clip, options)
    network.detach()
    # On the meta device alpha has no value: each module's own (scale x rank) stands in for it.
    tensors = {k: torch.tensor(_alpha_of(network, k.removesuffix(".alpha"))) if k.endswith(".alpha") else v
               for k, v in network.state_dict().items()}
    key_map = comfy_flux_key_map()
    patches, not_loaded = comfy_load(tensors, key_map)
    assert not_loaded == [] and len(patches) == len(tensors) // 3
    bfl = _bfl_shapes(transformer)
    for patch in patches:
        rows, columns = bfl.get(patch.target.weight) or _clip_shape(clip, patch.target.weight)
        weight = patch.target.weight
        rank = 4 if "_blocks." not in weight and not weight.startswith("clip_l") else 16  # in_dims: 4
        if "split_qkv=True" in args and weight.endswith(("qkv", "linear1")):
            rank *= 3 if weight.endswith("qkv") else 4  # a rank per part, stacked
        assert patch.up.shape == (rows, rank) and patch.down.shape == (rank, columns), patch.target.weight
        # Every loader reads alpha / stored rank; a split module stores parts x rank, so it loads at 1/3 (qkv) or
        # 1/4 (linear1) of the scale it trained with, in sd-scripts' own loader too: sd-scripts' format, kept.
        assert patch.scale == 8.0 / rank
    sd_scripts_names = {k: t for k, t in key_map.items() if k.startswith(("lora_unet_", "lora_te1_"))}
    patches, unknown = sd_scripts_load(tensors, sd_scripts_names)
    assert unknown == [] and len(patches) == len(tensors) // 3


def _alpha_of(network, name: str) -> float:
    module = network.loras[name]
    module = module.parts[0] if hasattr(module, "parts") else module
    return module.scale * module.dim


def _bfl_shapes(transformer) -> dict[str, tuple[int, int]]:
    """BFL weight -> (rows, columns), from the diffusers parts each is made of."""
    from dreamstep.models.flux.lora_keys import FLUX_GLOBAL, FLUX_GUIDANCE

    shapes = {}
    for kind, ours, table, count in (("double_blocks", "transformer_blocks", FLUX_DOUBLE_BLOCK, 19),
                                     ("single_blocks", "single_transformer_blocks", FLUX_SINGLE_BLOCK, 38)):
        for i in range(count):
            for bfl, parts in table.items():
                layers = [transformer.get_submodule(f"{ours}.{i}.{p}") for p in parts]
                shapes[f"{kind}.{i}.{bfl}"] = (sum(x.out_features for x in layers), layers[0].in_features)
    for bfl, ours in {**FLUX_GLOBAL, **FLUX_GUIDANCE}.items():
        layer = transformer.get_submodule(ours)
        shapes[bfl] = (layer.out_features, layer.in_features)
    return shapes


def _clip_shape(clip, weight: str) -> tuple[int, int]:
    path = weight.removeprefix("clip_l.transformer.")
    try:
        layer = clip.get_submodule(path)
    except AttributeError:
        layer = clip.get_submodule(path.removeprefix("text_model."))
    return layer.out_features, layer.in_features


@pytest.mark.parametrize("args", [[], ["split_qkv=True"]])
def test_full_size_files_map_whole_in_diffusers_kohya_reader(args: list[str]) -> None:
    """diffusers' FluxPipeline.load_lora_weights reads sd-scripts' FLUX files through this converter, which splits a
    single block's linear1 by FLUX.1's widths: at full size every key lands on a module of its shape."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    with init_empty_weights():
        transformer = FluxTransformer2DModel(guidance_embeds=True)
        clip = CLIPTextModel(CLIPTextConfig(**CLIP_L_TEXT))
    options, _ = FluxNetworkOptions.from_flags(16, 8.0, None, args)
    network = create_flux_network(transformer, clip, options)
    network.detach()
    file = {k: torch.tensor(8.0) if k.endswith(".alpha") else torch.zeros(v.shape)
            for k, v in network.state_dict().items()}
    read = _convert_kohya_flux_lora_to_diffusers(dict(file))
    modules = {f"transformer.{n}": m for n, m in transformer.named_modules()}
    for key, value in read.items():
        if key.startswith("text_encoder."):  # CLIP-L, in diffusers' older text-encoder names (to_q_lora.down ...)
            continue
        module = modules[key.rsplit(".lora_", 1)[0]]
        if key.endswith("lora_A.weight"):
            assert value.shape[1] == module.in_features, key
        else:
            assert value.shape[0] == module.out_features, key
    # Every diffusers part of every module the file holds: q, k, v (and proj_mlp) of each fused one; CLIP-L's 72.
    assert len(read) == 2 * (len(file) // 3 + 19 * 2 * 2 + 38 * 3)
    assert sum(k.startswith("text_encoder.") for k in read) == 2 * 12 * 6


def test_train_t5xxl_file_loads_whole_in_comfyui_and_sd_scripts_not_in_diffusers_reader() -> None:
    # train_t5xxl=True at T5-XXL's full size (meta): sd-scripts' lora_te3_ names, every key mapped by ComfyUI's
    # rule onto the T5 weight of its shape, and by sd-scripts' loader names.
    with init_empty_weights():
        clip = CLIPTextModel(CLIPTextConfig(**CLIP_L_TEXT))
        t5 = T5EncoderModel(T5Config(**T5_XXL_ENCODER))
    options, _ = FluxNetworkOptions.from_flags(16, 8.0, None, ["train_t5xxl=True"])
    network = create_flux_network(None, clip, options, t5)
    network.detach()
    tensors = {k: torch.tensor(8.0) if k.endswith(".alpha") else v for k, v in network.state_dict().items()}
    t5_names = {k.removesuffix(".alpha") for k in tensors if k.startswith("lora_te3_") and k.endswith(".alpha")}
    assert len(t5_names) == 24 * 7 and "lora_te3_encoder_block_23_layer_1_DenseReluDense_wi_1" in t5_names
    key_map = comfy_flux_key_map()
    patches, not_loaded = comfy_load(tensors, key_map)
    assert not_loaded == [] and len(patches) == len(tensors) // 3
    for patch in (p for p in patches if p.target.weight.startswith("t5xxl.")):
        layer = t5.get_submodule(patch.target.weight.removeprefix("t5xxl.transformer."))
        assert patch.up.shape == (layer.out_features, 16) and patch.down.shape == (16, layer.in_features)
        assert patch.scale == 0.5
    sd_scripts_names = {k: t for k, t in key_map.items() if k.startswith(("lora_te1_", "lora_te3_"))}
    patches, unknown = sd_scripts_load(tensors, sd_scripts_names)
    assert unknown == [] and len(patches) == len(tensors) // 3
    # diffusers 0.42's Kohya FLUX reader (FluxPipeline.load_lora_weights) converts lora_te1_ only: it reads the
    # rest of such a file and leaves the lora_te3_ keys out (T5's LoRA does not load in diffusers).
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    read = _convert_kohya_flux_lora_to_diffusers({k: torch.zeros(v.shape) for k, v in tensors.items()})
    assert all(k.startswith("text_encoder.") for k in read) and len(read) == 2 * 12 * 6
