"""The OpenAI API through the official `openai` client (sync and async) against a live server.

The server runs a tiny random Llama in a thread of this process (engine core in its own
process); greedy outputs must equal LLM.generate / LLM.chat on the same model and settings.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.version import __version__
from openai_server_helpers import ThreadServer, parse_metrics, read_sse, sample_value

pytestmark = pytest.mark.slow

ENGINE_ARGS = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=512, num_threads=1,
                   stat_loggers=[])
PROMPT = "The history of computing is a story of"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    srv = ThreadServer(str(tiny_llama_dir), ServerSettings(served_model_names=("tiny", "tiny-alias")), **ENGINE_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512, num_gpu_blocks_override=512, num_threads=1)
    yield llm
    llm.shutdown()


def test_models_health_version(server, client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    with httpx.Client(base_url=server.url) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").json()["version"] == __version__  # the one source `lmc --version` prints
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 512


def test_greedy_completion_equals_llm_generate(client, reference) -> None:
    expected = reference.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0)
    choice = response.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.usage.prompt_tokens_details.cached_tokens >= 0
    assert response.object == "text_completion" and response.model == "tiny"


def test_greedy_chat_equals_llm_chat(client, reference) -> None:
    expected = reference.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    response = client.chat.completions.create(model="tiny-alias", messages=MESSAGES, max_completion_tokens=20,
                                              temperature=0.0)
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.object == "chat.completion" and response.model == "tiny-alias"


def test_streaming_with_usage_matches_full_response(client) -> None:
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0.0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)

    chat_full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0.0)
    stream = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0.0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        chat_full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    assert finish == [chat_full.choices[0].finish_reason]
    assert stream[-1].usage.total_tokens == chat_full.usage.total_tokens


def test_sse_frames_exactly_as_openai_sends_them(server) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0.0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    assert all(frame.startswith("data: {") for frame in frames[:-2])


def test_n2_logprobs_and_stop(client) -> None:
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=2,
                                         logprobs=3)
    assert sorted(c.index for c in response.choices) == [0, 1]
    for choice in response.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 12
        assert "".join(logprobs.tokens) == choice.text
        assert all(1 <= len(top) <= 4 for top in logprobs.top_logprobs)
        assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert response.usage.completion_tokens == 24

    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0,
                                          logprobs=True, top_logprobs=2, n=2)
    assert len(chat.choices) == 2
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(entry.top_logprobs) == 2 for entry in content)
    # Greedy: the chosen token is the most likely one.
    assert all(entry.top_logprobs[0].logprob == pytest.approx(entry.logprob) for entry in content)

    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0).choices[0].text
    stop = greedy[len(greedy) // 2: len(greedy) // 2 + 3]
    assert stop.strip(), greedy
    stopped = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == stop
    assert stopped.choices[0].text == greedy[:greedy.index(stop)]


def test_seed_reproducibility(client) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1


def test_async_client_concurrent_requests(server) -> None:
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            async def stream_chat(i: int) -> str:
                text = []
                stream = await c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=10,
                    temperature=0.0, stream=True)
                async for chunk in stream:
                    if chunk.choices:
                        text.append(chunk.choices[0].delta.content or "")
                return "".join(text)

            streamed = await asyncio.gather(*(stream_chat(i) for i in range(6)))
            full = await asyncio.gather(*(c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=10,
                temperature=0.0) for i in range(6)))
            return streamed, [r.choices[0].message.content for r in full]

    streamed, full = asyncio.run(main())
    assert streamed == full
    assert server.wait_idle().all_free


def test_completion_prompt_forms_echo_and_extras(server, client) -> None:
    tokenizer = server.engine.get_tokenizer()
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0.0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="tiny", prompt=[PROMPT, "Gardens teach"], max_tokens=6, temperature=0.0,
                                      n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == by_text.choices[0].text
    token_batch = client.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=6, temperature=0.0)
    assert token_batch.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.0, echo=True)
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text
    extras = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.8, seed=3,
        extra_body={"top_k": 5, "min_p": 0.05, "min_tokens": 10, "ignore_eos": True, "repetition_penalty": 1.2,
                    "return_token_ids": True, "truncate_prompt_tokens": 4})
    assert extras.usage.prompt_tokens == 4 and extras.usage.completion_tokens == 10
    first = extras.choices[0]
    assert len(first.model_extra["token_ids"]) == 10 and first.model_extra["prompt_token_ids"] == ids[-4:]


def test_cache_salt_separates_prefix_cache(client) -> None:
    prompt = PROMPT * 8  # several full blocks

    def cached(**extra: object) -> int:
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0.0,
                                             extra_body=extra)
        return response.usage.prompt_tokens_details.cached_tokens

    cached(cache_salt="alice")
    assert cached(cache_salt="alice") > 0
    assert cached(cache_salt="bob") == 0


def test_prompt_logprobs_and_echo_with_logprobs(client, reference) -> None:
    expected, = reference.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2),
                                   use_tqdm=False)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0.0,
                                         extra_body={"prompt_logprobs": 2})
    rows = response.choices[0].model_extra["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(expected.prompt_token_ids)
    for row, want in zip(rows[1:], expected.prompt_logprobs[1:]):
        assert {int(t): (v["logprob"], v["rank"], v["decoded_token"]) for t, v in row.items()} == {
            t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in want.items()}
    # echo + logprobs: the prompt's tokens come first (the first with no logprob), then the completion's.
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0.0, echo=True,
                                       logprobs=1)
    logprobs = echoed.choices[0].logprobs
    num_prompt = len(expected.prompt_token_ids)
    assert len(logprobs.tokens) == num_prompt + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, num_prompt):
        token = expected.prompt_token_ids[position]
        assert logprobs.token_logprobs[position] == pytest.approx(expected.prompt_logprobs[position][token].logprob)
    assert echoed.choices[0].text.startswith(PROMPT)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    chat_rows = chat.model_extra["prompt_logprobs"]
    assert chat_rows[0] is None and all(len(row) == 1 for row in chat_rows[1:])


def test_n_choices_share_one_prompt_logprobs_build(client, monkeypatch) -> None:
    """n=3: every choice carries the same prompt logprobs, built once per prompt, not once per choice."""
    from lm_console.engine.entrypoints.openai import serving_completion

    built_rows: list[object] = []
    echo_builds: list[list[int]] = []
    real_json, real_completion = serving_completion.prompt_logprobs_json, serving_completion.completion_logprobs

    def count_json(rows):  # noqa: ANN001, ANN202
        built_rows.append(rows)
        return real_json(rows)

    def count_completion(token_ids, steps, token_text, text_offset):  # noqa: ANN001, ANN202
        echo_builds.append(list(token_ids))
        return real_completion(token_ids, steps, token_text, text_offset)

    monkeypatch.setattr(serving_completion, "prompt_logprobs_json", count_json)
    monkeypatch.setattr(serving_completion, "completion_logprobs", count_completion)
    prompts = [PROMPT, "Once upon a time"]
    response = client.completions.create(model="tiny", prompt=prompts, max_tokens=3, n=3, temperature=1.0,
                                         seed=7, extra_body={"prompt_logprobs": 1})
    assert len(response.choices) == 6 and len(built_rows) == 2  # one build per prompt
    for p in range(2):
        rows = [choice.model_extra["prompt_logprobs"] for choice in response.choices[3 * p:3 * p + 3]]
        assert rows[0] is not None and rows[0][0] is None and rows[1] == rows[0] and rows[2] == rows[0]
    assert response.choices[0].model_extra["prompt_logprobs"] != response.choices[3].model_extra["prompt_logprobs"]

    # echo + logprobs: the echoed prompt tokens' logprobs are built once, each choice then adds its own.
    echo_builds.clear()
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, n=3, temperature=1.0, seed=7,
                                       echo=True, logprobs=1)
    num_prompt = echoed.usage.prompt_tokens
    prompt_builds = [ids for ids in echo_builds if len(ids) == num_prompt]
    assert len(prompt_builds) == 1 and len(echo_builds) == 1 + 3
    heads = [(c.logprobs.tokens[:num_prompt], c.logprobs.token_logprobs[:num_prompt],
              c.logprobs.text_offset[:num_prompt]) for c in echoed.choices]
    assert heads[1] == heads[0] and heads[2] == heads[0]
    for choice in echoed.choices:
        assert len(choice.logprobs.tokens) == num_prompt + 3 and choice.text.startswith(PROMPT)
        # offsets continue from the echoed text, per choice
        assert choice.logprobs.text_offset[num_prompt] == heads[0][2][-1] + len(heads[0][0][-1])


def test_tokenize_detokenize(server, client) -> None:
    tokenizer = server.engine.get_tokenizer()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        tokens = http.post("/tokenize", json={"model": "tiny", "prompt": PROMPT}).json()
        assert tokens["tokens"] == tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
        assert tokens["max_model_len"] == 512
        text = http.post("/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}).json()
        assert text == {"prompt": PROMPT}
        chat = http.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True}).json()
        usage = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1).usage
        assert chat["count"] == usage.prompt_tokens and len(chat["token_strs"]) == chat["count"]


def test_streaming_chat_n2_indices(server) -> None:
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0.0, "stream": True, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.Client(base_url=server.url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = read_sse(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts[0] == texts[1] and texts[0]
    assert all(chunk["usage"] is not None for chunk in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def aborted_requests(server) -> float:
    """vllm:request_success{finished_reason="abort"} from /metrics."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        families = parse_metrics(http.get("/metrics").text)
    return sample_value(families, "vllm:request_success", "_total", finished_reason="abort")


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_client_disconnect_aborts_the_request_at_once(server, stream) -> None:
    import json
    import socket
    import time

    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                       "temperature": 0.0, "stream": stream}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    steps_before = server.call(server.engine.get_stats()).num_steps
    aborted_before = aborted_requests(server)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while server.call(server.engine.get_stats()).num_running_reqs == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    # The socket is closed: the server must abort the request long before its 400 tokens.
    assert server.wait_idle().all_free
    assert server.call(server.engine.get_stats()).num_steps - steps_before < 200
    assert aborted_requests(server) == aborted_before + 1
