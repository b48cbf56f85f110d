"""The `lmc serve` flags of tool calling and embeddings, through the real CLI process:
--enable-auto-tool-choice / --tool-call-parser reach the chat route, --pooler-config the
embeddings route, and bad values stop the command with exit code 2 and the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
import torch

from openai_server_helpers import REPO_ROOT, ServeProcess

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_flags_reach_the_routes(tiny_llama_dir) -> None:
    from transformers import AutoModel, AutoTokenizer

    server = ServeProcess(str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "256", "--num-blocks", "64",
                          "--num-threads", "1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                          "--pooler-config", '{"pooling_type": "MEAN", "normalize": false}')
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
            model = client.models.list().data[0].id
            regex = BLOCK.replace("{", "\\{").replace("}", "\\}").replace("\n", "\\n")
            reply = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=60,
                                                   extra_body={"structured_outputs": {"regex": regex}})
            [call] = reply.choices[0].message.tool_calls  # auto (the default with tools) is served
            assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
            vector = torch.tensor(client.embeddings.create(model=model, input="Hello there",
                                                           encoding_format="float").data[0].embedding)
    finally:
        server.stop()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    hf = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.inference_mode():
        hidden = hf(torch.tensor([tokenizer("Hello there")["input_ids"]])).last_hidden_state[0]
    assert torch.allclose(vector, hidden.mean(dim=0), atol=1e-5, rtol=1e-4)  # MEAN, not normalised
    assert not torch.allclose(vector, torch.nn.functional.normalize(hidden.mean(dim=0), dim=0), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("flags, message", [
    (["--enable-auto-tool-choice"], "needs a tool_call_parser"),
    (["--tool-call-parser", "mistral"], "tool_call_parser 'mistral' is unknown; known: hermes"),
    (["--pooler-config", '{"pooling_type": "CLS"}'], "use one of LAST, MEAN"),
    (["--pooler-config", '{"pooling": "MEAN"}'], "unexpected keyword argument 'pooling' (keys: pooling_type, normalize)"),
    (["--pooler-config", "MEAN"], "--pooler-config"),
])
def test_bad_flags_exit_2(flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "lm_console.cli", "serve", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 2, done.stderr
    text = " ".join(done.stderr.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())  # typer's box, unwrapped
    assert message in text, done.stderr
