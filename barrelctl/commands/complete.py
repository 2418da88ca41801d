"""`barrelctl complete`: stream a completion to stdout."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from barrelctl import render, state
from barrelctl.client import rpc_errors
from barrelctl.errors import EXIT_USAGE, CliError
from barrelctl.state import JsonOpt


def _read_prompt(prompt: str | None) -> bytes:
    if prompt is None or prompt == "-":
        if sys.stdin.isatty() and prompt is None:
            raise CliError("no prompt: pass PROMPT, or '-' to read it from stdin", EXIT_USAGE)
        return sys.stdin.buffer.read()
    return prompt.encode("utf-8", "surrogateescape")


def done_json(done) -> dict:
    c, t = done.cache, done.timings_ms
    return {
        "text": done.text.decode("utf-8", "replace"),
        "model": done.model,
        "finish_reason": done.finish_reason,
        "key": done.key,
        "prompt_key": done.prompt_key,
        "cache": {
            "path": c.path,
            "restored_tokens": c.restored_tokens,
            "prefilled_tokens": c.prefilled_tokens,
            "tier": c.tier or None,
        },
        "tokens": {"prompt": done.prompt_tokens, "completion": done.completion_tokens},
        "timings_ms": {
            "lookup": t.lookup,
            "restore": t.restore,
            "prefill": t.prefill,
            "ttft": t.ttft,
            "total": t.total,
        },
    }


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
    from barreld.rpc import barrel_pb2 as pb

    if max_tokens < 1:
        raise CliError(f"bad --max-tokens {max_tokens}: must be at least 1", EXIT_USAGE)
    if temperature < 0:
        raise CliError(f"bad --temperature {temperature}: must be >= 0", EXIT_USAGE)
    if seed is not None and not 0 <= seed < 2**32:
        raise CliError(f"bad --seed {seed}: expected 0..4294967295", EXIT_USAGE)
    as_json = state.want_json(json_out)
    request = pb.CompleteRequest(
        model=model or "",
        prompt=_read_prompt(prompt),
        max_tokens=max_tokens,
        temperature=temperature,
        stop=stop or [],
        parent_key=parent_key or "",
        chat=chat,
    )
    if seed is not None:
        request.seed = seed
    client = state.client()
    done = None
    status = None
    if not as_json and sys.stderr.isatty():
        status = render.err.status("waiting for the model…")
        status.start()
    call = None
    wrote_newline = True
    try:
        with rpc_errors():
            call = client.stub.Complete(request)
            for ev in call:
                kind = ev.WhichOneof("event")
                if status is not None:
                    status.stop()
                    status = None
                if kind == "token" and not as_json:
                    sys.stdout.buffer.write(ev.token.text)
                    sys.stdout.buffer.flush()
                    wrote_newline = ev.token.text.endswith(b"\n")
                elif kind == "done":
                    done = ev.done
    except KeyboardInterrupt:
        if call is not None:
            call.cancel()
        raise
    finally:
        if status is not None:
            status.stop()
    if done is None:
        raise CliError("the daemon closed the stream without finishing the completion")
    if as_json:
        render.print_json(done_json(done))
    elif not wrote_newline:
        sys.stdout.write("\n")
        sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command("complete")(complete_run)
