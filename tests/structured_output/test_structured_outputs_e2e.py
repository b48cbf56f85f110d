"""Structured outputs end to end on a tiny random model: every output obeys its constraint.

A random model is the hardest case for the masking: it prefers no token, so only the bitmask
keeps its output inside the grammar. One in-process engine serves the batch tests (the server's
tests send structured requests across the process boundary); a second one with a tiny token
budget and KV cache checks chunked prefill, preemption and prefix caching.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from lm_console.engine import LLM, SamplingParams, StructuredOutputsParams
from lm_console.engine.errors import InvalidStructuredOutputError
from llm_helpers import assert_no_leaked_blocks
from schema_gen import make_schemas

pytestmark = pytest.mark.slow

ENGINE_ARGS = dict(dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20, max_num_seqs=128,
                   multiprocess=False)
NUM_SCHEMAS = 50


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), **ENGINE_ARGS)
    yield engine
    assert_no_leaked_blocks(engine)
    engine.shutdown()


def _json(schema, **kwargs) -> StructuredOutputsParams:
    # No optional whitespace: a random model would otherwise emit whitespace until max_tokens.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True, **kwargs)


def test_50_generated_schemas_validate_greedy_and_at_temperature_1(llm) -> None:
    schemas = make_schemas(NUM_SCHEMAS, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=600, structured_outputs=_json(s)) for s in schemas]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=600, structured_outputs=_json(s))
               for i, s in enumerate(schemas)]
    prompts = [f"Record {i}:" for i in range(len(params))]
    outputs = llm.generate(prompts, params, use_tqdm=False)  # all 100 in one batch
    failures = []
    for i, (schema, output) in enumerate(zip(schemas + schemas, outputs)):
        completion = output.outputs[0]
        try:
            jsonschema.validate(json.loads(completion.text), schema)
        except (ValueError, jsonschema.ValidationError) as error:
            failures.append((i, completion.finish_reason, completion.text[:200], str(error)[:200]))
        assert completion.finish_reason == "stop", (i, completion.text)
    assert not failures, failures


def test_regex_choice_grammar_and_json_object(llm) -> None:
    regexes = [r"\d{3}-\d{4}", r"(cat|dog)s? (and|or) [a-z]{2,5}", r"[A-Z][a-z]{1,6}@[a-z]{2,4}\.(com|org)"]
    choices = ["yes", "no", 'maybe "so"', "naïve ☃"]
    grammar = 'root ::= pair ("," pair)?\npair ::= key "=" digit\nkey ::= "x" | "y" | "zz"\ndigit ::= [0-9]'
    cases = [StructuredOutputsParams(regex=r) for r in regexes] + [
        StructuredOutputsParams(choice=choices), StructuredOutputsParams(grammar=grammar),
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True)]
    params = [SamplingParams(temperature=t, seed=7, max_tokens=40, structured_outputs=c)
              for t in (0.0, 1.0) for c in cases]
    outputs = llm.generate([f"Say {i}" for i in range(len(params))], params, use_tqdm=False)
    for param, output in zip(params, outputs):
        text, constraint = output.outputs[0].text, param.structured_outputs
        if constraint.json_object:
            # Any object: a random model may stay inside one string until max_tokens.
            assert text.startswith("{") and (output.outputs[0].finish_reason == "length"
                                             or isinstance(json.loads(text), dict)), text
            continue
        assert output.outputs[0].finish_reason == "stop", (constraint, text)
        if constraint.regex is not None:
            assert re.fullmatch(constraint.regex, text), (constraint.regex, text)
        elif constraint.choice is not None:
            assert text in choices
        elif constraint.grammar is not None:
            assert re.fullmatch(r"(x|y|zz)=[0-9](,(x|y|zz)=[0-9])?", text), text


def test_free_requests_unchanged_next_to_structured_ones(llm) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["The history of computing", "Gardens teach a lesson", "Cities are layered"]
    alone = llm.generate(prompts, free, use_tqdm=False)
    # Constrained through all 24 steps of the free ones (the schema needs more than 24 tokens).
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 100}}, "required": ["a"]}
    structured = [SamplingParams(temperature=t, seed=1, max_tokens=24, structured_outputs=_json(schema))
                  for t in (0.0, 1.0)]
    mixed = llm.generate(prompts + ["{", "{"], [free] * 3 + structured, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    for output in mixed[3:]:
        assert re.match(r'\{"a": ?"', output.outputs[0].text) and len(output.outputs[0].token_ids) == 24


@pytest.mark.parametrize("constraint, words", [
    (dict(json={"type": "objec"}), ["json", "objec"]),
    (dict(regex="(ab"), ["regex", "parenthesis"]),
    (dict(grammar="root ::= missing_rule"), ["grammar", "missing_rule"]),
])
def test_bad_constraint_is_a_per_request_error(llm, constraint, words) -> None:
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(InvalidStructuredOutputError) as info:
        llm.generate(["bad"], params, use_tqdm=False)
    assert all(word in str(info.value) for word in words), str(info.value)
    # The engine keeps serving, structured requests included.
    good = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert llm.generate(["good"], good, use_tqdm=False)[0].outputs[0].text in ("a", "b")


def test_n_children_each_follow_the_schema_and_stop_strings_end_early(llm) -> None:
    schema = make_schemas(1, seed=11)[0]
    [output] = llm.generate(["Many:"], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=400,
                                                      structured_outputs=_json(schema)), use_tqdm=False)
    assert len(output.outputs) == 3
    for completion in output.outputs:
        jsonschema.validate(json.loads(completion.text), schema)
    # A stop string ends a structured request in the frontend (the core aborts it).
    [stopped] = llm.generate(["Stop:"], SamplingParams(temperature=0.0, max_tokens=50, stop=["-"],
                                                       structured_outputs=StructuredOutputsParams(
                                                           regex=r"\d\d-\d\d-\d\d")), use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == "-"
    assert re.fullmatch(r"\d\d", stopped.outputs[0].text)


def test_chunked_prefill_preemption_and_prefix_hits_keep_outputs(make_llm, tiny_llama_dir, llm) -> None:
    schemas = make_schemas(5, seed=5)
    tokenizer = llm.get_tokenizer()
    body = tokenizer.encode(" A preamble that spans several blocks of the KV cache." * 7)
    prompts = [{"prompt_token_ids": tokenizer.encode(f"Item {i}:") + body} for i in range(len(schemas))]
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=_json(s)) for s in schemas]
    reference = llm.generate(prompts, params, use_tqdm=False)
    # 64-token steps split every ~90-token prompt; 20 blocks of 16 tokens hold 3 requests at most.
    small = make_llm(str(tiny_llama_dir), dtype="float32", max_model_len=192, num_gpu_blocks_override=20,
                     max_num_batched_tokens=64, multiprocess=False)
    first = small.generate(prompts, params, use_tqdm=False)
    stats = small.get_stats()
    assert stats.num_preemptions_total > 0
    for schema, ref, out in zip(schemas, reference, first):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    [again] = small.generate(prompts[-1:], params[-1:], use_tqdm=False)  # its blocks are cached
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == reference[-1].outputs[0].token_ids


def test_async_scheduling_gives_the_same_structured_and_free_outputs(llm, tiny_llama_dir) -> None:
    """Under async scheduling a structured request waits for its token in flight (its grammar must
    accept it before the next bitmask), while free requests in the same batch overlap steps."""
    schemas = make_schemas(6, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=_json(s)) for s in schemas]
    params += [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in range(4)]
    prompts = [f"Item {i}:" for i in range(len(params))]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    overlapped = LLM(str(tiny_llama_dir), async_scheduling=True, **ENGINE_ARGS)
    try:
        outputs = overlapped.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        for schema, output in zip(schemas, outputs):
            jsonschema.validate(json.loads(output.outputs[0].text), schema)
        assert_no_leaked_blocks(overlapped)
    finally:
        overlapped.shutdown()
