"""The LLM API: input forms, n > 1, seeds, stop handling, logprobs, chat, and bad input."""

from __future__ import annotations

import json
import shutil

import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.errors import (
    InsufficientKVCacheError,
    InvalidEngineArgsError,
    InvalidPromptError,
    InvalidSamplingParamsError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256)


def test_prompt_forms_and_output_order(llm) -> None:
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("Hello there", add_special_tokens=True)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outputs = llm.generate(["Hello there", {"prompt_token_ids": ids}, {"prompt": "Hello there"}],
                           params, use_tqdm=False)
    assert [o.request_id for o in outputs] == sorted([o.request_id for o in outputs], key=int)
    assert outputs[0].prompt == "Hello there" and outputs[0].prompt_token_ids == ids
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids == outputs[2].outputs[0].token_ids
    first = outputs[0].outputs[0]
    assert first.finish_reason == "length" and len(first.token_ids) == 5 and outputs[0].finished
    assert first.text == tokenizer.decode(first.token_ids, skip_special_tokens=True)


def test_one_params_per_prompt(llm) -> None:
    outputs = llm.generate(["a", "b"], [SamplingParams(max_tokens=2, ignore_eos=True),
                                        SamplingParams(max_tokens=4, ignore_eos=True)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 4]
    with pytest.raises(InvalidSamplingParamsError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_seeded_sampling_reproduces_across_runs_and_batches(llm) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True) for _ in range(5)]
    batch = llm.generate(["x y z", "Once upon a time", "hello", "foo bar", "Once upon a time", "q"],
                         [others[0], params, others[1], others[2], params, others[3]], use_tqdm=False)
    assert alone == again == batch[1].outputs[0].token_ids == batch[4].outputs[0].token_ids


def test_n_greater_than_one(llm) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    output = llm.generate("The sky is", params, use_tqdm=False)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_stop_strings_and_stop_token_ids(llm) -> None:
    base = llm.generate("Count:", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    # A stop string taken from the middle of the greedy text.
    stop = base.text[len(base.text) // 2:len(base.text) // 2 + 3]
    if stop.strip():
        cut = llm.generate("Count:", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=stop),
                           use_tqdm=False)[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert cut.text == base.text[:base.text.index(stop)]
        kept = llm.generate("Count:", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=stop,
                                                     include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
        assert kept.text == base.text[:base.text.index(stop) + len(stop)]
    stop_token = base.token_ids[3]
    by_token = llm.generate("Count:", SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_token]),
                            use_tqdm=False)[0].outputs[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == stop_token
    assert by_token.token_ids == base.token_ids[:base.token_ids.index(stop_token) + 1]
    assert tokenizer is not None


def test_logprobs(llm) -> None:
    output = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert len(output.logprobs) == 4
    for token_id, position in zip(output.token_ids, output.logprobs):
        assert token_id in position and 3 <= len(position) <= 4
        assert position[token_id].rank == 1  # greedy picks the top token
    assert output.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(output.token_ids, output.logprobs)), rel=1e-5)


def test_chat_uses_template(llm) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    output = llm.chat(messages, SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert "<|im_start|>user" in output.prompt and output.prompt.rstrip().endswith("assistant")
    two = llm.chat([messages, messages], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(two) == 2


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n="),
    ({"seed": "abc"}, "seed"),
    ({"min_p": 2.0}, "min_p"),
])
def test_invalid_sampling_params(kwargs, match) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_and_engine_keeps_serving(llm) -> None:
    from llm_helpers import assert_no_leaked_blocks

    with pytest.raises(InvalidPromptError, match="empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(InvalidPromptError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 300}, use_tqdm=False)
    with pytest.raises(InvalidPromptError, match=r"\[0, "):
        llm.generate({"prompt_token_ids": [10**9]}, use_tqdm=False)
    # A bad prompt in a batch rejects the batch before any request runs.
    with pytest.raises(InvalidPromptError):
        llm.generate(["fine", ""], use_tqdm=False)
    output = llm.generate("still fine", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 3
    assert_no_leaked_blocks(llm)


def test_unknown_model_path(tmp_path) -> None:
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))


def test_unsupported_architecture(tmp_path, tiny_llama_dir) -> None:
    model_dir = tmp_path / "odd"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        LLM(str(model_dir), dtype="float32")


def test_kv_budget_too_small(tiny_llama_dir) -> None:
    with pytest.raises(InsufficientKVCacheError, match="max_model_len"):
        LLM(str(tiny_llama_dir), dtype="float32", max_model_len=1024, kv_cache_memory=4096)


def test_unknown_engine_argument(tiny_llama_dir) -> None:
    with pytest.raises(InvalidEngineArgsError, match="no_such_flag"):
        LLM(str(tiny_llama_dir), no_such_flag=1)
