"""LoRA over real HTTP with the official openai client: `lmc serve --enable-lora --lora-modules
name=path`, adapters listed in /v1/models with their parent and chosen by `model`, loaded and
unloaded at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), vllm:lora_requests_info."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from openai_server_helpers import REPO_ROOT, ServeProcess, parse_metrics

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lora"))

PROMPT = [300 + i for i in range(40)]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    pytest.importorskip("peft")
    from lora_helpers import make_adapter

    root = tmp_path_factory.mktemp("serve-adapters")
    return {name: make_adapter(tiny_llama_dir, root / name, rank=8, alpha=16, seed=seed)
            for name, seed in (("alpha", 1), ("beta", 2), ("gamma", 3))}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters):
    srv = ServeProcess(str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "256", "--num-blocks", "64",
                       "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                       "--lora-modules", f"alpha={adapters['alpha']}", "--lora-modules", f"beta={adapters['beta']}",
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "LMC_MULTIPROCESS": "1"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir, adapters):
    """The same engine offline: what each adapter answers to PROMPT (8 greedy tokens)."""
    from lm_console.engine import LLM, SamplingParams
    from lm_console.engine.lora import LoRARequest

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              multiprocess=False, enable_lora=True, max_loras=3, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        answers = {}
        for i, name in enumerate([None, "alpha", "beta", "gamma"]):
            lora = None if name is None else LoRARequest(name, i, str(adapters[name]))
            (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False, lora_request=lora)
            answers[name] = out.outputs[0].token_ids
    finally:
        llm.shutdown()
    assert len({tuple(v) for v in answers.values()}) == 4, "the adapters must change the output"
    return answers


def _tokens(client: openai.OpenAI, model: str) -> list[int]:
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                           extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                                           logprobs=0)
    return [int(t.split(":")[1]) for t in completion.choices[0].logprobs.tokens]


def test_models_lists_the_adapters_with_their_parent(client, adapters) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "alpha", "beta"}
    assert models["alpha"].parent == "tiny" and models["alpha"].root == str(adapters["alpha"])
    assert models["tiny"].parent is None


def test_model_chooses_the_adapter(client, offline) -> None:
    assert _tokens(client, "alpha") == offline["alpha"]
    assert _tokens(client, "beta") == offline["beta"]
    assert _tokens(client, "tiny") == offline[None]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _tokens(client, "gamma")


def test_runtime_load_and_unload(client, server, adapters, offline) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(adapters["gamma"])})
        assert loaded.status_code == 200 and "gamma" in loaded.text, loaded.text
        assert "gamma" in {m.id for m in client.models.list().data}
        assert _tokens(client, "gamma") == offline["gamma"]
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(adapters["gamma"])})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": "/nonexistent/adapter"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        assert "not a directory" in bad.json()["error"]["message"]
        extra = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/p", "rank": 4})
        assert extra.status_code == 400
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
        assert unloaded.status_code == 200 and "gamma" in unloaded.text
        missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
        assert missing.status_code == 404 and "cannot be found" in missing.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        _tokens(client, "gamma")
    # loaded again under the same name: a new id, the same answers
    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.post("/v1/load_lora_adapter",
                         json={"lora_name": "gamma", "lora_path": str(adapters["gamma"])}).status_code == 200
    assert _tokens(client, "gamma") == offline["gamma"]
    # The module's server is shared: leave it with the adapters it started with.
    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 200


def test_lora_requests_info_gauge(client, server) -> None:
    _tokens(client, "alpha")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        families = parse_metrics(http.get("/metrics").text)
    samples = families["vllm:lora_requests_info"].samples
    assert len(samples) == 1
    labels = samples[0].labels
    assert labels["max_lora"] == "2" and set(labels) >= {"running_lora_adapters", "waiting_lora_adapters"}
    assert samples[0].value > 1e9  # set to the time it was last updated (vLLM's convention)


def test_runtime_updates_are_off_without_the_switch_and_bad_modules_stop_the_start(tiny_llama_dir, tmp_path) -> None:
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}
    srv = ServeProcess(str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "256", "--num-blocks", "32",
                       "--enable-lora", env=env)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            response = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)})
        assert response.status_code == 404
    finally:
        srv.stop()
    result = subprocess.run([sys.executable, "-m", "lm_console.cli", "serve", str(tiny_llama_dir), "--port", "0",
                             "--dtype", "float32", "--max-model-len", "256", "--num-blocks", "32", "--enable-lora",
                             "--lora-modules", f"bad={tmp_path}"], capture_output=True, text=True, timeout=300,
                            cwd=REPO_ROOT)
    assert result.returncode == 2 and "--lora-modules" in result.stderr and "adapter_config.json" in result.stderr
    result = subprocess.run([sys.executable, "-m", "lm_console.cli", "serve", str(tiny_llama_dir), "--port", "0",
                             "--lora-modules", f"bad={tmp_path}"], capture_output=True, text=True, timeout=300,
                            cwd=REPO_ROOT)
    assert result.returncode == 2 and "needs --enable-lora" in result.stderr


def test_responses_and_embeddings_run_the_chosen_adapter(client) -> None:
    """/v1/responses and /v1/embeddings take the adapter from `model` as completions do: each
    adapter answers as chat completions does with it, and differently from the base model (the
    negative control: a route that dropped the adapter would answer as "tiny")."""
    def chat(model: str) -> str:
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there"}],
                                              max_tokens=10, temperature=0.0,
                                              extra_body={"ignore_eos": True}).choices[0].message.content or ""

    def responses(model: str) -> str:
        return client.responses.create(model=model, input="Hello there", max_output_tokens=10,
                                       temperature=0.0, extra_body={"ignore_eos": True}).output_text

    answers = {model: responses(model) for model in ("tiny", "alpha", "beta")}
    assert answers == {model: chat(model) for model in answers}
    assert len(set(answers.values())) == 3, answers

    def embed(model: str) -> list[float]:
        return client.embeddings.create(model=model, input=[PROMPT]).data[0].embedding

    vectors = {model: embed(model) for model in ("tiny", "alpha", "beta")}
    assert vectors["alpha"] == embed("alpha")
    assert vectors["tiny"] != vectors["alpha"] and vectors["tiny"] != vectors["beta"]
    assert vectors["alpha"] != vectors["beta"]
