"""MultiModalHasher: same image + same kwargs -> same hash; anything else differs."""

from __future__ import annotations

import pytest

from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.multimodal.hasher import MultiModalHasher, default_algorithm
from lm_console.engine.multimodal.image import load_image
from mm_factory import make_image, png_bytes


@pytest.mark.parametrize("algorithm", ["blake3", "sha256", "sha512"])
def test_hash_depends_on_model_image_and_kwargs(algorithm) -> None:
    hasher = MultiModalHasher(algorithm)
    a, b = load_image(png_bytes(make_image(1))), load_image(png_bytes(make_image(2)))
    base = hasher.hash_kwargs(model_id="m", image=a)
    assert base == hasher.hash_kwargs(image=load_image(png_bytes(make_image(1))), model_id="m")
    assert base != hasher.hash_kwargs(model_id="m", image=b)
    assert base != hasher.hash_kwargs(model_id="other", image=a)
    assert base != hasher.hash_kwargs(model_id="m", image=a, do_image_splitting=False)
    assert hasher.hash_kwargs(model_id="m", image=a, size={"longest_edge": 64}) != \
        hasher.hash_kwargs(model_id="m", image=a, size={"longest_edge": 65})
    # Key names are part of the stream: moving bytes between keys changes the hash.
    assert hasher.hash_kwargs(x="ab", y="c") != hasher.hash_kwargs(x="a", y="bc")


def test_pil_images_hash_their_pixels() -> None:
    hasher = MultiModalHasher("sha256")
    assert hasher.hash_kwargs(image=make_image(3)) == hasher.hash_kwargs(image=make_image(3))
    assert hasher.hash_kwargs(image=make_image(3)) != hasher.hash_kwargs(image=make_image(4))


def test_default_is_blake3_and_unknown_names_are_rejected() -> None:
    assert default_algorithm() == "blake3"
    assert MultiModalHasher().algorithm == "blake3"
    with pytest.raises(InvalidEngineArgsError, match="md5"):
        MultiModalHasher("md5")
