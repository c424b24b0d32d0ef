"""Images load upright as correct 8-bit RGB whatever their mode; unreadable files are named up front."""

import io
from pathlib import Path

import numpy as np
import pytest
from data_testkit import write_image
from PIL import Image

from dreamstep.data.images import list_images, load_rgb, skipped_files, validate_images
from dreamstep.errors import UserError


def pixel(image, xy):
    return tuple(int(v) for v in image.getpixel(xy))


def close(a, b, tol=6):
    return all(abs(x - y) <= tol for x, y in zip(a, b))


def test_exif_orientation_is_applied(tmp_path: Path):
    image = Image.new("RGB", (40, 20), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 20, 20))  # left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # the camera was turned: display rotated 90 degrees clockwise
    path = tmp_path / "rotated.jpg"
    image.save(path, exif=exif, quality=95)
    loaded = load_rgb(path)
    assert loaded.size == (20, 40)
    assert close(pixel(loaded, (10, 5)), (255, 0, 0)) and close(pixel(loaded, (10, 35)), (0, 0, 255))
    assert validate_images([path])[path].size == (20, 40)


@pytest.mark.parametrize("suffix", [".jpg", ".tif"])
def test_cmyk(tmp_path: Path, suffix):
    path = tmp_path / f"cmyk{suffix}"
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(path)
    loaded = load_rgb(path)
    assert loaded.mode == "RGB" and close(pixel(loaded, (4, 4)), (255, 0, 0), tol=10)


def test_sixteen_bit_grey_is_scaled_not_clipped(tmp_path: Path):
    values = np.array([[0, 32896, 65535]], dtype=np.uint16)  # 32896 / 257 = 128
    path = tmp_path / "deep.png"
    Image.fromarray(values).save(path)
    loaded = load_rgb(path)
    assert [pixel(loaded, (x, 0)) for x in range(3)] == [(0, 0, 0), (128, 128, 128), (255, 255, 255)]


def test_palette_with_transparency_on_white(tmp_path: Path):
    image = Image.new("P", (4, 2), 0)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    image.paste(1, (2, 0, 4, 2))  # right half uses palette entry 1 (red)
    path = tmp_path / "palette.png"
    image.save(path, transparency=0)
    loaded = load_rgb(path)
    assert pixel(loaded, (0, 0)) == (255, 255, 255) and pixel(loaded, (3, 1)) == (255, 0, 0)


def test_alpha_composited_on_white(tmp_path: Path):
    rgba = Image.new("RGBA", (2, 1), (0, 0, 0, 0))
    rgba.putpixel((1, 0), (0, 0, 255, 255))
    rgba.save(tmp_path / "rgba.png")
    Image.new("LA", (1, 1), (0, 128)).save(tmp_path / "la.png")
    loaded = load_rgb(tmp_path / "rgba.png")
    assert pixel(loaded, (0, 0)) == (255, 255, 255) and pixel(loaded, (1, 0)) == (0, 0, 255)
    assert close(pixel(load_rgb(tmp_path / "la.png"), (0, 0)), (127, 127, 127), tol=1)


def _noisy_jpeg(size=(64, 64)) -> bytes:
    array = np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def test_corrupt_jpeg_among_good_ones_is_named(tmp_path: Path):
    good = [write_image(tmp_path / f"good{i}.jpg", (32, 32)) for i in range(3)]
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(_noisy_jpeg()[:1500])  # truncated mid-scan: the header alone looks fine
    with pytest.raises(UserError) as e:
        validate_images([*good, bad])
    message = str(e.value)
    assert message.startswith(f"{bad}: cannot read image") and "\n" not in message


def test_several_bad_files_reported_in_one_line(tmp_path: Path):
    first, second = tmp_path / "a.png", tmp_path / "b.jpg"
    first.write_text("not an image")
    second.write_bytes(b"\xff\xd8\xff")
    with pytest.raises(UserError, match=rf"^{first}: cannot read image .*1 more unreadable: {second}"):
        validate_images([first, second, write_image(tmp_path / "ok.png", (4, 4))])
    with pytest.raises(UserError) as e:
        validate_images([first])
    assert "BytesIO" not in str(e.value) and "0x" not in str(e.value)  # Pillow named its in-memory buffer


def test_skipped_files_are_listed_with_their_reason_and_jfif_and_gif_are_read(tmp_path: Path):
    folder = tmp_path / "images"
    write_image(folder / "a.png", (8, 8))
    Image.new("RGB", (8, 8)).save(folder / "b.jfif", format="JPEG")
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(folder / "c.gif", save_all=True, append_images=frames[1:])
    (folder / "a.txt").write_text("a caption")
    (folder / "notes.md").write_text("x")
    (folder / "sub").mkdir()
    (folder / "dangling.png").symlink_to(folder / "gone.png")
    (folder / "loop.png").symlink_to(folder / "loop.png")
    assert [p.name for p in list_images(folder, "image_dir")] == ["a.png", "b.jfif", "c.gif"]
    assert load_rgb(folder / "c.gif").getpixel((0, 0)) == (255, 0, 0)  # the first frame
    reasons = {path.name: reason for path, reason in skipped_files(folder)}
    assert reasons == {"dangling.png": "broken link (its target is missing)", "loop.png": "link loop",
                       "notes.md": "not an image type dreamstep reads (.md)",
                       "sub": "a folder (images in subfolders are not read)"}


def test_folder_errors_name_the_folder(tmp_path: Path):
    with pytest.raises(UserError, match=rf"--instance_data_dir: folder '{tmp_path / 'nope'}' does not exist"):
        list_images(tmp_path / "nope", "--instance_data_dir")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="has no images"):
        list_images(tmp_path / "empty", "image_dir")
