"""Caption processing against hand-computed results."""

import numpy as np

from dreamstep.data.captions import CaptionOptions, process_caption, split_tags


def run(caption, epoch=0, seed=0, **options):
    return process_caption(caption, CaptionOptions(**options), epoch, np.random.default_rng(seed))


def test_plain_caption_unchanged():
    assert run("a dog, red collar") == "a dog, red collar"


def test_prefix_and_suffix_joined_with_space():
    assert run("a dog", caption_prefix="sks", caption_suffix="photo") == "sks a dog photo"


def test_keep_tokens_fixed_and_rest_shuffled():
    caption = "sks, dog, red, blue, green, grass"
    results = {run(caption, seed=s, shuffle_caption=True, keep_tokens=2) for s in range(30)}
    assert len(results) > 1
    for result in results:
        tags = result.split(", ")
        assert tags[:2] == ["sks", "dog"]
        assert sorted(tags[2:]) == ["blue", "grass", "green", "red"]


def test_shuffle_is_reproducible_from_seed():
    caption = "a, b, c, d, e, f"
    assert run(caption, seed=7, shuffle_caption=True) == run(caption, seed=7, shuffle_caption=True)


def test_keep_tokens_separator_prefix_and_suffix():
    options = CaptionOptions(keep_tokens_separator="|||")
    assert split_tags("sks, dog ||| red, blue ||| masterpiece, best", options) == (
        ["sks", "dog"], ["red", "blue"], ["masterpiece", "best"])
    for seed in range(10):
        result = run("sks, dog ||| red, blue, green ||| best", seed=seed, shuffle_caption=True,
                     keep_tokens_separator="|||", keep_tokens=5)
        tags = result.split(", ")
        assert tags[:2] == ["sks", "dog"] and tags[-1] == "best"
        assert sorted(tags[2:-1]) == ["blue", "green", "red"]


def test_separator_never_reaches_the_text_encoder():
    assert run("sks ||| dog, red", keep_tokens_separator="|||") == "sks, dog, red"


def test_tag_dropout_only_drops_flexible_tags():
    assert run("sks, a, b, c", keep_tokens=1, caption_tag_dropout_rate=1.0) == "sks"
    assert run("sks, a, b, c", keep_tokens=1, caption_tag_dropout_rate=0.0) == "sks, a, b, c"
    kept = [len(run("k, " + ", ".join("t" * 40), seed=s, keep_tokens=1, caption_tag_dropout_rate=0.5).split(", "))
            for s in range(20)]
    assert min(kept) >= 1 and 1 < sum(kept) / len(kept) < 41


def test_caption_dropout_whole_caption():
    assert run("sks, dog", caption_prefix="p", caption_dropout_rate=1.0) == ""
    assert run("sks, dog", caption_dropout_every_n_epochs=2, epoch=1) == ""  # epoch 2 (1-based)
    assert run("sks, dog", caption_dropout_every_n_epochs=2, epoch=0) == "sks, dog"
    dropped = sum(run("x", seed=s, caption_dropout_rate=0.3) == "" for s in range(400))
    assert 80 < dropped < 160


def test_secondary_separator_replaced_after_shuffle():
    result = run("sks, blue;;;eyes, dog", keep_tokens=1, shuffle_caption=True, secondary_separator=";;;")
    tags = result.split(", ")
    assert tags[0] == "sks" and "blue,eyes" in result
