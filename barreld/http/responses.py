"""OpenAI's Responses API (/v1/responses): the body's input items, instructions and tools to the one request
type, the engine's reply events to a response document or to the API's numbered stream events, and the stored
responses that `previous_response_id` continues (GET and DELETE /v1/responses/{id}).

Hosted tools Barrel cannot run (web_search, file_search, code_interpreter, ...) are left out of the prompt and
named in the reply's `barrel.tools_left_out`, never refused: Codex always sends web_search. `reasoning` input
items are accepted and not rendered (the templates agents run do not render them); `include`, `reasoning`,
`prompt_cache_key`, `client_metadata`, `truncation` and `metadata` are accepted: Barrel caches every prompt.
A continuation takes the stored conversation without its instructions, as OpenAI's does, and the stored
state's key as its parent key, so a client that sends only its new items is as warm as one that resends all.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from barreld.engine.chat import MAX_MESSAGES, Message
from barreld.engine.registry import LoadedModel
from barreld.engine.reply import Finish, ReasoningDelta, ReplyEvent, TextDelta
from barreld.engine.request import Started
from barreld.engine.tools import CHOICES, SchemaChecks, Tool, ToolCall, tool_spec
from barreld.errors import InvalidArgument
from barreld.http.body import Body, cache_salt, function_tool, sampling, stop_strings, template_options, utf8
from barreld.http.errors import ApiError
from barreld.http.report import barrel_doc
from barreld.http.response_store import ResponseStore, Stored
from barreld.http.streaming import read_json
from barreld.names import FinishReason
from barreld.service.request import CallRequest

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
KEEP_ALIVE = b": keep-alive\n\n"


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request: the call, and what its reply document echoes."""

    call: CallRequest
    store: bool
    previous: str | None
    history: tuple[Message, ...]  # the conversation without its instructions, stored for a continuation
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats
    left_out: tuple[str, ...] = ()  # hosted tools not offered to the model
    namespaces: Mapping[str, str] = field(default_factory=dict)  # a namespaced tool's name to its namespace


def parse_responses(doc: Mapping[str, Any], previous: Stored | None, checks: SchemaChecks | None = None
                    ) -> ResponsesRequest:
    """`previous`: the stored response `previous_response_id` names (looked up by the caller)."""
    body = Body(doc, checks)
    instructions = body.get("instructions", str, "a string")
    history = (previous.history if previous else ()) + _input(body)
    if len(history) > MAX_MESSAGES:
        raise InvalidArgument(f"too many input items; at most {MAX_MESSAGES}")
    _check_outputs(history)
    tools, left_out, namespaces = _tools(body)
    schema, json_object = _text_format(body)
    messages = ((Message("system", utf8(instructions, "instructions").decode()),) if instructions else ()) + history
    call = CallRequest(
        model=body.get("model", str, "a string") or "",
        stream=bool(body.get("stream", bool, "true or false")),
        messages=messages,
        max_tokens=body.get("max_output_tokens", int, "an integer"),
        until_full=True,
        capped=True,
        sampling=sampling(body),
        constraint=(body.get("grammar", str, "a string of GBNF") or "", schema, json_object),
        stop=stop_strings(body),
        parent_key=previous.key if previous else "",
        tools=tool_spec(tools, _tool_choice(body), body.get("parallel_tool_calls", bool, "true or false") is not False),
        cache_salt=cache_salt(body),
        template_options=template_options(body, reasoning_effort=_effort(body)),
    )
    store = body.get("store", bool, "true or false")
    echo = {name: doc.get(name) for name in ("instructions", "max_output_tokens", "metadata", "temperature",
                                             "top_p", "tool_choice", "tools", "text", "user", "reasoning")}
    return ResponsesRequest(call, store is not False, body.get("previous_response_id", str, "a string"), history,
                            echo, tuple(left_out), namespaces)


def _effort(body: Body) -> str | None:
    """`reasoning.effort` onto the templates' `reasoning_effort` (gpt-oss's)."""
    reasoning = body.get("reasoning", dict, "an object {effort, summary}")
    return Body(reasoning).get("effort", str, "a string") if reasoning else None


def _input(body: Body) -> tuple[Message, ...]:
    """The input items as messages: consecutive function_call items (and the assistant text before them) make
    one assistant turn with its calls; each function_call_output a tool message."""
    given = body.get("input", (str, list), "a string or a list of input items")
    if given is None or given == "" or given == []:
        raise InvalidArgument("input is missing or empty; send a string or a list of input items")
    if isinstance(given, str):
        return (Message("user", utf8(given, "input").decode()),)
    out: list[Message] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidArgument(f"{where} must be an input item object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = ToolCall(_string(item, "call_id", where), _string(item, "name", where),
                            _string(item, "arguments", where))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and not last.tool_call_id:
                out[-1] = replace(last, tool_calls=(*last.tool_calls, call))
            else:
                out.append(Message("assistant", "", (call,)))
        elif kind == "function_call_output":
            out.append(Message("tool", _text(item.get("output"), f"{where}.output"), (),
                               _string(item, "call_id", where)))
        elif kind != "reasoning":
            raise InvalidArgument(f"{where}: input items of type {str(kind)[:40]!r} are not supported; send "
                                  "messages, function_call, function_call_output or reasoning items")
    return tuple(out)


def _message(item: dict, where: str) -> Message:
    role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise InvalidArgument(f"{where}.role must be user, assistant, system or developer")
    return Message(role, _text(item.get("content"), f"{where}.content"))


def _text(content: object, where: str) -> str:
    """A string, or text parts joined; an image, file or audio part is refused (text models only)."""
    if isinstance(content, str):
        return utf8(content, where).decode()
    if not isinstance(content, list):
        raise InvalidArgument(f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise InvalidArgument(f"{where}[{j}]: {kind} parts are not supported; Barrel serves text-only models")
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidArgument(f"{where}[{j}] must be a text part {{type: input_text, text}}")
        texts.append(utf8(part["text"], f"{where}[{j}].text").decode())
    return "".join(texts)


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value and name != "arguments":
        raise InvalidArgument(f"{where}.{name} must be a non-empty string")
    return utf8(value, f"{where}.{name}").decode()


def _check_outputs(history: tuple[Message, ...]) -> None:
    made: set[str] = set()
    for m in history:
        made.update(c.id for c in m.tool_calls)
        if m.tool_call_id and m.tool_call_id not in made:
            raise InvalidArgument(f"no function_call with call_id {m.tool_call_id[:64]!r} precedes its "
                                  "function_call_output; send the call before its output")


def _tools(body: Body) -> tuple[list[Tool], list[str], dict[str, str]]:
    """(the function tools, a namespace's among them under their own names; the hosted tools left out; each
    namespaced tool's namespace, which its calls carry back: Codex's function-call items have the field)."""
    tools: list[Tool] = []
    left_out: list[str] = []
    namespaces: dict[str, str] = {}
    for i, t in enumerate(body.get("tools", list, "a list of tools") or []):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "function":
            tools.append(function_tool(t, f"tools[{i}]", body.checks))
        elif kind == "namespace":
            inner = t.get("tools")
            if not isinstance(inner, list):
                raise InvalidArgument(f"tools[{i}].tools must be a list of function tools")
            space = _string(t, "name", f"tools[{i}]")
            grouped = [function_tool(f, f"tools[{i}].tools[{j}]", body.checks) for j, f in enumerate(inner)]
            namespaces |= {tool.name: space for tool in grouped}
            tools += grouped
        elif isinstance(kind, str):
            left_out.append(kind)
        else:
            raise InvalidArgument(f"tools[{i}] must be a tool object with a type")
    return tools, left_out, namespaces


def _tool_choice(body: Body) -> str:
    choice = body.get("tool_choice", (str, dict), "auto, none, required or {type: function, name}")
    if choice is None or choice in CHOICES:
        return choice or "auto"
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return choice["name"]
    raise InvalidArgument("tool_choice must be auto, none, required or {type: function, name}")


def _text_format(body: Body) -> tuple[object, bool]:
    """(the JSON schema, or None; whether any JSON object will do) from `text.format`."""
    fmt = Body(body.get("text", dict, "an object {format}") or {}).get("format", dict, "an object {type}")
    kind = None if fmt is None else fmt.get("type")
    if kind in (None, "text"):
        return None, False
    if kind == "json_object":
        return None, True
    if kind != "json_schema" or not isinstance(fmt.get("schema"), dict):  # type: ignore[union-attr]
        raise InvalidArgument("text.format must be {type: text}, {type: json_object} or "
                              "{type: json_schema, name, schema}")
    return fmt["schema"], False  # type: ignore[index]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def usage_doc(finish: Finish) -> dict[str, Any]:
    done = finish.done
    return {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": done.cache.restored_tokens},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": finish.reasoning_tokens},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


class ResponseReply:
    """Shapes one request's reply events as a response object, or as the stream's numbered events: the
    reasoning item, the message item and each function_call item, opened, filled and closed in turn, then
    response.completed (or .incomplete at max_output_tokens). A reasoning item carries the thought twice: as
    its one `summary_text` part (what OpenAI's clients show, streamed as reasoning_summary_* events) and as
    its `reasoning_text` content (the raw reasoning, as open-weight servers give it)."""

    ping = KEEP_ALIVE
    tail = b""

    def __init__(self, req: ResponsesRequest, model: LoadedModel, keep: Callable[[Stored], None]) -> None:
        self.req = req
        self.model = model.name
        self.id = new_id("resp")
        self.created = int(time.time())
        self._keep = keep
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # the output items, as they stand
        self._open: dict[str, Any] | None = None  # the message or reasoning item being filled

    def response(self, status: str, finish: Finish | None = None) -> dict[str, Any]:
        doc = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.model, "output": list(self._items), "error": None, "incomplete_details": None,
               "previous_response_id": self.req.previous, "store": self.req.store,
               "parallel_tool_calls": self.req.call.tools is None or self.req.call.tools.parallel,
               "truncation": "disabled", "usage": None, **{k: v for k, v in self.req.echo.items()}}
        doc["tools"] = doc["tools"] or []
        doc["tool_choice"] = doc["tool_choice"] or "auto"
        doc["text"] = doc["text"] or {"format": {"type": "text"}}
        if finish is not None:
            doc["usage"] = usage_doc(finish)
            doc["barrel"] = {**barrel_doc(finish), "tools_left_out": list(self.req.left_out)}
            if status == "incomplete":
                doc["incomplete_details"] = {"reason": "max_output_tokens"}
        return doc

    def document(self, finish: Finish) -> dict[str, Any]:
        """The whole response (its deltas were not streamed: the items are made from the Finish)."""
        self._delta("reasoning", finish.reasoning)
        self._delta("message", finish.content)
        self._finish(finish)
        return self._final

    def frames(self, ev: ReplyEvent) -> list[bytes]:
        if isinstance(ev, Started):
            return [self._event("response.created", response=self.response("in_progress")),
                    self._event("response.in_progress", response=self.response("in_progress"))]
        if isinstance(ev, ReasoningDelta):
            return self._delta("reasoning", ev.text)
        if isinstance(ev, TextDelta):
            return self._delta("message", ev.text)
        return self._finish(ev)

    def error(self, error: ApiError) -> bytes:
        doc = self.response("failed")
        doc["error"] = {"code": error.code or "server_error", "message": error.message}
        return self._event("response.failed", response=doc)

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": self._seq, **fields}, ensure_ascii=False,
                          separators=(",", ":"))
        self._seq += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def _delta(self, kind: str, text: str) -> list[bytes]:
        if not text:
            return []
        out = []
        if self._open is None or self._open["type"] != kind:
            out += self._close()
            out += self._open_item(kind)
        item = self._open
        assert item is not None
        index = len(self._items) - 1
        item["content"][0]["text"] += text
        if kind == "message":
            out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                   content_index=0, delta=text, logprobs=[]))
            return out
        item["summary"][0]["text"] += text
        out.append(self._event("response.reasoning_summary_text.delta", item_id=item["id"], output_index=index,
                               summary_index=0, delta=text))
        out.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                               content_index=0, delta=text))
        return out

    def _open_item(self, kind: str) -> list[bytes]:
        if kind == "message":
            item = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self._items.append(item)
        self._open = item
        index = len(self._items) - 1
        out = [self._event("response.output_item.added", output_index=index, item={**item, "content": []})]
        item["content"].append(part)
        if kind == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part={**part}))
        else:  # the thought is its own summary too: clients show a reasoning item's summary, not its content
            summary = {"type": "summary_text", "text": ""}
            item["summary"].append(summary)
            out.append(self._event("response.reasoning_summary_part.added", item_id=item["id"], output_index=index,
                                   summary_index=0, part={**summary}))
        return out

    def _close(self) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self._items) - 1
        part = item["content"][0]
        if item["type"] == "message":
            item["status"] = "completed"
            return [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part),
                    self._event("response.output_item.done", output_index=index, item=item)]
        summary = item["summary"][0]
        return [self._event("response.reasoning_summary_text.done", item_id=item["id"], output_index=index,
                            summary_index=0, text=summary["text"]),
                self._event("response.reasoning_summary_part.done", item_id=item["id"], output_index=index,
                            summary_index=0, part=summary),
                self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                            content_index=0, text=part["text"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _finish(self, finish: Finish) -> list[bytes]:
        out = self._close()
        if not self._items and not finish.calls:  # an empty reply is still a message, as OpenAI's are
            out += self._open_item("message") + self._close()
        for call in finish.calls:
            out += self._call(call)
        status = "incomplete" if finish.reason is FinishReason.LENGTH else "completed"
        self._final = self.response(status, finish)
        if self.req.store:
            self._keep(Stored(self._final, self._history(finish), finish.done.key.hex()))
        out.append(self._event(f"response.{status}", response=self._final))
        return out

    def _call(self, call: ToolCall) -> list[bytes]:
        item = {"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}
        if call.name in self.req.namespaces:
            item["namespace"] = self.req.namespaces[call.name]
        index = len(self._items)
        self._items.append(item)
        out = [self._event("response.output_item.added", output_index=index, item={**item}),
               self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=call.arguments)]
        item.update(arguments=call.arguments, status="completed")
        out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=call.name, arguments=call.arguments))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _history(self, finish: Finish) -> tuple[Message, ...]:
        """The conversation a continuation resumes: this request's, then the reply as it was generated."""
        return (*self.req.history, Message("assistant", finish.content, finish.calls))


class ResponsesRoutes:
    """The routes, over the app's own key check, call runner and error shapes."""

    def __init__(self, guard: Callable[..., Callable[[Request], Awaitable[Response]]], check_open: Callable[[], None],
                 run: Callable[[Request, CallRequest, Callable[[LoadedModel], Any]], Awaitable[Response]],
                 count: Callable[[CallRequest], Awaitable[int]], store: ResponseStore) -> None:
        self.guard, self.check_open, self.run, self.count, self.store = guard, check_open, run, count, store

    def routes(self) -> list[Route]:
        return [Route("/responses", self.guard(self.create), methods=["POST"]),
                Route("/responses/input_tokens", self.guard(self.input_tokens), methods=["POST"]),
                Route("/responses/{id}", self.guard(self.retrieve), methods=["GET"]),
                Route("/responses/{id}", self.guard(self.delete), methods=["DELETE"])]

    def _parse(self, request: Request, doc: dict[str, Any]) -> ResponsesRequest:
        previous_id = Body(doc).get("previous_response_id", str, "a string")
        previous = None
        if previous_id:
            previous = self.store.get(request.state.tenant, previous_id)
            if previous is None:
                raise ApiError(404, f"Previous response with id '{previous_id[:80]}' not found.",
                               code="previous_response_not_found", param="previous_response_id")
        return parse_responses(doc, previous, request.state.schema_checks)

    async def create(self, request: Request) -> Response:
        self.check_open()
        req = self._parse(request, await read_json(request))
        tenant = request.state.tenant
        return await self.run(request, req.call,
                              lambda model: ResponseReply(req, model, lambda s: self.store.put(tenant, s)))

    async def input_tokens(self, request: Request) -> Response:
        """The input's length in tokens as a response to it would render it; nothing runs on the model."""
        self.check_open()
        req = self._parse(request, await read_json(request))
        return JSONResponse({"object": "response.input_tokens", "input_tokens": await self.count(req.call)})

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(self._stored(request).doc)

    async def delete(self, request: Request) -> Response:
        self._stored(request)
        self.store.delete(request.state.tenant, request.path_params["id"])
        return JSONResponse({"id": request.path_params["id"], "object": "response", "deleted": True})

    def _stored(self, request: Request) -> Stored:
        found = self.store.get(request.state.tenant, request.path_params["id"])
        if found is None:
            raise ApiError(404, f"Response with id '{request.path_params['id'][:80]}' not found.",
                           code="not_found", param="id")
        return found
