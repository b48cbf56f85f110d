"""Synthetic pictures demo-vlm was trained on: 1-4 shapes of one colour, grouped at one side.

A picture is a `Scene` (shape, colour, count, position) drawn with PIL on a white canvas; the
same seed always gives the same scene and the same pixels. `caption(scene)` is the sentence the
demo VLM's vision tower learnt to "say" (e.g. "Two red squares on the left."), and
`questions(scene)` the question/answer pairs the console and the tests ask. Used by
tools/train_demo_vlm.py (training seeds) and the accuracy tests (held-out seeds); torch-free.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

SHAPES = ("circle", "square", "triangle", "star", "diamond", "cross")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "orange": (255, 140, 0), "yellow": (235, 215, 0), "green": (20, 150, 40),
    "blue": (30, 90, 230), "purple": (130, 40, 170), "pink": (255, 120, 190), "brown": (125, 75, 30),
    "black": (10, 10, 10), "grey": (135, 135, 135), "cyan": (0, 205, 215), "navy": (10, 20, 110),
}
COUNTS = (1, 2, 3, 4)
POSITIONS = ("left", "right", "top", "bottom")
COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}

# The canvas is an 8 x 8 grid of cells (demo-vlm's 16 px patches at 128 px): each shape sits in
# its own cell, so the tower recognises a shape within one patch. Each position owns 8 cells at
# its side, disjoint from the others', so "left" never looks like "top".
_GRID = 8
_REGIONS = {"left": [(c, r) for c in (0, 1) for r in range(2, 6)],
            "right": [(c, r) for c in (6, 7) for r in range(2, 6)],
            "top": [(c, r) for r in (0, 1) for c in range(2, 6)],
            "bottom": [(c, r) for r in (6, 7) for c in range(2, 6)]}
_SUPERSAMPLE = 4  # drawn 4x larger then downsampled: smooth edges, like a resized photo


@dataclass(frozen=True, slots=True)
class Scene:
    """What a synthetic picture shows: `count` shapes of one kind and colour at one side."""

    shape: str
    colour: str
    count: int
    position: str

    @property
    def noun(self) -> str:
        """The shape's noun, plural when there are several ("squares")."""
        if self.count == 1:
            return self.shape
        return self.shape + ("es" if self.shape.endswith("s") else "s")


def random_scene(rng: random.Random) -> Scene:
    return Scene(shape=rng.choice(SHAPES), colour=rng.choice(list(COLOURS)), count=rng.choice(COUNTS),
                 position=rng.choice(POSITIONS))


def caption(scene: Scene) -> str:
    """The one-sentence description, e.g. "Two red squares on the left."."""
    where = "on the" if scene.position in ("left", "right") else "at the"
    return f"{COUNT_WORDS[scene.count].capitalize()} {scene.colour} {scene.noun} {where} {scene.position}."


def questions(scene: Scene) -> list[tuple[str, str]]:
    """Question/answer pairs about the picture."""
    plural = scene.shape + ("es" if scene.shape.endswith("s") else "s")
    return [
        ("Describe the picture.", caption(scene)),
        ("What colour is the shape?", f"The shape is {scene.colour}."),
        ("What shape is in the picture?", f"A {scene.shape}." if scene.count == 1 else f"{plural.capitalize()}."),
        (f"How many {plural} are there?", f"There {'is' if scene.count == 1 else 'are'} "
                                          f"{COUNT_WORDS[scene.count]}."),
        ("Where is the shape?", f"{'On' if scene.position in ('left', 'right') else 'At'} the {scene.position}."),
    ]


def draw_scene(scene: Scene, size: int = 128, seed: int = 0) -> Any:
    """The scene as an RGB PIL image of size x size pixels (placement and sizes drawn from seed)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    big = size * _SUPERSAMPLE
    background = tuple(rng.randint(240, 255) for _ in range(3))
    image = Image.new("RGB", (big, big), background)
    draw = ImageDraw.Draw(image)
    colour = tuple(max(0, min(255, c + rng.randint(-12, 12))) for c in COLOURS[scene.colour])
    cell = big / _GRID
    for col, row in rng.sample(_REGIONS[scene.position], scene.count):
        radius = cell * rng.uniform(0.36, 0.46)
        cx = (col + 0.5 + rng.uniform(-0.05, 0.05)) * cell
        cy = (row + 0.5 + rng.uniform(-0.05, 0.05)) * cell
        _draw_shape(draw, scene.shape, cx, cy, radius, colour)
    return image.resize((size, size), Image.LANCZOS)


def make_picture(seed: int, size: int = 128) -> tuple[Any, Scene]:
    """A random scene and its picture, both fixed by seed."""
    scene = random_scene(random.Random(seed))
    return draw_scene(scene, size=size, seed=seed), scene


def _draw_shape(draw: Any, shape: str, cx: float, cy: float, r: float, colour: tuple[int, ...]) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        s = r * 0.85
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r * 0.95, cy + r * 0.75), (cx - r * 0.95, cy + r * 0.75)], fill=colour)
    elif shape == "diamond":
        draw.polygon([(cx, cy - r), (cx + r * 0.8, cy), (cx, cy + r), (cx - r * 0.8, cy)], fill=colour)
    elif shape == "star":
        points = []
        for k in range(10):
            radius = r if k % 2 == 0 else r * 0.42
            angle = -math.pi / 2 + k * math.pi / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        draw.polygon(points, fill=colour)
    elif shape == "cross":
        w = r * 0.33
        draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=colour)
        draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=colour)
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
