"""`barrelctl chat`: a conversation in the terminal. Every turn resends the whole conversation as messages,
so each one starts warm from the turns before it; a dim line after each reply shows how warm.

On a terminal the prompt line has history and editing (prompt_toolkit); with stdin not a terminal each line
is one user message, so a chat can be scripted. Lines starting with `/` are commands either way.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from barrelctl import render, state
from barrelctl.conversation import read_messages, write_messages
from barrelctl.errors import EXIT_UNREACHABLE, EXIT_USAGE, ClientError, CliError
from barrelctl.sampling import with_sampling
from barreld.engine.chat import Message

PROMPT = ">>> "
HELP = (
    "/save FILE     write the conversation as a JSON messages array (read back with --resume)",
    "/system TEXT   set the system message (/system alone shows it)",
    "/clear         forget the conversation, keep the system message",
    "/exit, /quit   leave (Ctrl-D too); Ctrl-C stops a reply in progress",
)


@dataclass
class Session:
    model: str
    max_tokens: int
    temperature: float
    interactive: bool
    messages: list[Message] = field(default_factory=list)
    seed: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # the Sampling message's fields

    def set_system(self, text: str) -> None:
        turns = self.messages[1:] if self.messages and self.messages[0].role == "system" else self.messages
        self.messages = [Message("system", text), *turns]

    def system(self) -> str | None:
        return self.messages[0].content if self.messages and self.messages[0].role == "system" else None

    def clear(self) -> None:
        system = self.system()
        self.messages = [Message("system", system)] if system is not None else []


def turn(session: Session, text: str) -> None:
    """Sends the conversation with `text` as the next user message and streams the reply. A reply cut short
    by Ctrl-C, or refused, leaves the conversation as it was before the turn."""
    asked = [*session.messages, Message("user", text)]
    try:
        done = render.stream(
            lambda: state.client().complete(b"", model=session.model, messages=asked,
                                            max_tokens=session.max_tokens, temperature=session.temperature,
                                            seed=session.seed, sampling=session.sampling),
            as_json=False,
        )
    except KeyboardInterrupt:
        render.note("cancelled; this turn is not kept")
        return
    except ClientError as exc:
        if not session.interactive or exc.code == EXIT_UNREACHABLE:
            raise
        print(f"barrelctl: {exc}", file=sys.stderr)
        return
    session.messages = [*asked, Message("assistant", done.text.decode("utf-8", "replace"))]
    render.chat_footer(done)


def _save(session: Session, arg: str) -> None:
    if not arg:
        raise CliError("usage: /save FILE", EXIT_USAGE)
    try:
        write_messages(Path(arg), session.messages)
    except OSError as exc:
        raise CliError(f"cannot save to {arg}: {exc.strerror or exc}") from None
    render.note(f"saved {len(session.messages)} messages to {arg}")


def _system(session: Session, arg: str) -> None:
    if arg:
        session.set_system(arg)
    else:
        render.note(f"system: {session.system()}" if session.system() is not None else "no system message")


def _clear(session: Session, arg: str) -> None:
    session.clear()
    render.note("conversation cleared")


def _help(session: Session, arg: str) -> None:
    for line in HELP:
        render.note(line)


COMMANDS: dict[str, Callable[[Session, str], None]] = {
    "/save": _save, "/system": _system, "/clear": _clear, "/help": _help,
}


def command(session: Session, line: str) -> bool:
    """Runs one /command; False for /exit. A bad one says so on one line and the session goes on."""
    name, _, arg = line.strip().partition(" ")
    if name in ("/exit", "/quit"):
        return False
    action = COMMANDS.get(name)
    try:
        if action is None:
            raise CliError(f"unknown command {name}; /help lists the commands", EXIT_USAGE)
        action(session, arg.strip())
    except CliError as exc:
        print(f"barrelctl: {exc}", file=sys.stderr)
    return True


def terminal_lines() -> Iterator[str]:
    """Lines typed at a prompt with history and editing; Ctrl-C clears the line, Ctrl-D ends. With stdout
    redirected the prompt goes to stderr, so the file gets only the replies."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import InMemoryHistory
    from prompt_toolkit.output import create_output

    output = None if sys.stdout.isatty() else create_output(stdout=sys.stderr)
    prompt: PromptSession[str] = PromptSession(history=InMemoryHistory(), output=output)
    while True:
        try:
            yield prompt.prompt(PROMPT)
        except KeyboardInterrupt:
            continue
        except EOFError:
            return


def piped_lines() -> Iterator[str]:
    for line in sys.stdin:
        yield line.rstrip("\r\n")


@with_sampling
def chat_run(
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Model name (default: the default model, loaded if needed).")
    ] = None,
    system: Annotated[str | None, typer.Option("--system", help="A system message to open with.")] = None,
    resume: Annotated[
        str | None,
        typer.Option("--resume", metavar="FILE",
                     help="Continue a conversation saved with /save (a JSON messages array)."),
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens per reply (1..n_ctx).")] = 512,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="Sampling temperature; 0 is greedy.")] = 0.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed (0..2**64-1).")] = None,
    sampling: dict[str, Any] | None = None,
) -> None:
    """Hold a conversation: each line you type is a user message, the reply streams back."""
    if state.options.json:
        raise CliError("chat has no JSON output; use `complete --messages FILE` in scripts", EXIT_USAGE)
    interactive = sys.stdin.isatty()
    if resume == "-":
        raise CliError("--resume needs a file: stdin carries the conversation's new messages", EXIT_USAGE)
    session = Session(model or "", max_tokens, temperature, interactive, seed=seed, sampling=sampling or {})
    if resume is not None:
        session.messages = list(read_messages(resume))
    if system is not None:
        session.set_system(system)
    if interactive:
        render.note(f"chat with {model or 'the default model'}; /help lists commands, Ctrl-D leaves")
    for line in terminal_lines() if interactive else piped_lines():
        if line.lstrip().startswith("/"):
            if not command(session, line):
                return
        elif line.strip():
            turn(session, line)


def register(app: typer.Typer) -> None:
    app.command("chat")(chat_run)
