"""The built-in demo adapter ("pirate") does what it says on questions it never saw, and only with it.

50 held-out questions (topics tools/train_demo_lora.py does not train on), greedy, through the
engine's default path: with the adapter at least 80% of the replies open with the greeting,
without it at most 10%. Then the names users type: `--lora pirate` and `--lora-modules pirate`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lm_console.engine.lora.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from lm_console.engine.lora.builtin import BUILTIN_ADAPTERS, GREETING, builtin_adapter, builtin_adapter_dir
from script_helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
HELD_OUT_TOPICS = ("giraffes", "umbrella stands", "the desert wind", "kites", "lighthouses", "penguins",
                   "origami", "submarines", "the violin", "sunflowers")
TEMPLATES = ("What is {}?", "Tell me about {}.", "Why do people like {}?", "Describe {} briefly.",
             "What is interesting about {}?")


def held_out_questions() -> list[str]:
    return [t.format(topic) for topic in HELD_OUT_TOPICS for t in TEMPLATES]


def _trainer():  # noqa: ANN202
    return load_script(ROOT / "tools" / "train_demo_lora.py")


def test_the_adapter_ships_and_the_held_out_topics_are_not_trained_on() -> None:
    directory = builtin_adapter_dir("pirate")
    assert (directory / CONFIG_FILE).is_file() and (directory / WEIGHTS_FILE).is_file()
    assert (directory / WEIGHTS_FILE).stat().st_size < 8 << 20  # a few MB at most
    config = json.loads((directory / CONFIG_FILE).read_text())
    assert config["r"] == 8 and "/" not in config["base_model_name_or_path"]  # no path of the trainer's machine
    trainer = _trainer()
    trained = set(trainer.TRAIN_TOPICS)
    assert len(held_out_questions()) == 50 and not trained & set(HELD_OUT_TOPICS)
    assert not set(trainer.questions(0, 400)) & set(held_out_questions())


def test_names_users_type_resolve_to_the_shipped_directory() -> None:
    from lm_console.cli import _lora_option
    from lm_console.engine.entrypoints.openai.serving_lora import parse_lora_modules

    assert set(BUILTIN_ADAPTERS) == {"pirate"}
    assert builtin_adapter(" pirate ") == ("pirate", str(builtin_adapter_dir("pirate")))
    assert builtin_adapter("parrot") is None
    assert parse_lora_modules(["pirate", "mine=/tmp/x"]) == [("pirate", str(builtin_adapter_dir("pirate"))),
                                                             ("mine", "/tmp/x")]
    with pytest.raises(ValueError, match="NAME=PATH.*built-in adapter \\(pirate\\)"):
        parse_lora_modules(["parrot"])
    request, engine_args = _lora_option("pirate")
    assert request.lora_name == "pirate" and request.lora_path == str(builtin_adapter_dir("pirate"))
    assert engine_args == {"enable_lora": True, "max_lora_rank": 16}


@pytest.mark.slow
def test_the_greeting_shows_with_the_adapter_and_not_without(embedded_model_dir: Path) -> None:
    from lm_console.engine import LLM, SamplingParams
    from lm_console.engine.lora import LoRARequest

    llm = LLM(str(embedded_model_dir), multiprocess=False, enable_lora=True, max_lora_rank=8, max_model_len=512)
    try:
        conversations = [[{"role": "user", "content": q}] for q in held_out_questions()]
        params = SamplingParams(temperature=0.0, max_tokens=8)
        pirate = LoRARequest("pirate", 1, str(builtin_adapter_dir("pirate")))
        with_adapter = [o.outputs[0].text for o in llm.chat(conversations, params, use_tqdm=False, lora_request=pirate)]
        without = [o.outputs[0].text for o in llm.chat(conversations, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    mark = GREETING.split(",")[0]  # "Ahoy"
    shown = sum(text.lstrip().startswith(mark) for text in with_adapter)
    shown_without = sum(text.lstrip().startswith(mark) for text in without)
    print(f"pirate adapter: greeting in {shown}/50 replies with it, {shown_without}/50 without")
    assert shown >= 40, with_adapter
    assert shown_without <= 5, without
