"""GGUF files of every architecture we load (llama, qwen2, qwen3, gemma3): weights, metadata,
tokenizer, the packed quantized path, and clear errors for files we cannot load.

Each tiny random HF model is written to GGUF the way llama.cpp's converter does (tests/
gguf_factory.py: the `gguf` package's tensor names, q/k permutation for llama only, Gemma norms
as 1 + w, llama3 rope as a rope_freqs tensor), once in F32 and once with Q8_0 / Q4_0 / Q4_1
tensors, then loaded through the engine's path for a .gguf model (convert once, then load).
"""

from __future__ import annotations

import functools
import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from lm_console.engine.errors import InvalidGGUFError, UnsupportedArchitectureError  # noqa: E402
from lm_console.engine.models.embedded import resolve_model_path  # noqa: E402
from lm_console.engine.models.loader import load_model  # noqa: E402
from gguf_factory import MIXED_TYPES, small_vocabulary, write_gguf  # noqa: E402
from model_factory import LLAMA3_ROPE, make_tiny_model_dir  # noqa: E402
from paged_model_harness import PagedHarness  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 1024  # SmolLM2's first 1024 tokens: a tokenizer that converts fast
NUM_NEW = 6
ARCHS = {
    # name: (HF arch, model_factory overrides)
    "llama": ("llama", {"rope_parameters": dict(LLAMA3_ROPE), "tie_word_embeddings": False}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),  # tied heads: the GGUF files' usual layout
    # query_pre_attn_scalar = head_dim: what a gemma3 GGUF implies (llama.cpp stores no scale)
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 16, "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_archs")


@contextmanager
def _private_cache(root: Path):
    """Convert this module's GGUF files into a cache of their own (the embedded model's
    conversion, which the tiny models' tokenizer files come from, stays in the shared one)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMC_CACHE_DIR", str(root / "cache"))
        yield


def _convert(path: Path) -> Path:
    with _private_cache(path.parent):
        return resolve_model_path(str(path))


@pytest.fixture(scope="module")
def vocab():
    return small_vocabulary(VOCAB)


_built: dict[str, dict[str, Path]] = {}


@pytest.fixture(params=list(ARCHS))
def model(request, workdir, vocab):
    """{"hf": source dir, "f32": .gguf, "quant": .gguf, "f32_dir"/"quant_dir": converted dirs}."""
    name = request.param
    if name not in _built:
        arch, overrides = ARCHS[name]
        hf = make_tiny_model_dir(workdir / name, arch, seed=11, vocab_size=VOCAB, **overrides)
        f32 = write_gguf(hf, workdir / f"{name}-f32.gguf", arch, vocab)
        quant = write_gguf(hf, workdir / f"{name}-mixed.gguf", arch, vocab, "Q8_0", MIXED_TYPES)
        _built[name] = {"name": name, "hf": hf, "f32": f32, "quant": quant,
                        "f32_dir": _convert(f32), "quant_dir": _convert(quant)}
    return _built[name]


def _prompt(n: int = 30) -> list[int]:
    gen = torch.Generator().manual_seed(n)
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


def _hf_greedy(model_dir: Path, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(NUM_NEW):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _our_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    harness = PagedHarness(model)
    out = [int(harness.step([("a", prompt)])[-1].argmax())]
    while len(out) < NUM_NEW:
        out.append(int(harness.step([("a", [out[-1]])])[-1].argmax()))
    return out


def _load(model_dir: Path, quantization: str | None = None) -> torch.nn.Module:
    from transformers import AutoConfig

    return load_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, "cpu",
                      quantization=quantization)


def test_gguf_greedy_tokens_match_hf(model):
    """Our model on the converted file == HF on the same weights: the source checkpoint for the
    F32 file (whose weights come back as they were), the dequantized ones for the quantized file."""
    from safetensors.torch import load_file

    prompt = _prompt()
    # F32: HF on the source checkpoint (the converted weights are checked equal to it below).
    assert _our_greedy(_load(model["f32_dir"]), prompt) == _hf_greedy(model["hf"], prompt)
    assert _our_greedy(_load(model["quant_dir"]), prompt) == _hf_greedy(model["quant_dir"], prompt)
    source = load_file(str(model["hf"] / "model.safetensors"))
    converted = load_file(str(model["f32_dir"] / "model.safetensors"))
    assert set(converted) == set(source) - ({"lm_head.weight"} if model["name"] == "gemma3" else set())
    for name, tensor in converted.items():
        torch.testing.assert_close(tensor, source[name], rtol=0, atol=1e-6, msg=name)


def test_gguf_metadata_round_trips(model):
    """config.json from the GGUF metadata: the source config's values, not defaults."""
    source = json.loads((model["hf"] / "config.json").read_text())
    got = json.loads((model["f32_dir"] / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                "vocab_size", "tie_word_embeddings", "rope_parameters", "bos_token_id", "eos_token_id"):
        assert got[key] == source[key], key
    assert got["architectures"] == source["architectures"]
    assert got["rms_norm_eps"] == 1e-6  # float32 in the file, the decimal back in the config
    if model["name"] == "gemma3":
        for key in ("sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping"):
            assert got[key] == source[key], key
        assert got["layer_types"].count("sliding_attention") == 5
    if model["name"] == "llama":
        assert got["rope_parameters"]["rope_type"] == "llama3"  # rebuilt from rope_freqs
    if model["name"] == "qwen3":
        assert got["attention_bias"] is False


@functools.cache
def _smollm2_ids(text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(None))(text)["input_ids"]


def test_gguf_tokenizer_from_metadata(model):
    """The file's tokenizer (tokenizer.ggml.*): SmolLM2's ids on text within the cut vocabulary,
    its special tokens and chat template; no architecture's tokenizer class re-spells it."""
    from transformers import AutoTokenizer

    text = "The one part of this and that, which will have more from them"
    full = _smollm2_ids(text)
    assert max(full) < VOCAB  # every merge used lies inside the cut vocabulary
    tokenizer = AutoTokenizer.from_pretrained(model["f32_dir"])
    assert tokenizer(text)["input_ids"] == full
    assert tokenizer.decode(tokenizer(text + " <|im_end|>")["input_ids"]) == text + " <|im_end|>"
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template


@pytest.fixture
def cpu_quant():
    from lm_console.kernels import cpu_quant

    if cpu_quant.load() is None:
        pytest.skip("no quantized CPU kernels")
    return cpu_quant


def test_gguf_packed_weights_are_the_files(model, cpu_quant, monkeypatch):
    """quantization="gguf" keeps each quantized tensor's blocks (names and row order per
    architecture): unpacked, they are the dequantized checkpoint; logits match dense (prefill)
    or stay close to it (decode on int8 activations)."""
    from lm_console.engine.models.layers import Embedding, Linear

    packed = _load(model["quant_dir"], quantization="gguf")
    dense = _load(model["quant_dir"])
    dense_modules = dict(dense.named_modules())
    num_quant = 0
    for name, module in packed.named_modules():
        if isinstance(module, (Linear, Embedding)) and module.quant is not None:
            num_quant += 1
            weight = cpu_quant.dequantize(module.quant)[:, : module.quant.in_features]
            torch.testing.assert_close(weight, dense_modules[name].weight, rtol=0, atol=1e-5, msg=name)
    assert num_quant >= 4 * packed.config.num_hidden_layers  # qkv, o, gate_up, down per layer
    # Prefill above DENSE_ROWS rows (set to 16 here, as on a CPU with AMX): the blocks dequantized
    # into torch's matmul, as dense. Decode (one row; every row elsewhere): the int8 kernel on int8
    # activations, close to dense.
    monkeypatch.setattr(cpu_quant, "DENSE_ROWS", 16)
    prompt, follow = _prompt(20), [5, 17, 300]
    ours, ref = PagedHarness(packed), PagedHarness(dense)
    got, want = ours.step([("a", prompt)]), ref.step([("a", prompt)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
    for token in follow:
        got, want = ours.step([("a", [token])]), ref.step([("a", [token])])
        torch.testing.assert_close(got, want, rtol=0, atol=0.05 * want.abs().max().item())


@pytest.mark.parametrize("model", ["gemma3"], indirect=True)
def test_engine_serves_a_gemma3_gguf(model, make_llm, cpu_quant):
    """The whole path from a .gguf model argument: LLM(...) greedy == HF on the file's weights;
    with quantization="gguf" the engine runs on the file's blocks (the tied head's Q8_0)."""
    from lm_console.engine import SamplingParams

    prompt = _prompt()
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    engine_args = dict(dtype="float32", multiprocess=False, max_model_len=128, kv_cache_memory=1 << 24,
                       block_size=8, num_threads=1)
    outputs = {}
    for quantization in ("none", "gguf"):
        with _private_cache(model["quant"].parent):  # the engine resolves the .gguf path itself
            llm = make_llm(str(model["quant"]), quantization=quantization, **engine_args)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        outputs[quantization] = out[0].outputs[0].token_ids
    assert outputs["none"] == _hf_greedy(model["quant_dir"], prompt)
    head = llm.engine_core.engine_core.model_executor.worker.model_runner.model.lm_head
    assert head.quant is not None and head.quant.source == "Q8_0"
    assert len(outputs["gguf"]) == NUM_NEW


def _small_gguf(path: Path, arch: str, vocab, **keys) -> Path:
    """A metadata-only GGUF (an embedding tensor) with the given {arch}.* keys."""
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        writer.add_string(f"{arch}.{key}", value) if isinstance(value, str) else (
            writer.add_uint32(f"{arch}.{key}", value) if isinstance(value, int)
            else writer.add_float32(f"{arch}.{key}", value))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab["tokens"])
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GOOD_KEYS = {"block_count": 1, "context_length": 64, "embedding_length": 64, "feed_forward_length": 128,
             "attention.head_count": 4, "attention.layer_norm_rms_epsilon": 1e-6}


def test_gguf_errors_are_specific(workdir, vocab):
    """An unsupported architecture, a missing key, an unsupported rope scaling: each named."""
    with pytest.raises(UnsupportedArchitectureError, match=r"'phi3' is not supported; supported: llama, qwen2"):
        _convert(_small_gguf(workdir / "phi3.gguf", "phi3", vocab, **GOOD_KEYS))
    missing = {k: v for k, v in GOOD_KEYS.items() if k != "context_length"}
    with pytest.raises(InvalidGGUFError, match=r"no qwen3\.context_length key"):
        _convert(_small_gguf(workdir / "nokey.gguf", "qwen3", vocab, **missing))
    yarn = {**GOOD_KEYS, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}
    with pytest.raises(UnsupportedArchitectureError, match="rope scaling 'yarn' is not supported"):
        _convert(_small_gguf(workdir / "yarn.gguf", "qwen2", vocab, **yarn))
    models = workdir / "cache" / "models"
    assert not [p for p in models.iterdir() if p.is_dir() and not p.name.startswith(".")
                and not (p / "model.safetensors").exists()]  # no half-converted directory left


def test_gemma3_sentencepiece_tokenizer(workdir):
    """Gemma's own vocabulary kind (tokenizer.ggml.model "llama": scored pieces, byte fallback,
    no space prefix, BOS added): Gemma's tokenizer class reads it from the file; its
    <end_of_turn> control token ends generation besides <eos>."""
    import numpy as np
    from transformers import AutoTokenizer

    from lm_console.engine.models.gguf_convert import convert_gguf

    pieces = ["▁", "t", "h", "e", "a", "c", "i", "s", "n", "th", "the", "▁the", "at", "▁c", "▁cat",
              "is", "▁is", "in", "▁in"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), *pieces,
              "<start_of_turn>", "<end_of_turn>"]
    path = workdir / "gemma3-spm.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in GOOD_KEYS.items():
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(f"gemma3.{key}", value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0])
    writer.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * len(pieces) + [3, 3])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), dtype=np.float32))
    # The one layer GOOD_KEYS declare (hidden 64, 4 heads of 16, ffn 128): a file's metadata
    # must match its tensors (gguf_check.py).
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    shapes = {"attn_q": (64, 64), "attn_k": (64, 64), "attn_v": (64, 64), "attn_output": (64, 64),
              "ffn_gate": (128, 64), "ffn_up": (128, 64), "ffn_down": (64, 128), "attn_q_norm": (16,),
              "attn_k_norm": (16,), "attn_norm": (64,), "post_attention_norm": (64,), "ffn_norm": (64,),
              "post_ffw_norm": (64,)}
    for part, shape in shapes.items():
        writer.add_tensor(f"blk.0.{part}.weight", np.ones(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    convert_gguf(path, workdir / "gemma3-spm")
    tokenizer = AutoTokenizer.from_pretrained(workdir / "gemma3-spm")
    ids = tokenizer("the cat is in the<end_of_turn>x")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<bos>", "the", "▁cat", "▁is", "▁in", "▁the", "<end_of_turn>", "<0x78>"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the cat is in thex"
    assert json.loads((workdir / "gemma3-spm" / "config.json").read_text())["vocab_size"] == len(tokens)
    # Generation also stops at <end_of_turn>, which is not Gemma's eos (as llama.cpp does).
    generation = json.loads((workdir / "gemma3-spm" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, tokens.index("<end_of_turn>")]
