"""Draws the bundled example subject: six 96x96 photos of one small toy robot on varied backgrounds.

Run from the repository root to regenerate examples/robot/ (the images are committed).
"""

from pathlib import Path

from PIL import Image, ImageDraw

BACKGROUNDS = [(186, 214, 235), (233, 222, 190), (200, 230, 201), (240, 200, 200), (220, 220, 220), (205, 195, 230)]
SIZE = 96


def draw_robot(background: tuple[int, int, int], x: int, y: int, scale: float) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), background)
    d = ImageDraw.Draw(image)
    d.rectangle([0, int(SIZE * 0.75), SIZE, SIZE], fill=tuple(int(c * 0.8) for c in background))

    def box(x0: float, y0: float, x1: float, y1: float) -> list[int]:
        return [int(x + x0 * scale), int(y + y0 * scale), int(x + x1 * scale), int(y + y1 * scale)]

    d.rectangle(box(10, 22, 30, 44), fill=(200, 60, 40), outline=(60, 20, 10))  # body
    d.rectangle(box(12, 6, 28, 20), fill=(230, 180, 40), outline=(80, 60, 10))  # head
    d.ellipse(box(15, 10, 19, 14), fill=(20, 20, 20))  # eyes
    d.ellipse(box(21, 10, 25, 14), fill=(20, 20, 20))
    d.line(box(20, 6, 20, 1), fill=(60, 60, 60), width=max(1, int(scale)))  # antenna
    d.ellipse(box(18, 0, 22, 3), fill=(40, 120, 220))
    d.rectangle(box(4, 24, 9, 38), fill=(90, 90, 100))  # arms
    d.rectangle(box(31, 24, 36, 38), fill=(90, 90, 100))
    d.rectangle(box(12, 45, 17, 56), fill=(60, 60, 70))  # legs
    d.rectangle(box(23, 45, 28, 56), fill=(60, 60, 70))
    return image


def main() -> None:
    out = Path(__file__).parent / "robot"
    out.mkdir(exist_ok=True)
    placements = [(28, 20, 1.0), (10, 25, 1.1), (45, 15, 0.9), (20, 8, 1.3), (35, 30, 0.8), (5, 12, 1.2)]
    for i, (background, (x, y, s)) in enumerate(zip(BACKGROUNDS, placements)):
        draw_robot(background, x, y, s).save(out / f"robot_{i}.png", optimize=True)
    print(f"wrote {len(placements)} images to {out}")


if __name__ == "__main__":
    main()
