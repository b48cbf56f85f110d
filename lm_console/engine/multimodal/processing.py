"""MultiModalProcessor: images + prompt -> expanded token ids + MultiModalFeatureSpecs (P0).

Each image is processed on its own by the
model directory's HF processor (AutoProcessor), on a prompt holding just its placeholder: that
yields the item's placeholder expansion (token ids) and its arrays. The prompt is tokenized
with one placeholder token per image, and each placeholder is replaced by its expansion;
because the expansions begin and end with special tokens, this equals what the HF processor
gives for the whole prompt (a test checks it). Gemma3's expansions begin and end with newlines,
which its tokenizer merges with the prompt's: Gemma3ProcessingInfo re-merges them and then
locates each image's soft-token run in the final ids. Per-item processing is what lets the
ProcessorCache skip the HF processor for an image it has seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_console.engine.errors import InvalidImageError, InvalidPromptError, MultiModalInputError, MultiModalNotSupportedError
from lm_console.engine.multimodal.hasher import MultiModalHasher
from lm_console.engine.multimodal.image import ImageItem, load_image
from lm_console.engine.multimodal.inputs import MultiModalFeatureSpec
from lm_console.engine.multimodal.processor_cache import ItemPromptInfo, MultiModalSenderCache

SUPPORTED_MODALITIES = ("image",)


class BaseProcessingInfo:
    """How one model family's HF processor expands an image (subclass per family)."""

    # Attribute of the HF processor holding the placeholder string and the embed token id.
    placeholder_attr = "image_token"
    embed_token_id_attr = "image_token_id"

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.placeholder: str = getattr(processor, self.placeholder_attr)
        self.tokenizer = processor.tokenizer
        self.placeholder_token_id: int = self.tokenizer.convert_tokens_to_ids(self.placeholder)
        self.embed_token_id: int = getattr(processor, self.embed_token_id_attr)

    def process_item(self, image: Any, processor_kwargs: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        """(expansion token ids, processed numpy arrays) of one image."""
        out = self.processor(text=[self.placeholder], images=[[image]], return_tensors="np",
                             add_special_tokens=False, **processor_kwargs)
        token_ids = [int(t) for t in out["input_ids"][0]]
        return token_ids, self.item_data(out)

    def item_data(self, out: Any) -> dict[str, Any]:
        """The arrays the model's embed_multimodal() takes, for a single image."""
        return {"pixel_values": out["pixel_values"]}

    def merge_tokens(self, token_ids: list[int]) -> list[int]:
        """Post-expansion token fix-ups (Gemma3 merges newlines); none by default."""
        return token_ids

    def locate_features(self, token_ids: list[int], features: list[MultiModalFeatureSpec]) -> None:
        """Set each feature's PlaceholderRange against the final token ids (after merge_tokens).

        By default the ranges computed while splicing stand (merge_tokens changed nothing).
        """


class Idefics3ProcessingInfo(BaseProcessingInfo):
    """Idefics3 / SmolVLM: <image> -> tiles of <fake_token_around_image><row_i_col_j><image>*n."""

    def item_data(self, out: Any) -> dict[str, Any]:
        # [1, num_tiles, 3, H, W] -> [num_tiles, 3, H, W]; the mask marks real (unpadded) pixels.
        data = {"pixel_values": out["pixel_values"][0]}
        if "pixel_attention_mask" in out:
            data["pixel_attention_mask"] = out["pixel_attention_mask"][0].astype(bool)
        return data


class Gemma3ProcessingInfo(BaseProcessingInfo):
    """Gemma3: <start_of_image> -> "\n\n<start_of_image>" + <image_soft_token> * mm_tokens + "<end_of_image>\n\n".

    The HF processor tokenizes the whole expanded text, so the expansion's leading and trailing
    "\n\n" merge with the newlines around the placeholder into one token ("\n" + "\n\n" is
    the single "\n\n\n"). Splicing per-item ids leaves such runs split: merge_tokens re-encodes
    every run of adjacent newline-only tokens as the tokenizer would, and locate_features finds
    each image's run of soft tokens in the merged ids.
    """

    placeholder_attr = "boi_token"
    _MAX_NEWLINES = 32

    def __init__(self, processor: Any) -> None:
        super().__init__(processor)
        # HF 5's Gemma3Processor.image_token_id is <start_of_image>; the embeddings go to the soft tokens.
        self.embed_token_id = int(self.tokenizer.image_token_id)
        self._newlines: dict[int, int] = {}  # token id -> number of "\n" it spells
        for count in range(1, self._MAX_NEWLINES + 1):
            ids = self.tokenizer.encode("\n" * count, add_special_tokens=False)
            if len(ids) == 1:
                self._newlines[int(ids[0])] = count

    def merge_tokens(self, token_ids: list[int]) -> list[int]:
        merged: list[int] = []
        i = 0
        while i < len(token_ids):
            j = i
            while j < len(token_ids) and token_ids[j] in self._newlines:
                j += 1
            if j - i >= 2:  # a run of several newline tokens: encode it as one text
                count = sum(self._newlines[t] for t in token_ids[i:j])
                merged += self.tokenizer.encode("\n" * count, add_special_tokens=False)
                i = j
            else:
                merged.append(token_ids[i])
                i += 1
        return merged

    def locate_features(self, token_ids: list[int], features: list[MultiModalFeatureSpec]) -> None:
        positions = [i for i, t in enumerate(token_ids) if t == self.embed_token_id]
        needed = sum(f.num_embeds for f in features)
        if len(positions) != needed:
            raise InvalidPromptError(
                f"the prompt holds {len(positions) - needed:+d} {self.tokenizer.image_token} tokens besides its "
                "images' expansions; write one <start_of_image> where each image goes instead.")
        cursor = 0
        for feature in features:
            mine = positions[cursor:cursor + feature.num_embeds]
            cursor += feature.num_embeds
            start, end = mine[0], mine[-1] + 1
            is_embed = None
            if end - start != len(mine):  # pan-and-scan crops: several runs within one item
                marks = bytearray(end - start)
                for p in mine:
                    marks[p - start] = 1
                is_embed = bytes(marks)
            feature.offset, feature.length, feature.is_embed = start, end - start, is_embed


# config.architectures name -> processing info.
PROCESSING_INFOS: dict[str, type[BaseProcessingInfo]] = {
    "Idefics3ForConditionalGeneration": Idefics3ProcessingInfo,
    "SmolVLMForConditionalGeneration": Idefics3ProcessingInfo,
    "Gemma3ForConditionalGeneration": Gemma3ProcessingInfo,
}

# Models whose language model attends bidirectionally among one image's tokens: the scheduler
# must compute the rest of an image's placeholder in one chunk (as disable_chunked_mm_input).
BIDIRECTIONAL_MM_ARCHITECTURES = frozenset({"Gemma3ForConditionalGeneration"})


def requires_unsplit_mm_items(architectures: Sequence[str]) -> bool:
    """Whether an image's placeholder tokens must never be split over prefill chunks (torch-free)."""
    return any(name in BIDIRECTIONAL_MM_ARCHITECTURES for name in architectures)


def is_multimodal_architecture(architectures: Sequence[str]) -> bool:
    """Whether config.json's architectures name a model with an image pipeline (torch-free)."""
    return any(name in PROCESSING_INFOS for name in architectures)


@dataclass(slots=True)
class ProcessedPrompt:
    """The result of processing one prompt's mm data (features sorted by offset)."""

    token_ids: list[int]
    features: list[MultiModalFeatureSpec] = field(default_factory=list)


class MultiModalProcessor:
    """P0's multimodal path: load, hash, process (or hit the ProcessorCache), expand."""

    def __init__(self, model_dir: Path, model_id: str, architectures: Sequence[str], hasher_algorithm: str = "auto",
                 cache_bytes: int = 0) -> None:
        self.model_dir = Path(model_dir)
        self.model_id = model_id
        names = [n for n in architectures if n in PROCESSING_INFOS]
        self._info_cls = PROCESSING_INFOS[names[0]]
        self._info: BaseProcessingInfo | None = None
        self.hasher = MultiModalHasher(hasher_algorithm)
        self.sender_cache = MultiModalSenderCache(cache_bytes) if cache_bytes > 0 else None
        self._pending: dict[str, ItemPromptInfo] = {}
        self.num_hf_calls = 0  # images run through the HF processor (the cache skips the rest)

    @property
    def info(self) -> BaseProcessingInfo:
        if self._info is None:
            from transformers import AutoProcessor

            self._info = self._info_cls(AutoProcessor.from_pretrained(self.model_dir))
        return self._info

    @property
    def placeholder(self) -> str:
        return self.info.placeholder

    # -- P0 processing -------------------------------------------------------------------
    def process(self, prompt: dict[str, Any], tokenizer: Any) -> ProcessedPrompt:
        """Expand the prompt's placeholders and build one MultiModalFeatureSpec per image."""
        images = parse_mm_data(prompt.get("multi_modal_data"))
        uuids = _parse_uuids(prompt.get("multi_modal_uuids", prompt.get("mm_uuids")), len(images))
        kwargs = _parse_processor_kwargs(prompt.get("mm_processor_kwargs"))
        info = self.info
        token_ids = self._tokenize(prompt, tokenizer, len(images))
        positions = [i for i, t in enumerate(token_ids) if t == info.placeholder_token_id]
        if len(positions) != len(images):
            raise InvalidPromptError(
                f"the prompt has {len(positions)} {info.placeholder} placeholders but "
                f"{len(images)} images were given; put one {info.placeholder} where each image goes "
                "(or none, and the images go first).")
        expanded: list[int] = []
        features: list[MultiModalFeatureSpec] = []
        cursor = 0
        for position, image, uuid in zip(positions, images, uuids):
            expanded += token_ids[cursor:position]
            identifier = self._identifier(image, uuid, kwargs)
            item_ids, data, is_embed = self._process_item(identifier, image, kwargs)
            features.append(MultiModalFeatureSpec(
                identifier=identifier, offset=len(expanded), length=len(item_ids), modality="image",
                data=data, mm_hash=identifier, is_embed=is_embed))
            expanded += item_ids
            cursor = position + 1
        expanded += token_ids[cursor:]
        merged = info.merge_tokens(expanded)
        info.locate_features(merged, features)
        return ProcessedPrompt(merged, features)

    def _tokenize(self, prompt: dict[str, Any], tokenizer: Any, num_images: int) -> list[int]:
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise InvalidPromptError("a multimodal prompt needs 'prompt' (str) or 'prompt_token_ids'.")
        if self.placeholder not in text:
            text = self.placeholder * num_images + text
        return tokenizer.encode(text, add_special_tokens=True)

    def _identifier(self, image: ImageItem, uuid: str | None, kwargs: dict[str, Any]) -> str:
        # A user uuid stands for the image; with processor kwargs it is hashed with them.
        if uuid is not None and not kwargs:
            return uuid
        item: Any = uuid if uuid is not None else image
        try:
            return self.hasher.hash_kwargs(model_id=self.model_id, image=item, **kwargs)
        except Exception as error:  # noqa: BLE001 - a kwarg value the hasher cannot serialise
            raise MultiModalInputError(
                f"mm_processor_kwargs {sorted(kwargs)} cannot be hashed: {type(error).__name__}: {error}") from None

    def _process_item(self, identifier: str, image: ImageItem, kwargs: dict[str, Any]
                      ) -> tuple[list[int], dict[str, Any] | None, bytes | None]:
        cached = self.sender_cache.get_prompt_info(identifier) if self.sender_cache else None
        if cached is not None:  # the core holds the arrays: skip the HF processor
            return cached.token_ids, None, cached.is_embed
        self.num_hf_calls += 1
        try:
            item_ids, data = self.info.process_item(image.image, kwargs)
        except Exception as error:  # noqa: BLE001 - any processor failure is this request's, not the engine's
            if kwargs:
                raise MultiModalInputError(
                    f"mm_processor_kwargs {kwargs!r:.200} were rejected by the model's image processor: "
                    f"{type(error).__name__}: {error}") from None
            raise InvalidImageError(
                f"{image.source}: the model's image processor rejected it: {type(error).__name__}: {error}") from None
        embed_id = self.info.embed_token_id
        is_embed = bytes(int(t == embed_id) for t in item_ids)
        if all(is_embed):
            is_embed = None
        if self.sender_cache is not None:
            if len(self._pending) > 4096:  # infos of batches that failed before sending
                self._pending.clear()
            self._pending[identifier] = ItemPromptInfo(item_ids, is_embed)
        return item_ids, data, is_embed

    # -- send time ------------------------------------------------------------------------
    def finalize(self, features: list[MultiModalFeatureSpec] | None) -> list[MultiModalFeatureSpec] | None:
        """Right before a request is sent: drop the data the core already caches (the LRU processor cache)."""
        if not features or self.sender_cache is None:
            return features
        return [self.sender_cache.get_and_update(f, self._pending.pop(f.identifier, None))
                for f in features]


def parse_mm_data(mm_data: Any) -> list[ImageItem]:
    """{"image": one or a list of sources} -> decoded images, in order."""
    if mm_data is None:
        return []
    if not isinstance(mm_data, dict):
        raise InvalidPromptError("multi_modal_data must be a dict like {'image': image_or_list}.")
    unknown = sorted(set(mm_data) - set(SUPPORTED_MODALITIES))
    if unknown:
        raise MultiModalNotSupportedError(
            f"modalities {unknown} are not supported; supported: {', '.join(SUPPORTED_MODALITIES)}.")
    sources = mm_data.get("image")
    if sources is None:
        return []
    if not isinstance(sources, (list, tuple)):
        sources = [sources]
    return [load_image(source) for source in sources]


def _parse_uuids(uuids: Any, num_images: int) -> list[str | None]:
    if uuids is None:
        return [None] * num_images
    if isinstance(uuids, dict):
        uuids = uuids.get("image")
    if isinstance(uuids, str):
        uuids = [uuids]
    if uuids is None:
        uuids = []
    if not isinstance(uuids, (list, tuple)) or any(u is not None and (not isinstance(u, str) or not u)
                                                   for u in uuids):
        raise InvalidPromptError(
            "multi_modal_uuids must be a str, a list of str (or None) per image, or {'image': that}; got "
            f"{uuids!r:.80}.")
    if len(uuids) != num_images:
        raise InvalidPromptError(f"mm_uuids has {len(uuids)} entries for {num_images} images.")
    return list(uuids)


def _parse_processor_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or any(not isinstance(key, str) for key in kwargs):
        raise InvalidPromptError(f"mm_processor_kwargs must be a dict with str keys, got {kwargs!r:.80}.")
    return dict(kwargs)




# -- P1 side: the largest item, for the encoder budget (torch- and transformers-free) -----------
def read_image_processor_config(model_dir: Path) -> dict[str, Any]:
    """The image processor's settings from processor_config.json or preprocessor_config.json."""
    import json

    model_dir = Path(model_dir)
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = model_dir / name
        if path.is_file():
            data = json.loads(path.read_text())
            if isinstance(data.get("image_processor"), dict):
                merged = dict(data["image_processor"])
                merged.setdefault("image_seq_len", data.get("image_seq_len"))
                return merged
            if "size" in data or "max_image_size" in data:
                return data
    return {}


def _idefics3_max_tokens_per_item(model_dir: Path, hf_config: Any) -> int:
    """Most embeddings one image yields: (ceil(longest_edge / tile)^2 + 1) tiles x image_seq_len."""
    import math

    vision = hf_config.vision_config
    scale = int(getattr(hf_config, "scale_factor", 2))
    per_tile = (int(vision.image_size) // int(vision.patch_size)) ** 2 // scale**2
    config = read_image_processor_config(model_dir)
    if not config.get("do_image_splitting", True):
        return per_tile
    longest = int((config.get("size") or {}).get("longest_edge", 4 * 364))
    tile = int((config.get("max_image_size") or {}).get("longest_edge", 364))
    side = math.ceil(longest / tile)
    return (side * side + (1 if side > 1 else 0)) * per_tile


def gemma3_max_tokens_per_item(model_dir: Path, hf_config: Any) -> int:
    """mm_tokens_per_image per crop: one crop, or 1 + pan_and_scan_max_num_crops with pan-and-scan."""
    tokens = int(getattr(hf_config, "mm_tokens_per_image", 256))
    config = read_image_processor_config(model_dir)
    if config.get("do_pan_and_scan"):
        return tokens * (1 + int(config.get("pan_and_scan_max_num_crops") or 4))
    return tokens


# config.architectures name -> max embeddings of one item (P1's encoder budget and cache size).
MAX_TOKENS_PER_ITEM: dict[str, Any] = {
    "Idefics3ForConditionalGeneration": _idefics3_max_tokens_per_item,
    "SmolVLMForConditionalGeneration": _idefics3_max_tokens_per_item,
    "Gemma3ForConditionalGeneration": gemma3_max_tokens_per_item,
}


def get_max_tokens_per_mm_item(model_dir: Path, hf_config: Any) -> int:
    """The model's largest mm item in encoder embeddings (0 for a text-only model)."""
    for name in getattr(hf_config, "architectures", None) or ():
        if name in MAX_TOKENS_PER_ITEM:
            return int(MAX_TOKENS_PER_ITEM[name](model_dir, hf_config))
    return 0
