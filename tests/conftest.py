"""Shared fixtures: the embedded model directory and tiny random models of each architecture."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_factory import LLAMA3_ROPE, make_tiny_model_dir


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The random order's seed at the end of the run, `-q` included (pytest-randomly prints it in
    the header, which -q hides): the way to rerun a failure in the same order."""
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None and config.pluginmanager.hasplugin("randomly"):
        terminalreporter.write_line(f"test order: --randomly-seed={seed} (rerun it with -p randomly "
                                    f"--randomly-seed={seed}; -p no:randomly for file order)")


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """The converted embedded default model (converted once, then cached on disk)."""
    from lm_console.engine.models.embedded import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama3"), "llama", seed=4,
                               rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_llama_tp3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose heads split three ways (6 query, 3 KV heads): tensor_parallel_size=3."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama_tp3"), "llama", seed=8, hidden_size=96,
                               intermediate_size=192, num_attention_heads=6, num_key_value_heads=3, head_dim=16)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_mistral"), "mistral", seed=3)


@pytest.fixture(scope="session")
def tiny_llama_d64_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with the embedded model's head size (64): the int8 KV cache's kernels take it."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama_d64"), "llama", seed=6, hidden_size=256,
                               head_dim=64)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=2)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma3 text model: 5 sliding-window layers (window 24) and 1 global layer."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_gemma3"), "gemma3", seed=5)


@pytest.fixture(scope="session")
def tiny_idefics3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Idefics3 (SmolVLM-style) VLM with its processor (tests/mm_factory.py)."""
    from mm_factory import make_tiny_idefics3_dir

    return make_tiny_idefics3_dir(tmp_path_factory.mktemp("tiny_idefics3"))


@pytest.fixture(scope="session")
def tiny_gemma3_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mm_factory import make_tiny_gemma3_vlm_dir

    return make_tiny_gemma3_vlm_dir(tmp_path_factory.mktemp("tiny_gemma3_vlm"))


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray instance on loopback for the whole session (started by the first test that
    asks for it, shut down at the end); an engine core with a Ray backend joins it (RAY_ADDRESS)."""
    import os

    # Set before Ray loads: a single-machine instance on 127.0.0.1 (Ray otherwise uses the machine's address).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = pytest.importorskip("ray", reason="the [ray] extra installs Ray")
    from lm_console.engine.executor.ray_utils import RAY_NAMESPACE

    ray.init(num_cpus=2, include_dashboard=False, namespace=RAY_NAMESPACE, log_to_driver=False)
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    yield ray
    ray.shutdown()


@pytest.fixture
def make_llm():
    """Build LLMs for one test; afterwards assert that none of them leaked a KV block."""
    from lm_console.engine import LLM
    from llm_helpers import assert_no_leaked_blocks

    built = []

    def factory(model: str | None = None, **engine_args):
        llm = LLM(model, **engine_args)
        built.append(llm)
        return llm

    yield factory
    for llm in built:
        assert_no_leaked_blocks(llm)
        llm.shutdown()



def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`vllm` tests run only against an installed vLLM venv: each skips, saying why, without one."""
    from vllm_helpers import vllm_skip_reason

    reason = vllm_skip_reason()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
