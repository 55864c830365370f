"""How ``status --follow`` and ``launch --wait`` show a launch.

Three displays behind one small interface (a context manager; ``update`` is the SDK's
``on_progress``; ``done``/``failed``/``gave_up`` set the final state):

- :class:`LiveDisplay` — on a terminal: a spinner, the status and phases, the time elapsed and
  an ETA that counts down between events (the server only sends changes), redrawn 8 times a
  second; the final frame stays on screen.
- :class:`JsonLines` — one status body per line, exactly as the API sent it (``status
  --follow`` when stdout is not a terminal, or with ``--json``).
- :class:`TextLines` — one human line per change (``launch --wait`` when the display's stream
  is not a terminal, so captured stdout keeps only the value).
"""

from __future__ import annotations

import json
import math
import time
from datetime import UTC, datetime
from types import TracebackType
from typing import IO, Any, Protocol

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

PHASES = ("compute", "mount", "ready")
MAX_PLAUSIBLE_AGE = 3600.0  # a createdAt older than this (or in the future) is not trusted

Body = dict[str, Any]


class Display(Protocol):
    def __enter__(self) -> Display: ...

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def update(self, body: Any) -> None: ...

    def done(self, body: Any) -> None: ...

    def failed(self, error_code: str | None, error_message: str) -> None: ...

    def gave_up(self, reason: str) -> None: ...


class _Lines:
    """Displays that write a line per change and draw no final state."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, *_: object) -> None:
        """Nothing to tear down."""

    def update(self, body: Any) -> None:
        self.stream.write(self.line(body) + "\n")
        self.stream.flush()

    def line(self, body: Any) -> str:
        raise NotImplementedError

    def done(self, body: Any) -> None:
        """The last line was the final state."""

    def failed(self, error_code: str | None, error_message: str) -> None:
        """The caller prints the error on stderr."""

    def gave_up(self, reason: str) -> None:
        """The caller prints why on stderr."""


def status_json(body: Any) -> str:
    """A status body as the server sends it: compact, keys in the server's order."""
    return json.dumps(body, separators=(",", ":"))


class JsonLines(_Lines):
    """Each status body as one JSON line (the same encoding as ``--json``)."""

    def line(self, body: Any) -> str:
        return status_json(body)


class TextLines(_Lines):
    """One line per change: ``provisioning mount ~2 s``."""

    def line(self, body: Any) -> str:
        parts = [str(body.get("status", "?"))]
        if "phase" in body:
            parts.append(str(body["phase"]))
        if "etaSeconds" in body:
            parts.append(f"~{body['etaSeconds']} s")
        return " ".join(parts)


def _created_at(body: Body) -> datetime | None:
    try:
        return datetime.fromisoformat(str(body["createdAt"]))
    except (KeyError, ValueError):
        return None


class LiveDisplay:
    """The terminal display; see the module docstring."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.started = time.monotonic()
        self.origin = self.started  # when the launch began, as far as we can tell
        self.body: Body = {}
        self.received = self.started
        self.phases_seen: list[str] = []
        self.outcome: Text | None = None
        self.spinner = Spinner("dots", style="cyan")
        self.live = Live(
            get_renderable=self.render,
            console=console,
            refresh_per_second=8,
            transient=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )

    def __enter__(self) -> LiveDisplay:
        self.live.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.live.stop()  # draws the final frame once more and leaves it on screen

    # ---- what the SDK reports
    def update(self, body: Any) -> None:
        now = time.monotonic()
        if not self.body:  # the first body: date the launch from the sandbox's creation
            created = _created_at(body)
            if created is not None:
                age = (datetime.now(UTC) - created).total_seconds()
                if 0 <= age < MAX_PLAUSIBLE_AGE:
                    self.origin = now - age
        self.body = dict(body)
        self.received = now
        phase = str(body.get("phase", ""))
        if body.get("status") == "provisioning" and phase not in self.phases_seen:
            self.phases_seen.append(phase)
        self.live.refresh()

    def done(self, body: Any) -> None:
        self.body = dict(body)
        elapsed = time.monotonic() - self.origin
        self.outcome = Text.assemble(
            ("✔ ", "bold green"),
            ("active", "bold green"),
            f"  ready after {elapsed:.1f} s",
        )
        self.live.refresh()

    def failed(
        self,
        error_code: str | None,
        error_message: str,  # noqa: ARG002 - the caller prints it on stderr, once
    ) -> None:
        during = self.phases_seen[-1] if self.phases_seen else "launch"
        elapsed = time.monotonic() - self.origin
        self.outcome = Text.assemble(
            ("✖ ", "bold red"),
            ("failed", "bold red"),
            f" during {during} after {elapsed:.1f} s",
            (f"  ({error_code or 'unknown'})", "red"),
        )
        self.live.refresh()

    def gave_up(self, reason: str) -> None:
        self.outcome = Text.assemble(("■ ", "yellow"), (reason, "yellow"))
        self.live.refresh()

    # ---- drawing
    def eta(self) -> int | None:
        """``etaSeconds`` counted down since it was received (the server sends changes only)."""
        if "etaSeconds" not in self.body:
            return None
        left = float(self.body["etaSeconds"]) - (time.monotonic() - self.received)
        return max(0, math.ceil(left))

    def steps(self) -> Text:
        text = Text()
        status = self.body.get("status")
        current = str(self.body.get("phase", ""))
        for index, phase in enumerate(PHASES):
            if index:
                text.append(" → ", "dim")
            if status == "active" or (phase in self.phases_seen and phase != current):
                text.append(f"{phase} ✓", "green")
            elif status == "provisioning" and phase == current:
                text.append(phase, "bold cyan")
            elif status == "failed" and self.phases_seen and phase == self.phases_seen[-1]:
                text.append(f"{phase} ✖", "red")
            else:
                text.append(phase, "dim")
        return text

    def render(self) -> RenderableType:
        steps = self.steps()
        if self.outcome is not None:
            return Group(self.outcome, Text("  ").append_text(steps))
        status = str(self.body.get("status", "connecting"))
        phase = self.body.get("phase")
        elapsed = time.monotonic() - self.origin
        eta = self.eta()
        clock = f"{elapsed:.1f} s elapsed"
        if status == "provisioning":
            clock += "  ·  " + (f"ETA {eta} s" if eta is not None else "ETA unknown (queued)")
        headline = Text.assemble(
            (status, "bold"), (f" · {phase}" if phase else "", "bold cyan"), f"   {clock}"
        )
        grid = Table.grid(padding=(0, 1))
        grid.add_row(self.spinner, headline)
        grid.add_row("", steps)
        return grid


def display_for(*, stream: IO[str], console: Console, json_lines: bool) -> Display:
    """The live display if ``console`` is a real terminal; else JSON or text lines."""
    if json_lines:
        return JsonLines(stream)
    if console.is_terminal and not console.is_dumb_terminal:
        return LiveDisplay(console)
    return TextLines(stream)
