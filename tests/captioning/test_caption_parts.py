"""The captioning rules that need no model: the tagger's input and tag choice, and how captions are combined."""

from __future__ import annotations

import numpy as np
from PIL import Image

from dreamstep.captioning.tagger import TagList, pad_square_resize, read_tag_list, select_tags
from dreamstep.captioning.targets import compose, one_line
from dreamstep.config.caption import CaptionConfig


def test_the_tagger_sees_a_white_padded_square_in_bgr():
    pixels = pad_square_resize(Image.new("RGB", (4, 2), (255, 0, 0)), 4)
    assert pixels.shape == (4, 4, 3) and pixels.dtype == np.float32
    assert pixels[0, 0].tolist() == [255, 255, 255] and pixels[3, 3].tolist() == [255, 255, 255]  # padding
    assert pixels[1, 1].tolist() == [0, 0, 255] and pixels[2, 2].tolist() == [0, 0, 255]  # red, as BGR


def test_tag_names_lose_underscores_but_emoticons_keep_them(tmp_path):
    csv = tmp_path / "selected_tags.csv"
    csv.write_text("tag_id,name,category,count\n1,general,9,5\n2,long_hair,0,5\n3,^_^,0,5\n4,hatsune_miku,4,5\n")
    assert read_tag_list(csv, underscores=False).names == ["general", "long hair", "^_^", "hatsune miku"]
    assert read_tag_list(csv, underscores=True).names[1] == "long_hair"


def test_tags_over_their_thresholds_characters_first_by_score():
    tags = TagList(["general", "explicit", "smile", "solo", "blush", "kirby"], ["9", "9", "0", "0", "0", "4"])
    scores = np.array([0.9, 0.1, 0.4, 0.8, 0.2, 0.9])
    config = CaptionConfig(source=".", captioner="wd14", general_threshold=0.35, character_threshold=0.85)
    assert select_tags(scores, tags, config) == "kirby, solo, smile"
    config = CaptionConfig(source=".", captioner="wd14", rating_tag=True, exclude_tags=["solo,kirby"])
    assert select_tags(scores, tags, config) == "general, smile"


def test_captions_are_one_line_and_prefix_and_append_do_not_repeat():
    assert one_line("A dog.\n\nIt sits\ton grass.\x07") == "A dog. It sits on grass."
    assert compose("a dog", None, append=False, prefix="sks, ", tags=False) == "sks, a dog"
    assert compose("sks, a dog", None, append=False, prefix="sks, ", tags=False) == "sks, a dog"
    assert compose("smile, solo", "solo, red", append=True, prefix="", tags=True) == "solo, red, smile"
    assert compose("a dog", "sks, a dog", append=True, prefix="sks, ", tags=False) == "sks, a dog"
    assert compose("on grass", "a dog", append=True, prefix="", tags=False) == "a dog on grass"


def test_a_captioner_sees_the_picture_as_the_trainer_decodes_it(tmp_path):
    """EXIF rotation applied, transparency on white, large pictures shrunk on the decoding threads."""
    from dreamstep.captioning.run import MAX_SIDE, _load
    from dreamstep.captioning.targets import CaptionFolder, Target

    folder = CaptionFolder(tmp_path, ".txt")
    stored = Image.new("RGB", (60, 20), (10, 20, 30))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: a viewer turns it 90 degrees
    stored.save(tmp_path / "sideways.jpg", exif=exif)
    assert _load(Target(tmp_path / "sideways.jpg", folder, None)).size == (20, 60)
    Image.new("RGBA", (8, 8), (255, 0, 0, 0)).save(tmp_path / "clear.png")
    assert _load(Target(tmp_path / "clear.png", folder, None)).getpixel((4, 4)) == (255, 255, 255)
    Image.new("RGB", (4000, 1000)).save(tmp_path / "wide.png")
    assert _load(Target(tmp_path / "wide.png", folder, None)).size == (MAX_SIDE, MAX_SIDE // 4)
