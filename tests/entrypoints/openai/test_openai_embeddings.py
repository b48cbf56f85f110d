"""/v1/embeddings over HTTP with the official openai client: string, list and token-id inputs,
float and base64 encodings, usage, `dimensions` refused, and the server's --pooler-config.

The vectors are checked against LLM.embed's path through the engine by way of the HF reference
(tests/frontend/test_embed.py checks that path against transformers); here: float and base64
carry the same numbers, token ids give what their text gives, and MEAN (this server's pooler
config) is not LAST (negative control: the LAST reference computed with HF must not match).
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from openai_server_helpers import ThreadServer

ENGINE_ARGS = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, num_threads=1, stat_loggers=[])
TEXTS = ["A first sentence to embed.", "Another, rather different one."]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from lm_console.engine.entrypoints.openai.settings import ServerSettings
    from lm_console.engine.sampling_params import PoolingParams

    settings = ServerSettings(served_model_names=("tiny",), pooler_config=PoolingParams("MEAN", True))
    srv = ThreadServer(str(tiny_llama_dir), settings, **ENGINE_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModel, AutoTokenizer

    return (AutoTokenizer.from_pretrained(tiny_llama_dir),
            AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval())


def hf_embedding(hf, text: str, pooling_type: str) -> torch.Tensor:  # noqa: ANN001
    tokenizer, model = hf
    with torch.inference_mode():
        hidden = model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0]
    vector = hidden.mean(dim=0) if pooling_type == "MEAN" else hidden[-1]
    return torch.nn.functional.normalize(vector, dim=0)


def test_float_and_base64(client, hf) -> None:
    as_float = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in as_float.data] == [0, 1] and as_float.model == "tiny"
    tokenizer = hf[0]
    num_tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert as_float.usage.prompt_tokens == num_tokens == as_float.usage.total_tokens
    for text, item in zip(TEXTS, as_float.data):
        ours = torch.tensor(item.embedding)
        assert torch.allclose(ours, hf_embedding(hf, text, "MEAN"), atol=1e-5, rtol=1e-4)
        assert not torch.allclose(ours, hf_embedding(hf, text, "LAST"), atol=1e-5, rtol=1e-4)  # negative control
    # The client's default is base64, which it decodes to floats itself.
    as_base64 = client.embeddings.create(model="tiny", input=TEXTS)
    assert [d.embedding for d in as_base64.data] == [d.embedding for d in as_float.data]
    raw = httpx.post(f"{client.base_url}embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4").tolist()
    assert decoded == as_float.data[0].embedding


def test_token_ids_and_single_string(client, hf) -> None:
    ids = hf[0](TEXTS[1])["input_ids"]
    by_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    by_id_lists = client.embeddings.create(model="tiny", input=[ids, ids[:3]], encoding_format="float")
    by_text = client.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float")
    assert by_ids.data[0].embedding == by_text.data[0].embedding == by_id_lists.data[0].embedding
    assert by_id_lists.data[1].embedding != by_ids.data[0].embedding
    assert by_ids.usage.prompt_tokens == len(ids) and by_id_lists.usage.prompt_tokens == len(ids) + 3


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": ""}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [10**9]}, "input"),  # a token id outside the vocabulary
])
def test_errors(client, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/embeddings", body={"model": "tiny", **body}, cast_to=object)
    assert caught.value.status_code == 400 and param in str(caught.value.body)
