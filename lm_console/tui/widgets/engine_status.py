"""EngineStatus: the top line (model, device, dtype, block size, pool size) and engine state."""

from __future__ import annotations

from textual.markup import escape
from textual.widgets import Static

from lm_console.client.types import (
    UNAVAILABLE_BLOCK_MAP, UNAVAILABLE_KV_EVENTS, UNAVAILABLE_LATENCY, UNAVAILABLE_REQUESTS, UNAVAILABLE_STEPS,
    EngineInfo,
)
from lm_console.tui.render import fmt_count

PANEL_NAMES = {UNAVAILABLE_BLOCK_MAP: "block map", UNAVAILABLE_STEPS: "per-step stats",
               UNAVAILABLE_KV_EVENTS: "KV events", UNAVAILABLE_REQUESTS: "server's request table",
               UNAVAILABLE_LATENCY: "latency"}
STATES = {"starting": "[#e5c07b]◌ starting…[/]", "serving": "[#98c379]● serving[/]",
          "dead": "[b #e06c75]✖ dead[/]", "paused": "[#e5c07b]● serving (display paused)[/]"}


class EngineStatus(Static):
    """A one-line header: what is loaded and whether it is alive."""

    def show(self, info: EngineInfo | None, state: str) -> None:
        if info is not None and info.url and state != "starting":
            unavailable = _unavailable_line(info)
            if unavailable and self.styles.height is not None and self.styles.height.value == 1:
                self.styles.height = "auto"  # room for the line that names the unavailable panels
            self.update(f"{_remote_header(info)}    engine {STATES.get(state, state)}{unavailable}")
            return
        if info is None or not info.num_blocks:
            model = info.model if info is not None else "engine"
            left = f"[b]lm-console[/]  {model} · loading"
        else:
            notice = f" [#e5c07b]({info.notice})[/]" if info.notice else ""
            left = (f"[b]lm-console[/]  {info.model}{notice} · {info.device} · {info.dtype}{_kv_dtype(info)} · "
                    f"block {info.block_size} · {fmt_count(info.num_blocks)} blocks · "
                    f"budget {fmt_count(info.max_num_batched_tokens)} tok · {info.max_num_seqs} seqs")
        self.update(f"{left}    engine {STATES.get(state, state)}")


def _kv_dtype(info: EngineInfo) -> str:
    """The header's ' · kv int8' where the KV cache's type is not the model's (empty otherwise)."""
    kv = info.kv_cache_dtype
    return f" · kv {kv}" if kv and kv not in ("?", info.dtype) else ""


def _remote_header(info: EngineInfo) -> str:
    """An attached server: its URL, and only the facts it published (a vLLM server publishes few)."""
    facts = [f"{info.model} @ {info.url}"]
    facts += [fact for fact in (info.device, info.dtype) if fact and fact != "?"]
    if _kv_dtype(info):
        facts.append(f"kv {info.kv_cache_dtype}")
    facts.append(f"block {info.block_size}")
    if info.num_blocks:
        facts.append(f"{fmt_count(info.num_blocks)} blocks")
    if info.max_num_batched_tokens:
        facts.append(f"budget {fmt_count(info.max_num_batched_tokens)} tok · {info.max_num_seqs} seqs")
    return "[b]lm-console[/]  " + " · ".join(facts)


def _unavailable_line(info: EngineInfo) -> str:
    """An attached server: a second line naming each panel it cannot fill and why (empty when none)."""
    if not info.unavailable:
        return ""
    parts = [f"{PANEL_NAMES.get(key, key)}: {escape(reason)}" for key, reason in info.unavailable.items()]
    return "\n[#7f848e]unavailable ─ " + " · ".join(parts) + "[/]"
