"""`barrelctl complete`: stream a completion to stdout."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated

import typer

from barrelctl import render, state
from barrelctl.client import Completion, CompletionStream, Token
from barrelctl.errors import EXIT_USAGE, CliError
from barrelctl.state import JsonOpt


def _read_prompt(prompt: str | None) -> bytes:
    if prompt is None or prompt == "-":
        if sys.stdin.isatty() and prompt is None:
            raise CliError("no prompt: pass PROMPT, or '-' to read it from stdin", EXIT_USAGE)
        return sys.stdin.buffer.read()
    return prompt.encode("utf-8", "surrogateescape")


def done_json(done: Completion) -> dict:
    """The contract's completion document."""
    return {
        "text": done.text.decode("utf-8", "replace"),
        "model": done.model,
        "finish_reason": done.finish_reason,
        "key": done.key,
        "prompt_key": done.prompt_key,
        "cache": {
            "path": done.route,
            "restored_tokens": done.restored,
            "prefilled_tokens": done.prefilled,
            "tier": done.tier,
        },
        "tokens": {"prompt": done.prompt_tokens, "completion": done.completion_tokens},
        "timings_ms": dict(done.timings_ms),
    }


def _check(max_tokens: int, temperature: float, seed: int | None) -> None:
    if max_tokens < 1:
        raise CliError(f"bad --max-tokens {max_tokens}: must be at least 1", EXIT_USAGE)
    if temperature < 0:
        raise CliError(f"bad --temperature {temperature}: must be >= 0", EXIT_USAGE)
    if seed is not None and not 0 <= seed < 2**32:
        raise CliError(f"bad --seed {seed}: expected 0..4294967295", EXIT_USAGE)


def _stream(start: Callable[[], CompletionStream], as_json: bool) -> Completion:
    """Runs the call, writing tokens to stdout as they come (unless JSON), a spinner on a terminal until the
    first event; Ctrl-C cancels the request in the daemon too."""
    status = None
    if not as_json and sys.stderr.isatty():
        status = render.err.status("waiting for the model…")
        status.start()
    stream = None
    wrote_newline = True
    try:
        stream = start()
        for ev in stream:
            if status is not None:
                status.stop()
                status = None
            if isinstance(ev, Token) and not as_json:
                sys.stdout.buffer.write(ev.text)
                sys.stdout.buffer.flush()
                wrote_newline = ev.text.endswith(b"\n")
        done = stream.result()
    except KeyboardInterrupt:
        if stream is not None:
            stream.cancel()
        raise
    finally:
        if status is not None:
            status.stop()
    if not as_json and not wrote_newline:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return done


def complete_run(
    prompt: Annotated[
        str | None, typer.Argument(help="The prompt; '-' or absent reads stdin.", show_default=False)
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Model name (default: the default model, loaded if needed).")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate (1..n_ctx).")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="Sampling temperature; 0 is greedy.")] = 0.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed (0..4294967295).")] = None,
    stop: Annotated[
        list[str] | None, typer.Option("--stop", help="Stop when this string is generated (repeatable).")
    ] = None,
    parent_key: Annotated[
        str | None, typer.Option("--parent-key", help="The previous turn's `key`, to resume from its checkpoint.")
    ] = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="Render PROMPT as one user turn through the model's chat template.")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Stream a completion of PROMPT to stdout."""
    _check(max_tokens, temperature, seed)
    as_json = state.want_json(json_out)
    text = _read_prompt(prompt)
    done = _stream(
        lambda: state.client().complete(text, model=model or "", max_tokens=max_tokens, temperature=temperature,
                                        seed=seed, stop=stop or [], parent_key=parent_key or "", chat=chat),
        as_json,
    )
    if as_json:
        render.print_json(done_json(done))


def register(app: typer.Typer) -> None:
    app.command("complete")(complete_run)
