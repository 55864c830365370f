"""A sans-IO decoder for Server-Sent Events (the WHATWG ``text/event-stream`` format).

Feed it bytes as they arrive, in chunks of any size; it returns the events completed so far.
It does no I/O, so the synchronous and the asynchronous client share it::

    decoder = SSEDecoder()
    for chunk in response.iter_bytes():
        for event in decoder.feed(chunk):
            ...
    decoder.close()  # end of stream: an unfinished event is dropped, as the standard says

What it implements: lines end with CRLF, LF or CR (also split across chunks); a leading BOM
is skipped; lines starting with ``:`` are comments (keep-alives) and ignored; ``data`` lines
accumulate, joined by ``\\n``; an empty line dispatches the event (none when no ``data`` was
given); ``event`` defaults to ``message``; ``id`` sets the last event id (kept across events;
ignored if it contains NUL); ``retry`` with only digits sets :attr:`SSEDecoder.retry_ms`;
unknown fields are ignored; a line without ``:`` is a field with an empty value.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

__all__ = ["SSEDecoder", "ServerSentEvent"]

_EOL = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    """One dispatched event."""

    event: str = "message"
    data: str = ""
    id: str = ""  # the last event id in effect when it was dispatched


class SSEDecoder:
    """Turns a byte stream into :class:`ServerSentEvent` objects; see the module docstring."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._started = False
        self._event = ""
        self._data: list[str] = []
        self._has_data = False
        self.last_event_id = ""
        self.retry_ms: int | None = None

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """The events completed by ``chunk``."""
        return self._lines(self._decoder.decode(chunk), final=False)

    def close(self) -> list[ServerSentEvent]:
        """End of stream: process what is left. An event without its blank line is dropped."""
        return self._lines(self._decoder.decode(b"", final=True), final=True)

    def _lines(self, text: str, *, final: bool) -> list[ServerSentEvent]:
        buffer = self._buffer + text
        if not self._started and buffer:
            self._started = True
            buffer = buffer.removeprefix("\ufeff")
        events: list[ServerSentEvent] = []
        consumed = 0
        for end_of_line in _EOL.finditer(buffer):
            if end_of_line.group() == "\r" and end_of_line.end() == len(buffer) and not final:
                break  # a CR ending the chunk may be the first half of a CRLF
            event = self._line(buffer[consumed : end_of_line.start()])
            consumed = end_of_line.end()
            if event is not None:
                events.append(event)
        self._buffer = buffer[consumed:]
        if final:  # an unterminated line or event at the end of the stream is dropped
            self._buffer = ""
            self._reset()
        return events

    def _line(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment, e.g. a keep-alive
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._has_data = True
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\x00" not in value:
                self.last_event_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self.retry_ms = int(value)
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        if not self._has_data:
            self._event = ""
            return None
        event = ServerSentEvent(
            event=self._event or "message", data="\n".join(self._data), id=self.last_event_id
        )
        self._reset()
        return event

    def _reset(self) -> None:
        self._event = ""
        self._data = []
        self._has_data = False
