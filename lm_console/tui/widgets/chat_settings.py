"""ChatSettings: the chat's side panel (system prompt, sampling settings, model capabilities)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Input, Label, Static, TextArea

from lm_console.chat_session import MULTIMODAL_NOTICE, TEXT_ONLY_NOTICE, ChatSession
from lm_console.client.types import EngineInfo


class ChatSettings(Vertical):
    """Edits the session in place; invalid numbers are ignored and flagged."""

    def __init__(self, session: ChatSession, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.session = session

    def compose(self) -> ComposeResult:
        params = self.session.params
        yield Label("System prompt")
        yield TextArea(self.session.system_prompt, id="system-prompt", soft_wrap=True)
        yield Label("temperature (0 = greedy)")
        yield Input(str(params.temperature), id="temperature", type="number")
        yield Label("top_p")
        yield Input(str(params.top_p), id="top-p", type="number")
        yield Label("max tokens")
        yield Input(str(params.max_tokens), id="max-tokens", type="integer")
        yield Static(f"[#7f848e]{TEXT_ONLY_NOTICE}[/]", id="capabilities")

    def on_mount(self) -> None:
        self.border_title = "Settings"

    def show_capabilities(self, info: EngineInfo) -> None:
        """Once the engine is up: can this model take images (and any caveat of the model)?"""
        text = MULTIMODAL_NOTICE if info.multimodal else TEXT_ONLY_NOTICE
        if info.notice:
            text += f" Note: {info.notice}."
        self.query_one("#capabilities", Static).update(f"[#7f848e]{text}[/]")

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        if event.text_area.id == "system-prompt":
            self.session.system_prompt = event.text_area.text.strip()

    def on_input_changed(self, event: Input.Changed) -> None:
        params = self.session.params
        try:
            if event.input.id == "temperature":
                params.temperature = max(float(event.value), 0.0)
            elif event.input.id == "top-p":
                params.top_p = min(max(float(event.value), 0.01), 1.0)
            elif event.input.id == "max-tokens":
                params.max_tokens = max(int(event.value), 1)
            event.input.remove_class("-invalid")
        except ValueError:
            event.input.add_class("-invalid")
