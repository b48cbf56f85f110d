"""Scoring demo-vlm's answers about held-out synthetic pictures (lm_console/engine/models/demo_vlm_pictures.py).

Held-out seeds start at HELD_OUT_SEED: tools/train_demo_vlm.py trains on seeds below 10_000
and checks itself on 10_000_000 onwards, so these pictures were never seen.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lm_console.engine.models.demo_vlm_pictures import COLOURS, COUNT_WORDS, SHAPES, Scene, make_picture

HELD_OUT_SEED = 1_000_000
QUESTION = "Describe the picture."
MAX_TOKENS = 16


def held_out(count: int, offset: int = 0) -> list[tuple[object, Scene]]:
    """`count` (PIL picture, scene) pairs from held-out seeds."""
    return [make_picture(HELD_OUT_SEED + offset + i) for i in range(count)]


@dataclass(frozen=True, slots=True)
class Verdict:
    colour: bool  # the first colour the answer names is the picture's
    shape: bool  # the first shape it names (singular or plural) is the picture's
    count: bool  # says the number (word or digit)

    @property
    def colour_and_shape(self) -> bool:
        return self.colour and self.shape


def judge(answer: str, scene: Scene) -> Verdict:
    """What the answer names first: a small LM may ramble on after naming the picture ("... are
    a classic example of a geometric pattern"), so later words are not held against it, but
    the first colour and the first shape it names must be right. Hyphenated words stay whole
    ("cross-border" names no cross)."""
    words = re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)*", answer.lower())
    colours = [w for w in words if w in COLOURS]
    shapes = [_singular(w) for w in words if _singular(w) in SHAPES]
    count = COUNT_WORDS[scene.count] in words or str(scene.count) in words
    return Verdict(colour=colours[:1] == [scene.colour], shape=shapes[:1] == [scene.shape], count=count)


def _singular(word: str) -> str:
    if word.endswith("sses"):
        return word[:-2]  # crosses
    return word[:-1] if word.endswith("s") and word[:-1] in SHAPES else word


def accuracy(answers: list[str], scenes: list[Scene]) -> float:
    """Share of answers naming the picture's colour and shape first."""
    assert len(answers) == len(scenes)
    return sum(judge(a, s).colour_and_shape for a, s in zip(answers, scenes)) / len(scenes)


def chat_messages(image: object, question: str = QUESTION, part: str = "image") -> list[dict]:
    """One user turn with the image first (as an `image` or an `image_url` part) then the question."""
    content = ({"type": "image", "image": image} if part == "image"
               else {"type": "image_url", "image_url": {"url": image}})
    return [{"role": "user", "content": [content, {"type": "text", "text": question}]}]
