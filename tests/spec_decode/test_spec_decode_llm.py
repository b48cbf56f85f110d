"""Greedy outputs with speculative decoding equal those without, token for token, on the tiny
Llama (fp32, in-process) and the embedded model (slow): stop token ids, stop strings, max_tokens
and EOS mid-proposal, logprobs, prefix hits, forced preemption, n > 1, aborts; no KV block leaks.

A random tiny model never copies its prompt, so the model-free proposers would hardly propose
on it. Its engines get an *oracle* proposer instead: the reference continuation, corrupted at a
random position in a third of the proposals, so steps accept all, some and none of their drafts.
The embedded model runs the real ngram and suffix proposers on a copy-friendly prompt.
Structured requests verify drafts cut by their grammar, under its bitmask after each draft.
Negative controls: a rejection sampler that accepts one draft too many, and a bitmask on the
first verification row only, must each fail the check.
"""

from __future__ import annotations

import random

import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.core.engine_core import EngineCore
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.protocol import EngineCoreRequest
from lm_console.engine.sample import rejection_sampler
from llm_helpers import _TEXT, assert_aborts_cut_outputs, assert_all_equal, assert_no_leaked_blocks, random_prompts

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="float32", multiprocess=False)
# Drafts at every batch size ("auto" would stop them from 24 running requests on the CPU): these
# tests check the mechanism on batches of 50.
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}
FREE = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
NUM_PROMPTS = 50


class OracleProposer:
    """Proposes the continuation of the known sequence that the request's tokens start; a third
    of the proposals get one token changed (a rejection at that position)."""

    def __init__(self, sequences: list[list[int]], vocab_size: int, seed: int = 0) -> None:
        self.sequences = sequences
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.num_proposals = 0

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        for sequence in self.sequences:
            if len(sequence) > len(token_ids) and sequence[:len(token_ids)] == token_ids:
                proposal = sequence[len(token_ids):len(token_ids) + max_tokens]
                if proposal and self.rng.random() < 1 / 3:
                    i = self.rng.randrange(len(proposal))
                    proposal[i] = (proposal[i] + 1) % self.vocab_size
                self.num_proposals += bool(proposal)
                return proposal
        return []

    def forget(self, request_id: str) -> None:
        """Stateless."""


def _outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):  # noqa: ANN202
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text,
              None if c.logprobs is None else [{t: round(lp.logprob, 4) for t, lp in row.items()} for row in c.logprobs])
             for c in o.outputs] for o in outputs]


def _core(llm: LLM) -> EngineCore:
    return llm.engine_core.engine_core  # InprocClient


@pytest.fixture(scope="module")
def vocab_size(tiny_llama_dir) -> int:  # noqa: ANN001
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_llama_dir).vocab_size


@pytest.fixture(scope="module")
def prompts(vocab_size) -> list[list[int]]:  # noqa: ANN001
    return random_prompts(vocab_size, NUM_PROMPTS, 5, 60, seed=5)


@pytest.fixture(scope="module")
def base(tiny_llama_dir):  # noqa: ANN001, ANN201
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    yield llm
    assert_no_leaked_blocks(llm)
    llm.shutdown()


@pytest.fixture(scope="module")
def free_outputs(base, prompts):  # noqa: ANN001, ANN201
    return _outputs(base, prompts, FREE)


def _oracle_llm(make_llm, model_dir, prompts, free_outputs, vocab_size, **engine_args) -> LLM:  # noqa: ANN001
    llm = make_llm(str(model_dir), speculative_config=SPEC, **ENGINE, **engine_args)
    oracle = OracleProposer([p + out[0][0] for p, out in zip(prompts, free_outputs)], vocab_size)
    _core(llm).scheduler.proposer = oracle
    return llm


@pytest.fixture
def spec(make_llm, tiny_llama_dir, prompts, free_outputs, vocab_size) -> LLM:  # noqa: ANN001
    return _oracle_llm(make_llm, tiny_llama_dir, prompts, free_outputs, vocab_size)


def _stats(llm: LLM):  # noqa: ANN202
    return _core(llm).scheduler.spec_decoding_stats


def test_greedy_equal_with_every_stop_condition_and_logprobs(base, spec, prompts, free_outputs) -> None:  # noqa: ANN001
    """max_tokens, stop token ids and stop strings landing inside a proposal, EOS after
    min_tokens, and logprobs of every accepted token."""
    params = []
    for i, out in enumerate(free_outputs):
        tokens, text = out[0][0], out[0][3]
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + i % 9, ignore_eos=True, logprobs=2))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                         stop_token_ids=[tokens[2 + i % 7]]))
        elif kind == 2 and len(text) > 8:
            params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                         stop=[text[len(text) // 2: len(text) // 2 + 3]]))
        elif kind == 3:
            params.append(SamplingParams(temperature=0.0, max_tokens=20, min_tokens=2))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1))
    expected = _outputs(base, prompts, params)
    assert_all_equal(_outputs(spec, prompts, params), expected, "speculative vs plain")
    assert [o[0][1] for o in expected].count("stop") >= 10  # the stop conditions did fire
    stats = _stats(spec)
    assert stats.num_drafts > 100 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    per_pos = stats.num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)


def test_negative_control_accepting_one_draft_too_many_fails(spec, prompts, free_outputs, monkeypatch) -> None:  # noqa: ANN001
    real = rejection_sampler.accept_greedy

    def one_too_many(drafts: list[int], argmax: list[int]) -> list[int]:
        tokens = real(drafts, argmax)
        accepted = len(tokens) - 1
        if accepted < len(drafts):  # a rejection: take the rejected draft as well
            return [*drafts[:accepted + 1], argmax[accepted + 1]]
        return tokens

    monkeypatch.setattr(rejection_sampler, "accept_greedy", one_too_many)
    with pytest.raises(AssertionError, match="exactly equal"):
        assert_all_equal(_outputs(spec, prompts, FREE), free_outputs, "speculative vs plain")


def test_prefix_hits_do_not_change_outputs(base, spec, prompts) -> None:  # noqa: ANN001
    prefix = [t for p in prompts for t in p][:48]
    shared = [prefix + p[:10] for p in prompts[:6]]
    expected = _outputs(base, shared, FREE)
    oracle = _core(spec).scheduler.proposer
    oracle.sequences = [p + out[0][0] for p, out in zip(shared, expected)]
    assert _outputs(spec, shared, FREE) == expected
    again = spec.generate([{"prompt_token_ids": p} for p in shared], FREE, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [out[0][0] for out in expected]
    assert all(o.num_cached_tokens >= 48 for o in again)


def test_forced_preemption_does_not_change_outputs(make_llm, tiny_llama_dir, prompts, free_outputs,  # noqa: ANN001
                                                   vocab_size) -> None:
    # 12 usable blocks of 16 tokens for 50 requests of up to 80 tokens (drafts included): preemptions.
    small = _oracle_llm(make_llm, tiny_llama_dir, prompts, free_outputs, vocab_size,
                        num_gpu_blocks_override=13, max_model_len=128)
    assert_all_equal(_outputs(small, prompts, FREE), free_outputs, "speculative under preemption vs plain")
    assert small.get_stats().num_preemptions_total > 0
    assert _stats(small).num_accepted_tokens > 0


def test_n_greater_than_one_greedy_and_seeded_reproducible(base, spec, prompts) -> None:  # noqa: ANN001
    greedy = SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True)
    assert _outputs(spec, prompts[:2], greedy) == _outputs(base, prompts[:2], greedy)
    seeded = SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)
    first = _outputs(spec, prompts[:2], seeded)
    assert _outputs(spec, prompts[:2], seeded) == first and [len(o) for o in first] == [2, 2]


def test_abort_mid_stream_emits_nothing_more_and_frees_every_block(spec, prompts, free_outputs) -> None:  # noqa: ANN001
    core = _core(spec)
    ids = [f"core-{i}" for i in range(8)]
    for request_id, prompt in zip(ids, prompts):
        core.add_request(EngineCoreRequest(request_id, prompt, FREE, eos_token_id=None, arrival_time=0.0))
    tokens: dict[str, list[int]] = {}
    aborted: dict[str, int] = {}
    step = 0
    while core.has_work():
        outputs, _ = core.step()
        for client_outputs in outputs.values():
            for output in client_outputs.outputs:
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        if step == 3:
            aborted = {r: len(tokens.get(r, [])) for r in ("core-1", "core-4")}
            core.abort_requests(list(aborted))
        step += 1
    assert_aborts_cut_outputs(tokens, ids, [out[0][0] for out in free_outputs], aborted)
    state = core.get_block_pool_state()
    assert state.num_free_blocks == state.num_blocks - 1


def _structured_cases(n: int) -> list[SamplingParams]:
    """Greedy structured requests whose outputs run long enough to carry drafts: JSON (no
    optional whitespace: a random model would emit it until max_tokens), regexes, a choice."""
    from lm_console.engine import StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
              "required": ["name", "tags"]}
    kinds = [StructuredOutputsParams(json=schema, disable_any_whitespace=True),
             StructuredOutputsParams(regex=r"[a-z]{8,40}"), StructuredOutputsParams(regex=r"(\d{3}-){3,6}\d{2}"),
             StructuredOutputsParams(choice=["alpha beta gamma delta", "epsilon zeta eta"])]
    return [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=kinds[i % len(kinds)])
            for i in range(n)]


def test_structured_outputs_verify_grammar_checked_drafts(make_llm, tiny_llama_dir, base, prompts,  # noqa: ANN001
                                                          vocab_size) -> None:
    """Drafts for structured requests are cut at the first token the grammar refuses and verified
    under the grammar's bitmask after each draft: greedy output is token for token the plain one."""
    params = _structured_cases(20)
    expected = _outputs(base, prompts[:20], params)
    assert all(out[0][1] in ("stop", "length") for out in expected)
    llm = _oracle_llm(make_llm, tiny_llama_dir, prompts[:20], expected, vocab_size)
    assert_all_equal(_outputs(llm, prompts[:20], params), expected, "structured, speculative vs plain")
    stats = _stats(llm)
    assert stats.num_drafts > 20 and stats.num_accepted_tokens > 40, stats
    assert_no_leaked_blocks(llm)


def test_negative_control_a_bitmask_only_on_the_first_row_fails_the_structured_check(  # noqa: ANN001
        make_llm, tiny_llama_dir, base, prompts, vocab_size, monkeypatch) -> None:
    """With the grammar's bitmask on a request's first verification row only (the rows after its
    drafts unmasked), the random model picks tokens the grammar refuses: the check must fail,
    by a difference or by the engine's own refusal of such a token."""
    from lm_console.engine.errors import RequestRejectedError
    from lm_console.engine.structured_output.backend_xgrammar import XgrammarGrammar

    def first_row_only(self, bitmask, first_row, draft_ids):  # noqa: ANN001, ANN202
        self.matcher.fill_next_token_bitmask(bitmask, first_row)
        return first_row + len(draft_ids) + 1  # the other rows stay all-allowed

    params = _structured_cases(20)
    expected = _outputs(base, prompts[:20], params)
    monkeypatch.setattr(XgrammarGrammar, "fill_rows", first_row_only)
    llm = _oracle_llm(make_llm, tiny_llama_dir, prompts[:20], expected, vocab_size)
    with pytest.raises((AssertionError, RequestRejectedError), match="exactly equal|grammar refused sampled token"):
        assert_all_equal(_outputs(llm, prompts[:20], params), expected, "structured, speculative vs plain")


def test_what_cannot_combine_is_refused_at_start(tiny_llama_dir) -> None:  # noqa: ANN001
    with pytest.raises(InvalidEngineArgsError, match="async_scheduling"):
        LLM(str(tiny_llama_dir), async_scheduling=True, speculative_config=SPEC, **ENGINE)
    with pytest.raises(InvalidEngineArgsError, match="tensor_parallel_size"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, speculative_config=SPEC, **ENGINE)
    with pytest.raises(InvalidEngineArgsError, match="method"):
        LLM(str(tiny_llama_dir), speculative_config='{"method": "eagle"}', **ENGINE)


def test_real_proposers_on_the_tiny_model(make_llm, tiny_llama_dir, base, prompts) -> None:  # noqa: ANN001
    """The ngram and suffix proposers themselves (few proposals on a random model, but each is verified)."""
    repeated = [p + p for p in prompts[:12]]
    expected = _outputs(base, repeated, FREE)
    for method in ("ngram", "suffix"):
        llm = make_llm(str(tiny_llama_dir), speculative_config={"method": method, "num_speculative_tokens": 4,
                                                                "prompt_lookup_min": 1}, **ENGINE)
        assert_all_equal(_outputs(llm, repeated, FREE), expected, f"{method} vs plain")
        assert _stats(llm).num_drafts > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_embedded_model_copy_workload_greedy_equal(make_llm, method: str) -> None:
    """The default engine (GGUF weights, the C decode stack): a copy-friendly prompt accepts most
    drafts, and the output is token for token the plain one."""
    prompts = [f"Repeat the following text exactly.\n\nText: {_TEXT[start:start + 600]}\n\nRepeated text: "
               for start in (0, 700)]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    plain = make_llm(None, multiprocess=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = make_llm(None, multiprocess=False, speculative_config={"method": method, "num_speculative_tokens": 4})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    stats = _stats(llm)
    assert stats.num_accepted_tokens > 0.5 * sum(len(t) for t in expected)
