"""`barrelctl complete`: stream a completion to stdout."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from barrelctl import render, state
from barrelctl.client import Completion
from barrelctl.conversation import read_messages
from barrelctl.errors import EXIT_USAGE, CliError
from barrelctl.sampling import with_sampling
from barrelctl.state import JsonOpt
from barreld.engine.sampling import MAX_LOGPROBS

Stop = Annotated[list[str] | None, typer.Option("--stop", help="Stop when this string is generated (repeatable).")]
ParentKey = Annotated[
    str | None, typer.Option("--parent-key", help="The previous turn's `key`, to resume from its checkpoint.")
]
MessagesFile = Annotated[
    str | None,
    typer.Option("--messages", metavar="FILE", show_default=False,
                 help="Complete a conversation instead of PROMPT: a JSON array of {role, content} messages "
                      "(OpenAI's shape), rendered by the model's chat template; '-' reads stdin."),
]
Logprobs = Annotated[int | None, typer.Option("--logprobs", metavar="N", show_default=False,
                                              help="With --json: each token's log probability and the N likeliest "
                                                   "alternatives (0..20).")]


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
            **({"divergence": done.divergence.doc()} if done.divergence else {}),
        },
        "tokens": {"prompt": done.prompt_tokens, "completion": done.completion_tokens},
        "timings_ms": dict(done.timings_ms),
        **({"logprobs": [logprob_json(e) for e in done.logprobs]} if done.logprobs else {}),
    }


def logprob_json(entry: Any) -> dict:
    """One token's entry, in the shape of OpenAI's chat logprobs."""

    def alt(a: Any) -> dict:
        return {"token": a.text.decode("utf-8", "replace"), "logprob": a.logprob, "bytes": list(a.text)}

    return {**alt(entry.chosen), "top_logprobs": [alt(a) for a in entry.top]}


@with_sampling
def complete_run(
    prompt: Annotated[
        str | None, typer.Argument(help="The prompt; '-' or absent reads stdin.", show_default=False)
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Model name (default: the default model, loaded if needed).")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate (1..n_ctx).")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="Sampling temperature; 0 is greedy.")] = 0.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed (0..2**64-1).")] = None,
    stop: Stop = None,
    parent_key: ParentKey = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="Render PROMPT as one user turn through the model's chat template.")
    ] = False,
    messages_file: MessagesFile = None,
    logprobs: Logprobs = None,
    json_out: JsonOpt = False,
    sampling: dict[str, Any] | None = None,
) -> None:
    """Stream a completion of PROMPT (or of a conversation, --messages) to stdout."""
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise CliError(f"bad --logprobs {logprobs}: expected 0..{MAX_LOGPROBS}", EXIT_USAGE)
    as_json = state.want_json(json_out)
    if messages_file is not None and prompt is not None:
        raise CliError("pass either PROMPT or --messages, not both", EXIT_USAGE)
    messages = read_messages(messages_file) if messages_file is not None else ()
    text = b"" if messages else _read_prompt(prompt)
    done = render.stream(
        lambda: state.client().complete(text, model=model or "", max_tokens=max_tokens, temperature=temperature,
                                        seed=seed, stop=stop or [], parent_key=parent_key or "", chat=chat,
                                        messages=messages, sampling=sampling, logprobs=logprobs),
        as_json,
    )
    if as_json:
        render.print_json(done_json(done))


def register(app: typer.Typer) -> None:
    app.command("complete")(complete_run)
