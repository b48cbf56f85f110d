"""ChatView: the chat tab (transcript, prompt, settings); replies stream through a ChatSession."""

from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll

from lm_console.chat_session import COMMANDS_HELP, ChatSession
from lm_console.client.types import EngineInfo, EngineUnavailable
from lm_console.tui.widgets.chat_message import ChatMessage
from lm_console.tui.widgets.chat_settings import ChatSettings
from lm_console.tui.widgets.image_attachment import ImageAttachment
from lm_console.tui.widgets.prompt_input import PromptInput

WELCOME = ("Type a message and press **enter** (shift+enter or ctrl+j for a new line). "
           "**escape** stops a reply, **ctrl+l** clears the conversation. " + COMMANDS_HELP)


class ChatView(Horizontal):
    """A streamed, multi-turn chat; the app calls flush() on its UI tick."""

    BINDINGS = [
        Binding("escape", "stop", "stop reply"),
        Binding("ctrl+l", "clear", "clear chat"),
        Binding("f2", "app.show_tab('dashboard')", "dashboard"),
        Binding("ctrl+q", "app.quit", "quit"),
    ]

    def __init__(self, session: ChatSession, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.session = session
        self.streaming: ChatMessage | None = None
        self.engine_ready = False

    def compose(self) -> ComposeResult:
        with Vertical(id="chat-main"):
            with VerticalScroll(id="transcript"):
                yield ChatMessage("notice", WELCOME)
            yield PromptInput(id="prompt")
        yield ChatSettings(self.session, id="chat-settings")

    def on_mount(self) -> None:
        self.query_one("#transcript").border_title = "Chat"

    def focus_prompt(self) -> None:
        self.query_one(PromptInput).focus()

    def add_message(self, role: str, text: str) -> ChatMessage:
        message = ChatMessage(role, text)
        transcript = self.query_one("#transcript", VerticalScroll)
        transcript.mount(message)
        transcript.scroll_end(animate=False)
        return message

    def on_engine_ready(self, info: EngineInfo, images: list[str] | None = None) -> None:
        """The engine is up: show what the model can take, attach images given on the command line."""
        self.engine_ready = True
        self.query_one(ChatSettings).show_capabilities(info)
        for path in images or ():
            self.attach_image(path)

    def attach_image(self, path: str) -> None:
        """Attach an image to the next message, with a half-cell block preview."""
        count = len(self.session.pending_images)
        self.add_message("notice", self.session.attach_image(path))
        if len(self.session.pending_images) > count:
            from lm_console.image_preview import describe_image

            _, image = describe_image(path)
            transcript = self.query_one("#transcript", VerticalScroll)
            transcript.mount(ImageAttachment(path, image, classes="image-preview"))
            transcript.scroll_end(animate=False)

    def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        if event.text.strip() == "/clear":
            self.action_clear()
            return
        if event.text.startswith("/image"):
            self.attach_image(event.text[len("/image"):].strip())
            return
        notice = self.session.command(event.text)
        if notice is not None:
            self.add_message("notice", notice)
            return
        if self.streaming is not None:
            self.add_message("notice", "A reply is still streaming: press escape to stop it first.")
            return
        if not self.engine_ready:
            self.add_message("notice", "The engine is still starting; try again in a moment.")
            return
        self.add_message("user", event.text)
        self.streaming = self.add_message("assistant", "")
        self._reply(event.text, self.streaming)

    @work(group="chat", exit_on_error=False)
    async def _reply(self, text: str, message: ChatMessage) -> None:
        try:
            async for chunk in self.session.send(text):
                message.append(chunk.text)
        except EngineUnavailable as error:
            message.append(f"\n\n*(the engine is unavailable: {error})*")
            self.app.engine_died(error)  # type: ignore[attr-defined]
        except Exception as error:  # noqa: BLE001 - show it in the transcript, keep chatting
            message.append(f"\n\n*(error: {type(error).__name__}: {error})*")
        finally:
            stats = self.session.last_stats
            if stats is not None:
                message.set_footer(stats.describe())
            message.flush()
            self.streaming = None
            self.query_one("#transcript", VerticalScroll).scroll_end(animate=False)

    def flush(self) -> None:
        """Show streamed text gathered since the last tick (called inside batch_update)."""
        if self.streaming is not None and self.streaming.flush():
            stats = self.session.last_stats
            if stats is not None:
                self.streaming.set_footer(stats.describe() + " · streaming…")
            self.query_one("#transcript", VerticalScroll).scroll_end(animate=False)

    async def action_stop(self) -> None:
        if not await self.session.stop():
            self.app.notify("No reply is streaming.", timeout=2)

    async def action_clear(self) -> None:
        await self.session.stop()
        self.session.clear()
        transcript = self.query_one("#transcript", VerticalScroll)
        transcript.remove_children()
        transcript.mount(ChatMessage("notice", "Conversation cleared. " + WELCOME))
