"""vLLM's OpenAI-server behaviours through the official `openai` client over HTTP.

logit_bias, allowed_token_ids, stream usage, the JSON content type, the request_params
histograms, beam search, truncate_prompt_tokens, chat echo, custom roles, unknown fields,
chat prompt logprobs and /invocations; each with its error shape, and a negative control
where the check is an equality.
"""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from lm_console.engine import LLM, BeamSearchParams, SamplingParams
from openai_server_helpers import ThreadServer, assert_openai_error, parse_metrics, read_sse, sample_value

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
ENGINE_ARGS = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=512, num_threads=1,
                   stat_loggers=[])
PROMPT = "The history of computing is a story of"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
VOCAB_SIZE = 49152  # the tiny Llama uses the embedded model's tokenizer


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    srv = ThreadServer(str(tiny_llama_dir), ServerSettings(served_model_names=("tiny",)), **ENGINE_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=512,
              num_threads=1)
    yield llm
    llm.shutdown()


def error_of(excinfo: pytest.ExceptionInfo, status: int = 400) -> dict:
    """The OpenAI error object of an openai.APIStatusError, checked for its shape."""
    error = excinfo.value
    assert error.status_code == status, error
    body = error.body if "message" in (error.body or {}) else (error.body or {}).get("error")
    assert set(body) == {"message", "type", "param", "code"}, body
    assert body["type"] == "invalid_request_error"
    return body


def greedy_ids(client: openai.OpenAI, max_tokens: int = 3, **extra) -> list[int]:
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
                                         extra_body={"return_token_ids": True, **extra})
    return response.choices[0].token_ids


def greedy_chat_ids(client: openai.OpenAI, max_tokens: int = 3, **extra) -> list[int]:
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=max_tokens,
                                              temperature=0.0, extra_body={"return_token_ids": True, **extra})
    return response.choices[0].token_ids


# -- 1. logit_bias ---------------------------------------------------------------------------------

def test_logit_bias_plus_100_makes_greedy_pick_the_token(client) -> None:
    plain = greedy_ids(client)
    target = next(t for t in (1000, 1001, 1002) if t not in plain)
    assert plain != [target] * 3  # negative control: without the bias greedy does not pick it
    assert greedy_ids(client, logit_bias={str(target): 100}) == [target] * 3
    assert greedy_chat_ids(client)[0] != target
    assert greedy_chat_ids(client, logit_bias={str(target): 100.0}) == [target] * 3
    # -100 on greedy's first token: it is never chosen first.
    assert greedy_ids(client, logit_bias={str(plain[0]): -100})[0] != plain[0]


@pytest.mark.parametrize("bias, phrase", [
    ({str(VOCAB_SIZE): 5}, str(VOCAB_SIZE)),  # the first id past the vocabulary
    ({"123456789": 5}, "123456789"),
    ({"5": 100.5}, "[-100, 100]"),
    ({"5": -101}, "[-100, 100]"),
    ({"five": 1}, "token ids"),
], ids=["first-oov", "far-oov", "above-100", "below-minus-100", "not-an-id"])
def test_logit_bias_errors_name_the_problem(client, bias: dict, phrase: str) -> None:
    for create in (lambda: client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logit_bias=bias),
                   lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                                          logit_bias=bias)):
        with pytest.raises(openai.BadRequestError) as excinfo:
            create()
        body = error_of(excinfo)
        assert body["param"] == "logit_bias" and phrase in body["message"], body
    assert greedy_ids(client, logit_bias={str(VOCAB_SIZE - 1): 1})  # the last id is in the vocabulary


# -- 2. allowed_token_ids --------------------------------------------------------------------------

def test_allowed_token_ids_restrict_sampling(client) -> None:
    plain = greedy_ids(client, max_tokens=4)
    allowed = [t for t in (500, 501, 502, 503) if t not in plain][:3]
    assert not set(plain) <= set(allowed)  # negative control
    assert set(greedy_ids(client, max_tokens=4, allowed_token_ids=allowed)) <= set(allowed)
    sampled = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                        extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert set(sampled.choices[0].token_ids) <= set(allowed)
    assert set(greedy_chat_ids(client, max_tokens=4, allowed_token_ids=allowed)) <= set(allowed)


@pytest.mark.parametrize("ids, phrase", [([5, VOCAB_SIZE + 7], str(VOCAB_SIZE + 7)), ([], "non-empty"),
                                         ([-1], "allowed_token_ids")], ids=["oov", "empty", "negative"])
def test_allowed_token_ids_errors(client, ids: list[int], phrase: str) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"allowed_token_ids": ids})
    body = error_of(excinfo)
    assert body["param"] == "allowed_token_ids" and phrase in body["message"], body


# -- 3. stream_options -----------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_usage_only_when_asked(client, endpoint: str) -> None:
    def stream(**kw):
        if endpoint == "chat":
            return list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0.0,
                                                       stream=True, **kw))
        return list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0.0, stream=True,
                                              **kw))

    full = (client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0.0)
            if endpoint == "chat" else client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5,
                                                                  temperature=0.0))
    for options in (None, {}, {"include_usage": False}, {"continuous_usage_stats": True},
                    {"include_usage": False, "continuous_usage_stats": True}):
        chunks = stream(**({} if options is None else {"stream_options": options}))
        assert chunks and all(chunk.usage is None for chunk in chunks), options
    chunks = stream(stream_options={"include_usage": True})
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]  # negative control
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    chunks = stream(stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert all(chunk.usage is not None for chunk in chunks)
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, stream_options={"include_usage": True})
    assert error_of(excinfo)["param"] == "stream_options"


# -- 4. content type -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/invocations"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_declared_as_json_is_refused(http, path: str, content_type: str | None) -> None:
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "messages": MESSAGES}
                      if path != "/tokenize" else {"prompt": PROMPT}).encode()
    headers = {"content-type": content_type} if content_type else {}
    error = assert_openai_error(http.post(path, content=body, headers=headers), 400)
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"], error
    # Negative control: the same bytes declared as JSON (a charset parameter is fine) are served.
    served = http.post(path, content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert served.status_code == 200, served.text


def test_openai_client_with_a_text_content_type_gets_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                       extra_headers={"Content-Type": "text/plain"})
    assert error_of(excinfo)["code"] == "unsupported_media_type"


# -- 5. request_params histograms ------------------------------------------------------------------

def test_request_params_n_and_max_tokens_histograms(client, http, server) -> None:
    def read() -> dict:
        families = parse_metrics(http.get("/metrics").text)
        return {(name, suffix, le): sample_value(families, name, suffix, **({"le": le} if le else {}))
                for name in ("vllm:request_params_n", "vllm:request_params_max_tokens")
                for suffix, le in (("_count", None), ("_sum", None), ("_bucket", "1.0"), ("_bucket", "2.0"),
                                   ("_bucket", "5.0"), ("_bucket", "10.0"))}

    server.wait_idle()
    before = read()
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=7, n=2, temperature=1.0, seed=1)
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    server.wait_idle()
    after = read()
    delta = {key: after[key] - before[key] for key in after}
    n, max_tokens = "vllm:request_params_n", "vllm:request_params_max_tokens"
    assert delta[(n, "_count", None)] == 2 and delta[(n, "_sum", None)] == 3  # one observation per request
    assert delta[(n, "_bucket", "1.0")] == 1 and delta[(n, "_bucket", "2.0")] == 2
    assert delta[(max_tokens, "_count", None)] == 2 and delta[(max_tokens, "_sum", None)] == 9
    assert delta[(max_tokens, "_bucket", "2.0")] == 1 and delta[(max_tokens, "_bucket", "5.0")] == 1
    assert delta[(max_tokens, "_bucket", "10.0")] == 2
    families = parse_metrics(http.get("/metrics").text)
    buckets = sorted({float(s.labels["le"]) for s in families[n].samples if s.name == n + "_bucket"})
    assert buckets == [1.0, 2.0, 5.0, 10.0, 20.0, float("inf")]  # vLLM's


# -- 6. beam search --------------------------------------------------------------------------------

def test_beam_search_over_a_batch_of_prompts_equals_llm_beam_search(client, reference) -> None:
    prompts = [PROMPT, "Hello, my name is", PROMPT]
    response = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=5, temperature=0.0,
                                         extra_body={"use_beam_search": True})
    texts = [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]
    assert len(texts) == 6
    expected = reference.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=5))
    assert texts == [beam.text for output in expected for beam in output.sequences]
    assert texts[0] != texts[1], "two beams of one prompt differ"
    assert texts[0:2] == texts[4:6], "the same prompt gives the same beams"
    assert response.usage.completion_tokens == 30
    # Negative control: plain greedy sampling differs from the second beam (beam search is not n x greedy).
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0.0)
    assert greedy.choices[0].text != texts[1]


def test_beam_search_ranks_by_the_models_logprobs(client, reference) -> None:
    """Re-scored independently with prompt logprobs, the beams are best first and the best beats greedy."""
    response = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=4, temperature=0.0,
                                         extra_body={"use_beam_search": True, "return_token_ids": True,
                                                     "length_penalty": 0.0})
    prompt_ids = response.choices[0].prompt_token_ids

    def cum_logprob(token_ids: list[int]) -> float:
        scored = reference.generate({"prompt_token_ids": prompt_ids + token_ids},
                                    SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        return sum(scored.prompt_logprobs[len(prompt_ids) + i][t].logprob for i, t in enumerate(token_ids))

    scores = [cum_logprob(choice.token_ids) for choice in response.choices]  # length_penalty 0: the score is cum
    assert scores == sorted(scores, reverse=True)
    greedy = greedy_ids(client, max_tokens=4)
    assert scores[0] >= cum_logprob(greedy) - 1e-4


def test_chat_beam_search_and_stream(client, reference) -> None:
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, max_tokens=4,
                                              extra_body={"use_beam_search": True, "return_token_ids": True})
    assert len(response.choices) == 2 and response.choices[0].message.content != response.choices[1].message.content
    expected = reference.beam_search({"prompt_token_ids": response.prompt_token_ids},
                                     BeamSearchParams(beam_width=2, max_tokens=4))
    assert [c.message.content for c in response.choices] == [b.text for b in expected[0].sequences]
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"use_beam_search": True}))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(2)]
    assert streamed == [c.message.content for c in response.choices]
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens
    completion_chunks = list(client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=4, stream=True,
                                                       extra_body={"use_beam_search": True}))
    full = client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=4,
                                     extra_body={"use_beam_search": True})
    assert ["".join(c.choices[0].text for c in completion_chunks if c.choices[0].index == i) for i in range(2)] == \
        [c.text for c in full.choices]


@pytest.mark.parametrize("extra, param", [
    ({"use_beam_search": True, "n": 11}, "n"),  # 22 logprobs a step > max_logprobs 20
    ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
    ({"use_beam_search": True, "stop": ["x"]}, "stop"),
    ({"length_penalty": 0.5}, "length_penalty"),  # without beam search it would do nothing
], ids=["too-wide", "top-p", "logprobs", "stop", "length-penalty-alone"])
def test_beam_search_errors(client, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, extra_body=extra)
    assert error_of(excinfo)["param"] == param


# -- 7. truncate_prompt_tokens ---------------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_last_tokens(client) -> None:
    ids = list(range(1000, 1020))
    kept = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0.0,
                                     extra_body={"truncate_prompt_tokens": 5})
    tail = client.completions.create(model="tiny", prompt=ids[-5:], max_tokens=4, temperature=0.0)
    whole = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0.0)
    assert kept.usage.prompt_tokens == 5 and whole.usage.prompt_tokens == 20
    assert kept.choices[0].text == tail.choices[0].text
    assert whole.choices[0].text != tail.choices[0].text  # negative control: the cut changes the output
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 7})
    assert chat.usage.prompt_tokens == 7
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="tiny", prompt=ids, max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN + 1})
    body = error_of(excinfo)
    assert body["param"] == "truncate_prompt_tokens" and "greater than max_model_len" in body["message"]


# -- 8. chat echo with continue_final_message ------------------------------------------------------

def test_chat_echo_with_continue_final_message(client) -> None:
    saying = "Here is a common saying about apple. An apple a day, keeps"
    messages = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}]
    common = dict(model="tiny", messages=messages, max_tokens=6, temperature=0.0)
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(**common, extra_body={**flags, "echo": False}).choices[0].message.content
    echoed = client.chat.completions.create(**common, extra_body={**flags, "echo": True}).choices[0].message.content
    assert saying not in plain  # negative control
    assert echoed == saying + plain
    chunks = list(client.chat.completions.create(**common, stream=True, extra_body={**flags, "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    # The final message is the user's: nothing to echo.
    asked = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0.0,
                                           extra_body={"echo": True}).choices[0].message.content
    assert asked == client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                                   temperature=0.0).choices[0].message.content


# -- 9. custom roles -------------------------------------------------------------------------------

def test_custom_roles_reach_the_chat_template(client, reference) -> None:
    messages = [{"role": "my-custom-role", "content": "what is 1+1?"}]
    as_parts = [{"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0.0,
                                           extra_body={"return_token_ids": True})
    second = client.chat.completions.create(model="tiny", messages=as_parts, max_tokens=5, temperature=0.0)
    assert first.choices[0].message.content == second.choices[0].message.content
    prompt = reference.get_tokenizer().decode(first.prompt_token_ids)
    assert "my-custom-role" in prompt  # the template rendered the role as given
    user = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "what is 1+1?"}],
                                          max_tokens=5, temperature=0.0, extra_body={"return_token_ids": True})
    assert user.prompt_token_ids != first.prompt_token_ids  # negative control: the role is not renamed


# -- 10. unknown fields ----------------------------------------------------------------------------

def test_unknown_fields_are_ignored_with_a_warning(client, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="lm_console.engine.entrypoints.openai.protocol"):
        with_extra = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.0,
                                               extra_body={"temprature": 0.5, "some_future_field": {"a": [1]}})
        chat = client.chat.completions.create(model="tiny", max_tokens=2, temperature=0.0,
                                              messages=[{"role": "user", "content": "hi", "mood": "calm"}])
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.0)
    assert with_extra.choices[0].text == plain.choices[0].text and chat.choices
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert any("'temprature'" in w and "'some_future_field'" in w for w in warnings), warnings
    assert any("'mood'" in w for w in warnings), warnings
    # A known field with a wrong type is still refused: strictness is unchanged.
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens="4")  # type: ignore[arg-type]
    assert error_of(excinfo)["param"] == "max_tokens"


def test_thousands_of_unknown_fields_log_one_bounded_line(http, caplog) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, **{f"x{i}" * 20: i for i in range(5000)}}
    # Nested too: every message of a chat with an unknown key (one warning per body, not per message).
    chat = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi", "mood": i}
                                                           for i in range(60)]}
    with caplog.at_level(logging.WARNING, logger="lm_console.engine.entrypoints.openai.protocol"):
        assert http.post("/v1/completions", json=body).status_code == 200
        lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
        assert len(lines) == 1 and len(lines[0]) < 2000 and "4990 more" in lines[0], lines
        caplog.clear()
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(lines) == 1 and "'mood' (in ChatMessageParam)" in lines[0] and "50 more" in lines[0], lines


# -- 11. chat prompt logprobs ----------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 5])
def test_chat_prompt_logprobs_equal_the_engines(client, reference, k: int) -> None:
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                              extra_body={"prompt_logprobs": k, "return_token_ids": True})
    rows = response.prompt_logprobs
    ids = response.prompt_token_ids
    assert rows[0] is None and len(rows) == len(ids)
    expected = reference.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=k),
                                  use_tqdm=False)[0].prompt_logprobs
    for position, (row, want) in enumerate(zip(rows[1:], expected[1:]), start=1):
        assert str(ids[position]) in row  # the prompt's own token is always there
        assert len(row) in (k, k + 1) and len(row) == len(want)  # top k, plus the token when it is not in them
        assert sorted(e["rank"] for t, e in row.items() if int(t) != ids[position]) == \
            sorted(lp.rank for t, lp in want.items() if t != ids[position])
        for token, entry in row.items():
            assert entry["logprob"] == pytest.approx(want[int(token)].logprob, abs=1e-4)


# -- 12. /invocations ------------------------------------------------------------------------------

def test_invocations_dispatches_on_the_body(http, client) -> None:
    completion = http.post("/invocations", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                                 "temperature": 0.0})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    direct = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.0)
    assert completion.json()["choices"][0]["text"] == direct.choices[0].text
    chat = http.post("/invocations", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4,
                                           "temperature": 0.0})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    direct_chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0.0)
    assert chat.json()["choices"][0]["message"]["content"] == direct_chat.choices[0].message.content
    with http.stream("POST", "/invocations", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                                                    "stream": True}) as streamed:
        events = read_sse(streamed)
    assert events[-1] == "[DONE]" and events[0]["object"] == "text_completion"
    error = assert_openai_error(http.post("/invocations", json={"model": "tiny", "text": "hi"}), 400)
    assert "messages" in error["message"] and "prompt" in error["message"]
    # The routed request keeps its own validation and error shape.
    assert_openai_error(http.post("/invocations", json={"prompt": PROMPT, "max_tokens": -1}), 400, "max_tokens")
    assert_openai_error(http.post("/invocations", content=b"{oops", headers={"content-type": "application/json"}),
                        422)
