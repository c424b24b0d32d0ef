"""A refused command leaves nothing behind. Every trainer meets bad input that is only found by reading something
(a corrupt image, a caption that is not UTF-8, a dataset TOML's key or value, a file given as weights or a
checkpoint, a model, ControlNet or evaluator folder that is not one, an edit-pair table, sample prompts, a class
folder, a folder that holds another run or cannot be made), and so do generate, eval, convert lora, caption,
tiny-model and dataset from-hf: each must end in one line naming the flag, file or key, and every folder the
command could write (--output_dir, the caches, logs, the data folders) must be as it was: not made when it was
missing, byte for byte the same when it was there. A case a trainer has no input for is skipped."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT
from safetensors.torch import save_file
from test_option_contract import TRAINERS, _recipe, _smallest_run, dataset_toml

from dreamstep.cli import main
from dreamstep.config.schema import build_config
from dreamstep.errors import UserError

KOHYA = ("flux-kohya", "sdxl-lora")  # sd-scripts' flags: a dataset TOML and --resume
DATA_FLAGS = ("instance_data_dir", "train_data_dir", "conditioning_data_dir")


@pytest.fixture(scope="module")
def runs(tiny_flux_dev_dir: Path, tiny_sdxl_dir: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, str]]:
    """The options of each trainer's one-step run, its tiny model built once for the module."""
    made: dict[str, dict[str, str]] = {}

    def run(trainer: str) -> dict[str, str]:
        if trainer not in made:
            root = tmp_path_factory.mktemp(f"models-{trainer}")
            made[trainer] = _smallest_run(trainer, {"flux": tiny_flux_dev_dir, "sdxl": tiny_sdxl_dir}, root)
        return dict(made[trainer])

    return run


@pytest.fixture(scope="module")
def flux_checkpoint(runs: Callable[[str], dict[str, str]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint-1 folder of a one-step flux-lora run."""
    out = tmp_path_factory.mktemp("flux-lora-run") / "out"
    options_class, recipe = _recipe("flux-lora")
    recipe.train(build_config(options_class, {**runs("flux-lora"), "output_dir": str(out), "checkpointing_steps": "1"}))
    return out / "checkpoint-1"


def _fields(trainer: str) -> set[str]:
    return set(_recipe(trainer)[0].__dataclass_fields__)


def _data_copy(work: Path) -> Path:
    data = work / "data"
    shutil.copytree(ROBOT_DIR, data)
    for image in data.glob("*.png"):
        image.with_suffix(".txt").write_text(ROBOT_PROMPT)
    return data


def _with_data(trainer: str, values: dict[str, str], work: Path, data: Path, extra: str = "") -> dict[str, str]:
    """``values`` training on ``data``: its data flags, or (sd-scripts' trainers) a dataset TOML naming it."""
    if trainer in KOHYA:
        return {**values, "dataset_config": str(dataset_toml(work, data, "caption_extension = '.txt'\n" + extra))}
    return {**values, **{flag: str(data) for flag in DATA_FLAGS if flag in values}}


def _toml_run(trainer: str, values: dict[str, str], work: Path, image_dir: Path, extra: str = "") -> dict[str, str]:
    """``values`` with a dataset TOML in place of the data flags."""
    kept = {k: v for k, v in values.items() if k not in (*DATA_FLAGS, "instance_prompt", "default_caption")}
    conditioning = "conditioning_data_dir" in values
    return {**kept, "dataset_config": str(dataset_toml(work, image_dir, extra, conditioning))}


# Each case: (trainer, its one-step options, a scratch folder) -> (the bad options, what the line must name), or
# None where the trainer has no such input.
Case = Callable[[str, dict[str, str], Path], "tuple[dict[str, str], str] | None"]


def corrupt_image(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str]:
    data = _data_copy(work)
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    (data / "broken.txt").write_text(ROBOT_PROMPT)
    return _with_data(trainer, values, work, data), "broken.png"


def empty_data(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str]:
    data = work / "data"
    data.mkdir()
    return _with_data(trainer, values, work, data), "data"


def caption_not_utf8(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str]:
    data = _data_copy(work)
    (data / "robot_1.txt").write_bytes(b"a photo of \xff\xfe robot")
    return _with_data(trainer, values, work, data), "robot_1.txt"


def toml_bad_key(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str]:
    return _toml_run(trainer, values, work, _data_copy(work), "no_such_key = 3\n"), "no_such_key"


def toml_missing_subset(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str]:
    return _toml_run(trainer, values, work, work / "missing_folder"), "missing_folder"


def model_of_another_family(trainer: str, values: dict[str, str], work: Path,
                            models: dict[str, Path]) -> tuple[dict[str, str], str]:
    other = models["flux"] if trainer == "sdxl-lora" else models["sdxl"]
    return {**values, "pretrained_model_name_or_path": str(other)}, "pretrained_model_name_or_path"


def output_holds_another_run(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str]:
    out = Path(values["output_dir"])
    out.mkdir()
    (out / "run_status.json").write_text('{"state": "finished", "step": 5}')
    (out / "pytorch_lora_weights.safetensors").write_bytes(b"weights of another run")
    return values, "--output_dir"


def resume_not_a_checkpoint(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str]:
    folder = work / "not-a-checkpoint"
    folder.mkdir()
    (folder / "notes.txt").write_text("holiday photos")
    flag = "resume" if trainer in KOHYA else "resume_from_checkpoint"
    return {**values, flag: str(folder)}, "not-a-checkpoint"


def corrupt_weights(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "network_weights" not in _fields(trainer):
        return None
    weights = work / "broken.safetensors"
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    return {**values, "network_weights": str(weights)}, "broken.safetensors"


def weights_of_another_family(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "network_weights" not in _fields(trainer):
        return None
    module = ("lora_unet_double_blocks_0_img_attn_qkv" if trainer == "sdxl-lora"
              else "lora_unet_down_blocks_1_attentions_0_proj_in")
    weights = work / "other-family.safetensors"
    save_file({f"{module}.lora_down.weight": torch.zeros(4, 16), f"{module}.lora_up.weight": torch.zeros(16, 4),
               f"{module}.alpha": torch.tensor(4.0)}, str(weights))
    return {**values, "network_weights": str(weights)}, "other-family.safetensors"


def validation_image_missing(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "validation_image" not in _fields(trainer):
        return None
    return ({**values, "validation_prompt": ROBOT_PROMPT, "validation_image": str(work / "no-such-image.png")},
            "no-such-image.png")


def _sample_prompts(trainer: str, values: dict[str, str], work: Path,
                    content: bytes) -> tuple[dict[str, str], str] | None:
    """``values`` sampling every step from a prompt file holding ``content``, for a trainer that takes one."""
    if "sample_prompts" not in _fields(trainer):
        return None
    prompts = work / "prompts.txt"
    prompts.write_bytes(content)
    return {**values, "sample_prompts": str(prompts), "sample_every_n_steps": "1"}, "prompts.txt"


def sample_prompts_bad(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    return _sample_prompts(trainer, values, work, b"a photo of sks robot --w 32 --h 32 --s 0\n")


def sample_prompts_not_utf8(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    return _sample_prompts(trainer, values, work, "a photo of sks robot --s 2\n".encode("utf-16"))


def class_images_corrupt(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "class_data_dir" not in _fields(trainer):
        return None
    classes = work / "class"
    classes.mkdir()
    shutil.copy(ROBOT_DIR / "robot_0.png", classes / "a.png")
    (classes / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    return ({**values, "with_prior_preservation": "true", "class_data_dir": str(classes), "class_prompt": "a robot",
             "num_class_images": "2"}, "b.png")


def class_dir_is_a_file(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "class_data_dir" not in _fields(trainer):
        return None
    (work / "class").write_text("not a folder")
    return ({**values, "with_prior_preservation": "true", "class_data_dir": str(work / "class"),
             "class_prompt": "a robot", "num_class_images": "2"}, "class_data_dir")


def output_and_cache_there(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str]:
    """Empty --output_dir and --cache_dir folders made beforehand, and a corrupt image: both stay as they were."""
    Path(values["output_dir"]).mkdir()
    if "cache_dir" in values:
        Path(values["cache_dir"]).mkdir()
    return corrupt_image(trainer, values, work)


def evaluator_not_a_model(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "dino_model" not in _fields(trainer):
        return None
    folder = work / "not-dino"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "bert"}')
    given = {**values, "eval_metrics": ["dino"], "dino_model": str(folder), "validation_prompt": ROBOT_PROMPT}
    if "validation_image" in _fields(trainer):
        given["validation_image"] = str(ROBOT_DIR / "robot_0.png")
    if "sample_prompts" in _fields(trainer):
        (work / "prompts.txt").write_text(f"{ROBOT_PROMPT} --w 32 --h 32 --s 2\n")
        given |= {"sample_prompts": str(work / "prompts.txt"), "sample_every_n_steps": "1"}
        del given["validation_prompt"]
    return given, "not-dino"


def validation_data_corrupt(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "validation_data_dir" not in _fields(trainer):
        return None
    held_out = work / "held-out"
    shutil.copytree(ROBOT_DIR, held_out)
    (held_out / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    return {**values, "validation_data_dir": str(held_out), "validation_prompt": ROBOT_PROMPT}, "broken.png"


def regularization_corrupt(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if trainer not in KOHYA:
        return None
    data = _data_copy(work)
    regularization = work / "reg"
    regularization.mkdir()
    (regularization / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    extra = (f"\n  [[datasets.subsets]]\nimage_dir = '{regularization.as_posix()}'\nclass_tokens = 'robot'\n"
             "is_reg = true\n")
    return _with_data(trainer, values, work, data, extra), "broken.png"


def metadata_not_json(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if trainer not in KOHYA:
        return None
    (work / "meta.json").write_text("{not json")
    toml = work / "dataset.toml"
    toml.write_text("[general]\nenable_bucket = false\n\n[[datasets]]\nresolution = 32\nbatch_size = 1\n\n"
                    f"  [[datasets.subsets]]\nimage_dir = '{_data_copy(work).as_posix()}'\n"
                    f"metadata_file = '{(work / 'meta.json').as_posix()}'\n")
    return {**values, "dataset_config": str(toml)}, "meta.json"


def network_args_bad(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "network_args" not in _fields(trainer):
        return None
    return {**values, "network_args": ["no_such_arg=1"]}, "no_such_arg"


def controlnet_not_a_model(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "controlnet_model_name_or_path" not in _fields(trainer):
        return None
    folder = work / "not-a-controlnet"
    folder.mkdir()
    (folder / "config.json").write_text("{broken")
    return {**values, "controlnet_model_name_or_path": str(folder)}, "not-a-controlnet"


def controlnet_of_another_base(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    """A ControlNet folder whose config is another width's (the published FLUX.1's)."""
    if "controlnet_model_name_or_path" not in _fields(trainer):
        return None
    folder = work / "big-controlnet"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "_class_name": "FluxControlNetModel", "in_channels": 64, "attention_head_dim": 128, "num_attention_heads": 24,
        "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True, "num_layers": 2,
        "num_single_layers": 0}))
    return {**values, "controlnet_model_name_or_path": str(folder)}, "attention_head_dim"


def controlnet_without_weights(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    """A ControlNet folder whose config fits the base but holds no weights."""
    if "controlnet_model_name_or_path" not in _fields(trainer):
        return None
    config = json.loads((Path(values["pretrained_model_name_or_path"]) / "transformer" / "config.json").read_text())
    folder = work / "empty-controlnet"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, "_class_name": "FluxControlNetModel"}))
    return {**values, "controlnet_model_name_or_path": str(folder)}, "empty-controlnet"


def validation_model_of_another_family(trainer: str, values: dict[str, str], work: Path,
                                       models: dict[str, Path]) -> tuple[dict[str, str], str] | None:
    if "validation_model_path" not in _fields(trainer):
        return None
    return ({**values, "validation_model_path": str(models["sdxl"]), "validation_prompt": ROBOT_PROMPT},
            "validation_model_path")


def lora_layers_unknown(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "lora_layers" not in _fields(trainer):
        return None
    return {**values, "lora_layers": "no_such_module"}, "no_such_module"


def checkpoint_of_nothing(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str]:
    """A ``checkpoint-3`` folder whose files are not a checkpoint's."""
    folder = work / "old-run" / "checkpoint-3"
    folder.mkdir(parents=True)
    for name in ("pytorch_lora_weights.safetensors", "model.safetensors", "optimizer.bin"):
        (folder / name).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    flag = "resume" if trainer in KOHYA else "resume_from_checkpoint"
    return {**values, flag: str(folder)}, "checkpoint-3"


def validation_image_corrupt(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "validation_image" not in _fields(trainer):
        return None
    (work / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    return {**values, "validation_prompt": ROBOT_PROMPT, "validation_image": str(work / "broken.png")}, "broken.png"


def toml_bad_value(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str]:
    return _toml_run(trainer, values, work, _data_copy(work), "num_repeats = -2\n"), "num_repeats"


def jsonl_corrupt(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "jsonl_for_train" not in _fields(trainer):
        return None
    (work / "train.jsonl").write_text('{"image": "robot_0.png", "text": \n')
    kept = {k: v for k, v in values.items() if k not in ("train_data_dir", "conditioning_data_dir")}
    return {**kept, "jsonl_for_train": str(work / "train.jsonl")}, "train.jsonl"


def base_file_corrupt(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    flag = next((f for f in ("transformer_single_file", "ae", "clip_l") if f in _fields(trainer)), None)
    if flag is None:
        return None
    (work / "base.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    return {**values, flag: str(work / "base.safetensors")}, "base.safetensors"


def sample_prompts_options_only(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    return _sample_prompts(trainer, values, work, b"--w 32 --h 32 --l nan\n")


def checkpoint_of_another_trainer(trainer: str, values: dict[str, str], work: Path,
                                  checkpoint: Path) -> tuple[dict[str, str], str] | None:
    """flux-lora's checkpoint given to another trainer to continue (flux-kontext-lora here trains the same tiny base
    with the same LoRA layout and settings, so continuing is allowed)."""
    if trainer in ("flux-lora", "flux-kontext-lora"):
        return None
    flag = "resume" if trainer in KOHYA else "resume_from_checkpoint"
    return {**values, flag: str(checkpoint)}, "checkpoint-1"


def logging_dir_is_a_file(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "logging_dir" not in _fields(trainer):
        return None
    (work / "logs").write_text("not a folder")
    return {**values, "logging_dir": str(work / "logs"), "log_with": "tensorboard"}, "logging_dir"


def output_dir_under_a_file(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str]:
    (work / "runs").write_text("not a folder")
    return {**values, "output_dir": str(work / "runs" / "out")}, "--output_dir"


def validation_data_empty(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    if "validation_data_dir" not in _fields(trainer):
        return None
    (work / "held-out").mkdir()
    return {**values, "validation_data_dir": str(work / "held-out"), "validation_prompt": ROBOT_PROMPT}, "held-out"


def _edit_table(trainer: str, values: dict[str, str], work: Path, rows: list[dict[str, str]]) -> dict[str, str] | None:
    """``values`` training on a metadata table of edit pairs (``--dataset_name``) holding ``rows``."""
    if "dataset_name" not in _fields(trainer):
        return None
    data = _data_copy(work)
    table = data / "pairs.jsonl"
    table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    kept = {k: v for k, v in values.items() if k not in (*DATA_FLAGS, "instance_prompt")}
    return {**kept, "dataset_name": str(table), "image_column": "after", "cond_image_column": "before",
            "caption_column": "edit"}


def edit_table_empty(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    given = _edit_table(trainer, values, work, [])
    return None if given is None else (given, "pairs.jsonl")


def edit_table_corrupt_image(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str] | None:
    rows = [{"after": f"robot_{i}.png", "before": f"robot_{i + 1}.png", "edit": "make it red"} for i in range(3)]
    given = _edit_table(trainer, values, work, [*rows, {"after": "broken.png", "before": "robot_0.png",
                                                       "edit": "make it blue"}])
    if given is None:
        return None
    (work / "data" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    return given, "broken.png"


def overwrite_then_corrupt_image(trainer: str, values: dict[str, str], work: Path) -> tuple[dict[str, str], str]:
    """--overwrite_output_dir over a finished run, and a corrupt image: the old run stays as it was."""
    output_holds_another_run(trainer, values, work)
    given, named = corrupt_image(trainer, values, work)
    return {**given, "overwrite_output_dir": "true"}, named


CASES: list[Case] = [corrupt_image, empty_data, caption_not_utf8, toml_bad_key, toml_missing_subset,
                     model_of_another_family, output_holds_another_run, resume_not_a_checkpoint, corrupt_weights,
                     weights_of_another_family, validation_image_missing, sample_prompts_bad, sample_prompts_not_utf8,
                     class_images_corrupt, class_dir_is_a_file, output_and_cache_there, evaluator_not_a_model,
                     validation_data_corrupt, regularization_corrupt, metadata_not_json, network_args_bad,
                     controlnet_not_a_model, controlnet_of_another_base, controlnet_without_weights,
                     validation_model_of_another_family, lora_layers_unknown,
                     checkpoint_of_nothing, validation_image_corrupt, toml_bad_value, jsonl_corrupt,
                     base_file_corrupt, sample_prompts_options_only, checkpoint_of_another_trainer,
                     logging_dir_is_a_file, output_dir_under_a_file, validation_data_empty, edit_table_empty,
                     edit_table_corrupt_image, overwrite_then_corrupt_image]


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root``: a file's bytes, ``None`` for a folder."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _bad_run(case: Case, trainer: str, values: dict[str, str], work: Path, models: dict[str, Path],
             request: pytest.FixtureRequest) -> tuple[dict[str, str], str] | None:
    if case is checkpoint_of_another_trainer:
        return case(trainer, values, work, request.getfixturevalue("flux_checkpoint"))
    if case in (model_of_another_family, validation_model_of_another_family):
        return case(trainer, values, work, models)
    return case(trainer, values, work)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_refused_run_writes_nothing(trainer: str, case: Case, runs: Callable[[str], dict[str, str]],
                                      tiny_flux_dev_dir: Path, tiny_sdxl_dir: Path, tmp_path: Path,
                                      request: pytest.FixtureRequest) -> None:
    work = tmp_path / "work"
    work.mkdir()
    values = {**runs(trainer), "output_dir": str(work / "out")}
    if "cache_dir" in _fields(trainer):
        values["cache_dir"] = str(work / "cache")
    bad = _bad_run(case, trainer, values, work, {"flux": tiny_flux_dev_dir, "sdxl": tiny_sdxl_dir}, request)
    if bad is None:
        pytest.skip(f"train {trainer} has no such input")
    given, named = bad
    before = _snapshot(work)
    options_class, recipe = _recipe(trainer)
    with pytest.raises(UserError) as refused:
        recipe.train(build_config(options_class, given))
    message = str(refused.value)
    assert "\n" not in message and named in message, message
    after = _snapshot(work)
    assert sorted(set(after) - set(before)) == [], f"written before refusing: {message}"
    changed = sorted(path for path in before if after.get(path, b"gone") != before[path])
    assert changed == [], f"changed before refusing: {message}"


def _lora_files(work: Path) -> tuple[Path, Path]:
    """A corrupt LoRA file and an SDXL LoRA (for a FLUX command)."""
    corrupt_weights("flux-lora", {}, work)
    weights_of_another_family("flux-lora", {}, work)
    return work / "broken.safetensors", work / "other-family.safetensors"


def _flux_lora(work: Path, flux: Path) -> Path:
    """A diffusers-layout LoRA of one attention projection of the tiny FLUX.1 ``flux`` (zero: changes nothing)."""
    config = json.loads((flux / "transformer" / "config.json").read_text())
    width = config["num_attention_heads"] * config["attention_head_dim"]
    module = "transformer.single_transformer_blocks.0.attn.to_q"
    path = work / "flux-lora.safetensors"
    save_file({f"{module}.lora_A.weight": torch.zeros(2, width), f"{module}.lora_B.weight": torch.zeros(width, 2)},
              str(path))
    return path


@pytest.fixture(scope="module")
def tiny_blip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dreamstep.captioning.tiny import write_tiny_blip

    return write_tiny_blip(tmp_path_factory.mktemp("captioner") / "blip")


def _command_cases(work: Path, flux: Path, sdxl: Path, blip: Path,
                   evaluators: dict[str, Path]) -> dict[str, tuple[list[object], str]]:
    """The other commands that write: their arguments and what the refusal must name."""
    broken, other = _lora_files(work)
    lora = _flux_lora(work, flux)
    images = _data_copy(work)
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    (work / "prompts.txt").write_bytes(b"a photo of \xff\xfe robot\n")
    not_a_model = work / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "config.json").write_text("{broken")
    (work / "table.parquet").write_bytes(b"PAR1 not a parquet table")
    taken = work / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("someone's notes")
    shutil.copy(ROBOT_DIR / "robot_0.png", work / "good.png")
    (work / "junk.png").write_bytes(b"junk")
    (work / "no-images.csv").write_text("image,text\njunk.png,one\njunk.png,two\n")
    (work / "table.csv").write_text("image,text,note\ngood.png,one,sunny\n")
    captioned = _data_copy(work.parent / "captioned")
    (captioned / "robot_3.txt").unlink()
    (captioned / "robot_3.txt").mkdir()
    (work / "empty.txt").write_text("\n")
    out = work / "out"
    generate = ["generate", "flux", "--model", flux, "--prompt", ROBOT_PROMPT, "--steps", "1", "--width", "32",
                "--output_dir", out]
    evaluate = ["eval", "flux", "--model", flux, "--prompt", ROBOT_PROMPT, "--steps", "1", "--resolution", "32",
                "--output_dir", out]
    return {
        "generate-corrupt-lora": ([*generate, "--lora", broken], "broken.safetensors"),
        "generate-lora-of-another-family": ([*generate, "--lora", other], "other-family.safetensors"),
        "generate-model-of-another-family": ([*generate[:3], sdxl, *generate[4:]], "--model"),
        "generate-prompt-file-not-utf8": ([*generate[:4], "--from_file", work / "prompts.txt", *generate[6:]],
                                          "prompts.txt"),
        "generate-controlnet-not-a-model": ([*generate, "--controlnet", not_a_model, "--control_image",
                                             ROBOT_DIR / "robot_0.png"], "not-a-model"),
        "eval-corrupt-weights": ([*evaluate, "--weights", broken, "--metrics", "clip_t"], "broken.safetensors"),
        "eval-corrupt-reference-image": ([*evaluate, "--weights", lora, "--instance_data_dir", images,
                                          "--metrics", "dino"], "broken.png"),
        "eval-evaluator-not-a-model": ([*evaluate, "--weights", lora, "--metrics", "dino", "--dino_model",
                                        not_a_model, "--instance_data_dir", ROBOT_DIR], "not-a-model"),
        "convert-corrupt-lora": (["convert", "lora", broken, out / "converted.safetensors", "--to", "kohya"],
                                 "broken.safetensors"),
        "convert-lora-of-another-family": (["convert", "lora", other, out / "converted.safetensors", "--to",
                                            "diffusers", "--model", "flux"], "other-family.safetensors"),
        "caption-captioner-not-a-model": (["caption", images, "--model", not_a_model], "not-a-model"),
        "caption-a-caption-path-is-a-folder": (["caption", captioned, "--model", blip,
                                                "--overwrite"], "robot_3.txt"),
        "generate-empty-prompt-file": ([*generate[:4], "--from_file", work / "empty.txt", *generate[6:]],
                                       "empty.txt"),
        "generate-output-under-a-file": ([*generate[:-1], taken / "notes.txt" / "images"], "notes.txt"),
        "eval-output-under-a-file": ([*evaluate[:-1], taken / "notes.txt" / "scores", "--weights", lora, "--metrics",
                                      "clip_t", "--clip_model", evaluators["clip"]], "notes.txt"),
        "convert-output-under-a-file": (["convert", "lora", lora, taken / "notes.txt" / "c.safetensors", "--to",
                                         "kohya"], "notes.txt"),
        "tiny-model-under-a-file": (["tiny-model", "flux", taken / "notes.txt" / "tiny"], "notes.txt"),
        "tiny-model-into-a-taken-folder": (["tiny-model", "flux", taken], "taken"),
        "dataset-from-hf-corrupt-table": (["dataset", "from-hf", work / "table.parquet", "--output_dir", out],
                                          "table.parquet"),
        "dataset-from-hf-no-readable-image": (["dataset", "from-hf", work / "no-images.csv", "--output_dir", out,
                                               "--image_column", "image"], "no-images.csv"),
        "dataset-from-hf-column-without-images": (["dataset", "from-hf", work / "table.csv", "--output_dir", out,
                                                   "--image_column", "note", "--caption_column", "text"],
                                                  "--image_column"),
        "dataset-from-hf-into-a-taken-folder": (["dataset", "from-hf", work / "table.csv", "--output_dir", taken,
                                                 "--image_column", "image"], "taken"),
    }


COMMAND_CASES = ["generate-corrupt-lora", "generate-lora-of-another-family", "generate-model-of-another-family",
                 "generate-prompt-file-not-utf8", "generate-controlnet-not-a-model", "eval-corrupt-weights",
                 "eval-corrupt-reference-image", "eval-evaluator-not-a-model", "convert-corrupt-lora",
                 "convert-lora-of-another-family", "caption-captioner-not-a-model",
                 "caption-a-caption-path-is-a-folder", "tiny-model-into-a-taken-folder",
                 "dataset-from-hf-corrupt-table", "dataset-from-hf-no-readable-image",
                 "dataset-from-hf-column-without-images", "generate-empty-prompt-file", "generate-output-under-a-file",
                 "eval-output-under-a-file", "convert-output-under-a-file",
                 "tiny-model-under-a-file", "dataset-from-hf-into-a-taken-folder"]


@pytest.mark.parametrize("case", COMMAND_CASES)
def test_a_refused_command_writes_nothing(case: str, tiny_flux_dev_dir: Path, tiny_sdxl_dir: Path, tiny_blip: Path,
                                          tiny_evaluators: dict[str, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "work"
    work.mkdir()
    args, named = _command_cases(work, tiny_flux_dev_dir, tiny_sdxl_dir, tiny_blip, tiny_evaluators)[case]
    before = _snapshot(tmp_path)
    code = main([str(a) for a in args])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and named in errors[0] and "Traceback" not in err, err[-2000:]
    after = _snapshot(tmp_path)
    assert sorted(set(after) - set(before)) == [], f"written before refusing: {errors[0]}"
    assert sorted(p for p in before if after.get(p, b"gone") != before[p]) == [], f"changed: {errors[0]}"
