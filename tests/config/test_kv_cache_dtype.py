"""kv_cache_dtype: what "auto" resolves to, what is refused, and engines running the int8 cache."""

from __future__ import annotations

import pytest
import torch

from lm_console.engine.config import EngineArgs
from lm_console.engine.config.cache import resolve_kv_cache_dtype
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.kernels import cpu_attention

pytestmark = pytest.mark.slow

QUANTIZED_CPU = dict(dtype="bfloat16", device="cpu", quantization="gguf", head_dim=64, num_heads=9, num_kv_heads=3,
                     block_size=16, attention_backend="auto")


@pytest.fixture
def kernels_serve(monkeypatch):
    """Pretend the int8 cache's C kernels do (True) or do not (False) take the model here;
    records the shapes asked about."""
    from lm_console.engine.config import cache as cache_config_module

    asked: list[tuple[int, ...]] = []

    def set_answer(answer: bool) -> list[tuple[int, ...]]:
        def serve(*shape: int) -> bool:
            asked.append(shape)
            return answer

        monkeypatch.setattr(cache_config_module, "int8_kernels_serve", serve)
        return asked

    return set_answer


def test_auto_takes_int8_only_where_the_weights_run_quantized_on_the_cpu(kernels_serve):
    asked = kernels_serve(True)
    assert resolve_kv_cache_dtype("auto", **QUANTIZED_CPU) == "int8"
    assert asked == [(64, 9, 3, 16)]  # the kernels are asked about the model's own shape
    assert resolve_kv_cache_dtype("auto", **{**QUANTIZED_CPU, "quantization": "int8"}) == "int8"
    for change in ({"quantization": None}, {"dtype": "float32"}, {"device": "cuda"}, {"attention_backend": "triton"}):
        expected = change.get("dtype", "bfloat16")
        assert resolve_kv_cache_dtype("auto", **{**QUANTIZED_CPU, **change}) == expected, change
    kernels_serve(False)  # no kernel takes the shape here (no AVX512-BF16, 96 heads, head_dim 80, ...)
    assert resolve_kv_cache_dtype("auto", **QUANTIZED_CPU) == "bfloat16"


def test_auto_asks_the_real_kernels_about_the_shape(monkeypatch):
    from lm_console.engine.config.cache import int8_kernels_serve

    for shape in ((80, 9, 3, 16), (64, 96, 8, 16), (64, 34, 2, 16), (64, 4, 2, 128)):
        assert not int8_kernels_serve(*shape), shape
    assert int8_kernels_serve(64, 9, 3, 16) == cpu_attention.supports_int8(64, 9, 3)
    monkeypatch.setenv("LMC_CPU_KERNELS", "0")
    assert not int8_kernels_serve(64, 9, 3, 16)


def test_explicit_values_are_checked_never_ignored(kernels_serve, caplog):
    kernels_serve(False)
    with caplog.at_level("WARNING", logger="lm_console.engine.config.cache"):
        assert resolve_kv_cache_dtype("int8", **{**QUANTIZED_CPU, "quantization": None, "head_dim": 16}) == "int8"
    assert "attention runs on the torch path" in caplog.text
    assert resolve_kv_cache_dtype("bfloat16", **QUANTIZED_CPU) == "bfloat16"
    with pytest.raises(InvalidEngineArgsError, match="CPU only"):
        resolve_kv_cache_dtype("int8", **{**QUANTIZED_CPU, "device": "cuda"})
    with pytest.raises(InvalidEngineArgsError, match="triton"):
        resolve_kv_cache_dtype("int8", **{**QUANTIZED_CPU, "attention_backend": "triton"})
    with pytest.raises(InvalidEngineArgsError, match="differs from the model's dtype 'bfloat16'"):
        resolve_kv_cache_dtype("float16", **QUANTIZED_CPU)
    with pytest.raises(InvalidEngineArgsError, match="no fp8 KV cache here"):
        EngineArgs(kv_cache_dtype="fp8_e4m3")._verify()
    with pytest.raises(InvalidEngineArgsError, match="kv_cache_dtype="):
        EngineArgs(kv_cache_dtype=8)._verify()  # type: ignore[arg-type]


def _prompt_logprobs(llm, prompt: list[int]) -> torch.Tensor:
    from lm_console.engine import SamplingParams

    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([lp[token].logprob for token, lp in zip(prompt[1:], out.prompt_logprobs[1:])])


@pytest.mark.parametrize("model_fixture", ["tiny_llama_d64_dir", "tiny_llama_dir"], ids=["kernels", "torch-path"])
def test_an_engine_on_the_int8_cache_holds_more_blocks_and_scores_as_the_bf16_one(model_fixture, request, make_llm):
    """head_dim 64 runs the int8 cache's kernels where the CPU has AVX512-BF16; head_dim 16 the
    torch path. The cache is int8, the same memory budget holds ~2x the blocks, and the prompt's
    log-likelihoods are as close to a float32 engine's (same int8 weights, float32 cache) as the
    bf16 cache's are: the random model's are -20 to -60 nats, bf16 rounding alone moves single
    ones by up to ~2% (more on a CPU without AVX512-BF16), a misread cache moves them all by units."""
    model = str(request.getfixturevalue(model_fixture))
    prompt = torch.randint(3, 400, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    engines = {kv: make_llm(model, dtype="bfloat16", quantization="int8", kv_cache_dtype=kv, multiprocess=False,
                            kv_cache_memory=8 << 20)
               for kv in ("bfloat16", "int8")}
    runners = {kv: llm.engine_core.engine_core.model_executor.worker.model_runner for kv, llm in engines.items()}
    assert all(cache.dtype == torch.int8 for cache in runners["int8"].kv_caches)
    assert engines["int8"].config.cache_config.kv_cache_dtype == "int8"
    head_dim = runners["int8"].head_dim
    blocks = {kv: llm.config.cache_config.num_blocks for kv, llm in engines.items()}
    assert blocks["int8"] / blocks["bfloat16"] == pytest.approx(2 * head_dim / (head_dim + 4), rel=0.02)
    if model_fixture == "tiny_llama_d64_dir" and cpu_attention.supports_int8(64, 4, 2):
        q = torch.zeros(1, 4 * 64, dtype=torch.bfloat16)
        assert cpu_attention.supports(q, runners["int8"].kv_caches[0])  # the kernels serve it
    exact = make_llm(model, dtype="float32", quantization="int8", kv_cache_dtype="float32", multiprocess=False,
                     kv_cache_memory=8 << 20)
    reference = _prompt_logprobs(exact, prompt)
    error = {kv: (_prompt_logprobs(engines[kv], prompt) - reference).abs() / reference.abs() for kv in engines}
    assert error["int8"].mean().item() <= 1.25 * error["bfloat16"].mean().item() + 0.002, error
    assert error["int8"].max().item() < 0.05, error
