"""The Triton attention backend against the torch one: on CPU under Triton's interpreter, on a
GPU compiled (and with CUDA graphs for the decode steps of the end-to-end test).

Triton fixes interpretation when it is first imported, and other tests import it early (through
torch._dynamo), so without a GPU this module sets TRITON_INTERPRET=1 when it is collected.
"""

from __future__ import annotations

import dataclasses
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from lm_console.engine.attention import get_attention_layers, torch_backend
from lm_console.engine.attention.torch_backend import CpuAttentionBackend
from lm_console.engine.attention.selector import load_attention_backend, resolve_attention_backend
from lm_console.engine.config import EngineArgs
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.sampling_params import SamplingParams
from test_torch_backend import MIXED, _make_batch

CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_selection_defaults_to_the_c_kernels_on_cpu():
    assert resolve_attention_backend("auto", CPU) == "cpu"
    assert resolve_attention_backend("auto", torch.device("cuda")) == "triton"
    assert type(load_attention_backend("auto", CPU)) is CpuAttentionBackend
    assert load_attention_backend("torch", CPU).name == "torch"
    with pytest.raises(InvalidEngineArgsError, match="C kernels on the CPU"):
        resolve_attention_backend("cpu", torch.device("cuda"))
    with pytest.raises(InvalidEngineArgsError, match="attention_backend"):
        resolve_attention_backend("flash", CPU)
    with pytest.raises(InvalidEngineArgsError, match="attention_backend"):
        EngineArgs(attention_backend="flash").create_engine_config()


@pytest.mark.parametrize("requests,window", [
    (MIXED, None),  # prefill chunks + decodes: the unified kernel
    ([(40, 1), (3, 1), (130, 1)], 24),  # few decodes: the split-KV kernel, sliding window
], ids=["mixed", "split_decode"])
def test_backend_matches_torch_backend(requests, window):
    triton_backend = load_attention_backend("triton", DEVICE)
    batch = _make_batch(requests, 8, 2, 16, torch.float32, num_pad_tokens=2)
    q, k, v, kv_cache = (t.to(DEVICE) for t in batch[:4])
    md = dataclasses.replace(batch[4], **{f.name: getattr(batch[4], f.name).to(DEVICE)
                                          for f in dataclasses.fields(batch[4])
                                          if isinstance(getattr(batch[4], f.name), torch.Tensor)})
    kv_ref = kv_cache.clone()
    out = triton_backend.forward(q, k, v, kv_cache, md, 2, 0.25, window, 4.0)
    ref = torch_backend.paged_attention(q, k, v, kv_ref, md, 2, 0.25, window, 4.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # padding rows: zero in both
    assert torch.equal(kv_cache, kv_ref)  # same slots written, -1 skipped


@pytest.mark.slow
@pytest.mark.parametrize("model_fixture", ["tiny_mistral_dir", "tiny_gemma3_dir"])
def test_tiny_model_greedy_tokens_match_torch_backend(model_fixture, request, make_llm):
    """Chunked prefills, mixed batches and decodes through the kernels; sliding window 24.

    Mistral: one sliding-window KV cache group; Gemma3: hybrid groups, each layer reading its
    group's block table (null blocks behind the window). On a GPU the Triton run replays CUDA
    graphs for the single-group model's decode steps (padded batches)."""
    model_dir = request.getfixturevalue(model_fixture)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(n)]}
               for n in (45, 9, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = make_llm(str(model_dir), dtype="float32", device=DEVICE.type,
                       max_model_len=256, max_num_batched_tokens=32,
                       num_gpu_blocks_override=64, attention_backend=backend,
                       multiprocess=False)
        runner = llm.engine_core.engine_core.model_executor.worker.model_runner
        layers = get_attention_layers(runner.model)
        names = {layer.backend.name for layer in layers}
        assert names == {backend}
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 6 for t in tokens["torch"])
