"""LLM.embed against transformers: the last hidden state of the same tiny Llama via HF
(AutoModel, i.e. after the final norm and before the LM head), pooled, equals ours.

Tolerance: float32 on both sides, max |difference| <= 1e-5 absolute + 1e-4 relative
(torch.allclose(atol=1e-5, rtol=1e-4)); measured differences are about 1e-7.
Prompts are longer than max_num_batched_tokens, so each prefill spans several steps (MEAN's
running sum across chunks), and each runs twice, so the second LAST run starts from the prefix
cache (MEAN must not). Negative controls: the wrong pooling type, a missing normalisation and
a pooler that loses every chunk but the last must each fail the same comparison.
"""

from __future__ import annotations

import pytest
import torch

from lm_console.engine.sampling_params import PoolingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox jumps over the lazy dog, then runs far away into the forest.",
           "Embeddings turn text into vectors; similar texts should land close to each other.",
           "Hi"]
ATOL, RTOL = 1e-5, 1e-4
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, num_threads=1,
                   max_num_batched_tokens=8, enable_chunked_prefill=True)


@pytest.fixture(scope="module")
def hf_hidden(tiny_llama_dir):
    """prompt -> (token ids, HF last_hidden_state [tokens, hidden])."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    result = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            result[prompt] = ids, model(torch.tensor([ids])).last_hidden_state[0].float()
    return result


def reference(hidden: torch.Tensor, pooling: PoolingParams) -> torch.Tensor:
    vector = hidden[-1] if pooling.pooling_type == "LAST" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector


def matches(outputs, hf_hidden, pooling: PoolingParams) -> bool:  # noqa: ANN001
    ok = True
    for prompt, output in zip(PROMPTS * 2, outputs):
        ids, hidden = hf_hidden[prompt]
        assert output.prompt_token_ids == ids
        ok &= torch.allclose(torch.tensor(output.outputs.embedding), reference(hidden, pooling), atol=ATOL, rtol=RTOL)
    return ok


@pytest.mark.parametrize("pooling", [PoolingParams("LAST", True), PoolingParams("MEAN", True),
                                     PoolingParams("MEAN", False), PoolingParams("LAST", False)],
                         ids=["last-norm", "mean-norm", "mean-raw", "last-raw"])
def test_embed_equals_hf(make_llm, tiny_llama_dir, hf_hidden, pooling: PoolingParams) -> None:
    llm = make_llm(str(tiny_llama_dir), **ENGINE_ARGS)
    outputs = llm.embed(PROMPTS, pooling, use_tqdm=False) + llm.embed(PROMPTS, pooling, use_tqdm=False)
    assert len(outputs[0].outputs.embedding) == hf_hidden[PROMPTS[0]][1].shape[1]
    if pooling.normalize:
        assert all(abs(torch.tensor(o.outputs.embedding).norm().item() - 1.0) < 1e-5 for o in outputs)
    assert matches(outputs, hf_hidden, pooling)
    # A third run through generate(): the prefix cache served the first prompt (over one 16-token
    # block) for LAST only; MEAN recomputed every prompt.
    from lm_console.engine.sampling_params import SamplingParams

    again = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling), use_tqdm=False)
    cached = [output.num_cached_tokens for output in again]
    assert (cached[0] > 0 if pooling.pooling_type == "LAST" else cached == [0, 0]), cached
    assert all(torch.allclose(torch.tensor(o.pooled), torch.tensor(e.outputs.embedding), atol=ATOL, rtol=RTOL)
               for o, e in zip(again, outputs))
    # Negative controls on these very outputs: the other pooling type, the other normalisation.
    other_type = PoolingParams("MEAN" if pooling.pooling_type == "LAST" else "LAST", pooling.normalize)
    assert not matches(outputs, hf_hidden, other_type)
    assert not matches(outputs, hf_hidden, PoolingParams(pooling.pooling_type, not pooling.normalize))


def test_embed_negative_control_lost_chunks(make_llm, tiny_llama_dir, hf_hidden) -> None:
    """A pooler that forgets the sum of the earlier chunks (MEAN over the last chunk only,
    divided by the whole prompt's length) must fail the comparison."""
    from lm_console.engine.worker.pooling import Pooler

    real = Pooler.pool

    def forgetful(self, hidden_states, inputs, states):  # noqa: ANN001, ANN202
        self._sums.clear()
        for row, state in enumerate(states):
            if state is not None and int(inputs.num_computed[row]) > 0:
                self._sums[state.req_id] = torch.zeros(hidden_states.shape[1])
        return real(self, hidden_states, inputs, states)

    pooling = PoolingParams("MEAN", True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Pooler, "pool", forgetful)
        llm = make_llm(str(tiny_llama_dir), multiprocess=False, **ENGINE_ARGS)
        outputs = llm.embed(PROMPTS, pooling, use_tqdm=False) * 2
    assert not matches(outputs, hf_hidden, pooling)


def test_pooling_params_validation() -> None:
    from lm_console.engine.errors import InvalidSamplingParamsError
    from lm_console.engine.sampling_params import SamplingParams

    assert PoolingParams("mean").pooling_type == "MEAN"
    with pytest.raises(InvalidSamplingParamsError, match="pooling_type='CLS' is invalid: use one of LAST, MEAN"):
        PoolingParams("CLS")
    with pytest.raises(InvalidSamplingParamsError, match="max_tokens=1, n=1"):
        SamplingParams(max_tokens=5, pooling=PoolingParams())
