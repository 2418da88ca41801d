"""The per-model worker: one thread owns the llama.cpp context and serves every request for that model.

Each tick builds one batch: the next token of every decoding sequence, then the next whole prefill chunk
of each prefilling one (chunks end at multiples of the chunk size, see `barreld.engine.plan`; a request
running alone takes as many as n_batch holds, where the probe proved that exact), within n_batch; a chunk
that does not fit beside the sampling steps goes into a prefill-only tick next. Requests
beyond n_seq_max wait in a bounded FIFO queue. A finished request's sequence stays live so the next turn
can reuse it in place; it is saved (reason `evict`) and released only when its place is needed.

A request's warm start is found, applied and checked by `barreld.engine.warmstart`; the worker only asks it
for one plan and the tokens it kept, then schedules the rest of the prefill.

A reply's tokens were decoded one at a time, which gives other KV than a prefill on most builds, so a next
turn would prefill them again. When nothing has come for settle_after_ms after a reply, the worker settles
them instead: it cuts an idle sequence back to its last exact reuse point and prefills the rest of its text
in the canonical chunks, one chunk per tick, so a request that arrives meanwhile waits at most one chunk.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from barreld.engine import chat
from barreld.engine.backend import Backend, BackendError, BatchItem
from barreld.engine.divergence import LIVE, divergence
from barreld.engine.exactness import ExactReuse
from barreld.engine.gbnf import check_gbnf
from barreld.engine.model_cache import ModelCache
from barreld.engine.plan import Slot, byte_offsets, call_end, plan_batch
from barreld.engine.request import (
    Alternative,
    CompletionParams,
    Done,
    EventSink,
    Failed,
    Request,
    Started,
    Token,
    TokenLogprob,
)
from barreld.engine.sampler import Sampler, logprobs
from barreld.engine.sampling import SamplingParams
from barreld.engine.sequence import Sequence
from barreld.engine.stops import StopScanner
from barreld.engine.tools import forced_grammar
from barreld.engine.warmstart import WarmStart, WarmStarts
from barreld.errors import BarrelError, ContextLengthExceeded, InvalidArgument, ResourceExhausted, Unavailable
from barreld.names import FinishReason, SaveReason

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 64
EXPLAIN_ROWS = 32  # stored rows an explained prompt is compared with, most recently used first


def message_tokens(p: CompletionParams, rendered: bytes, offsets: list[int]) -> list[int]:
    """How many of the prompt's tokens lie within each of its messages' ends; none when its tokens do not
    render back to the prompt (its BOS's text aside)."""
    shift = len(rendered) - len(p.prompt)
    if not p.message_ends or shift < 0 or rendered[shift:] != p.prompt:
        return []
    return [bisect.bisect_right(offsets, shift + end) - 1 for end in p.message_ends]


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class ModelWorker:
    def __init__(self, name: str, backend: Backend, cache: ModelCache, *, max_queue: int = DEFAULT_MAX_QUEUE,
                 turn_ends: tuple[bytes, ...] = (), exact: ExactReuse | None = None):
        self.name = name
        self.backend = backend
        self.cache = cache
        self.starts = WarmStarts(name, cache, backend)
        self.max_queue = max_queue
        # The operator's strings that end this model's turn in a conversation: a base model never samples
        # its template's end-of-turn token, but writes the next turn's marker. A reply that reaches one ends
        # as if the model had ended its turn (not as a stop sequence the client asked for).
        self.turn_ends = turn_ends
        self.exact = exact or ExactReuse(cache.memory.chunk)  # measured at load: how calls may be grouped
        self.seqs = [Sequence(i) for i in range(backend.n_seq_max)]
        # A completion has at least one token: end-of-generation is masked at the first step, or an
        # instruct model given a bare question would often answer with nothing at all.
        self.eog_tokens = np.array([t for t in range(backend.n_vocab) if backend.is_eog(t)], dtype=np.int64)
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: list[Request] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._next_forms: list[tuple[Request, bytes]] = []  # replies to settle in another form (`settle_as`)
        self._next_id = 0
        self._shutdown_saved = 0
        self.settling = False  # an idle sequence's reply may still be settled (`models` shows it)
        self._idle_at = 0.0  # when the last request let go of its sequence
        self._thread = threading.Thread(target=self._run, name=f"worker-{name}", daemon=True)
        self._thread.start()

    # ---- called from server threads -------------------------------------------------------

    def submit(self, params: CompletionParams, events: EventSink | None = None) -> Request:
        """Queues a request. A conversation is rendered here, on the caller's thread: a template is the
        client's to choose, and a slow one must not stall the model's thread for everyone else."""
        turn_ends = self.turn_ends if params.messages or params.chat else ()
        r = self._rendered(params)
        cut = r.call.cut if r.call is not None else None  # a forced call starts where the next turn departs
        params = dataclasses.replace(params, prompt=r.text[:cut], messages=(), chat=False,
                                     message_ends=tuple(e for e in r.ends if cut is None or e <= cut),
                                     opening=r.opening, sampling=self._tool_sampling(params, r), turn_ends=turn_ends)
        with self._cond:
            if self._stopping:
                raise Unavailable(f"model {self.name} is shutting down; retry once it is loaded again")
            if len(self._waiting) >= self.max_queue:
                raise ResourceExhausted(
                    f"model {self.name} has {len(self._waiting)} requests queued (the limit); retry later"
                )
            self._next_id += 1
            req = Request(self._next_id, params) if events is None else Request(self._next_id, params, events)
            self._waiting.append(req)
            self._cond.notify()
        return req

    def counts(self) -> dict[str, int]:
        with self._cond:
            running = sum(1 for s in self.seqs if s.request is not None)
            live = sum(1 for s in self.seqs if s.request is None and s.tokens)
            settling = int(self.settling or bool(self._next_forms))
            return {"running": running, "queued": len(self._waiting), "live": live, "settling": settling}

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def settle_as(self, req: Request, text: bytes) -> None:
        """The text a finished request's sequence is to hold for its next turn: the reply as the next turn
        renders it (a call in other bytes, thoughts left out), settled from where the two part."""
        with self._cond:
            self._next_forms.append((req, text))
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> int:
        """Cancels queued and running requests, runs the `shutdown` saves and joins the thread."""
        with self._cond:
            self._stopping = True
            for req in self._active:
                req.cancel()
            self._cond.notify()
        self._thread.join(timeout)
        return self._shutdown_saved

    # ---- worker thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._waiting or self._active or self._next_forms):
                        wait = self._settle_wait()
                        if wait == 0.0:
                            break
                        self._cond.wait(wait)
                    if self._stopping:
                        for req in self._waiting:
                            req.events.put(Failed(Unavailable(f"model {self.name} was unloaded")))
                        self._waiting.clear()
                        if not self._active:
                            break
                self._take_next_forms()
                self._admit()
                if self._active:
                    waited = self._tick()
                    # A chunk that did not fit gets a prefill-only tick; uncapped, a prefill runs to its end.
                    while (waited or self.cache.uncapped) and self._prefilling():
                        waited = self._tick(prefill_only=True)
                elif not self._waiting and not self._stopping:
                    self._settle_chunk()
            self._shutdown_saved = self.cache.save_all(self.seqs, SaveReason.SHUTDOWN)
        except Exception:
            log.exception("worker for %s crashed", self.name)
            with self._cond:
                for req in [*self._waiting, *self._active]:
                    req.events.put(Failed(BarrelError(f"model {self.name} failed; see the daemon log")))
                self._waiting.clear()
                self._active.clear()
                self._stopping = True

    def _admit(self) -> None:
        while True:
            with self._cond:
                for req in [r for r in self._waiting if r.cancelled.is_set()]:
                    self._waiting.remove(req)
                    log.info("request %d cancelled by its client while queued", req.id)
                    req.events.put(Failed(BarrelError("cancelled")))
                if not self._waiting or not any(s.idle for s in self.seqs):
                    return
                req = self._waiting.popleft()
            try:
                self._start(req)
            except BarrelError as exc:
                req.events.put(Failed(exc))
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the model
                log.exception("request %d failed to start", req.id)
                req.events.put(Failed(BarrelError(f"the request failed to start ({exc}); see the daemon log")))

    def _start(self, req: Request) -> None:
        """Tokenises, builds the sampler (a bad grammar or bias is refused before a sequence is touched),
        finds the best warm start, claims a sequence and sets it up to prefill the rest."""
        tokens, rendered, offsets = self._prompt(req.params)
        req.sampler = Sampler(req.params.sampling, self.backend.n_vocab, self.backend.vocab)
        req.sampler.history(tokens)
        namespace = req.params.namespace
        req.prompt_key = self.cache.key(rendered, namespace)
        t0 = time.perf_counter()
        idle = [s for s in self.seqs if s.idle]
        plan = self.starts.find(tokens, rendered, offsets, req.params.parent_key, idle, namespace)
        req.timings.lookup = time.perf_counter() - t0
        held = [(LIVE, s.rendered) for s in self.seqs if s.tokens and s.namespace.digest == namespace.digest]
        if req.params.explain:
            return self._explain(req, tokens, rendered, offsets, plan, held)
        closest = divergence(rendered, offsets, held) if plan.tokens < len(tokens) else None
        seq = self.starts.claim(plan, idle, namespace)
        t1 = time.perf_counter()
        kept = self.starts.apply(plan, seq, tokens)
        while not kept and plan.fallback is not None:  # the row read did not hold the prompt's tokens
            plan = plan.fallback
            kept = self.starts.apply(plan, seq, tokens)
        req.timings.restore = time.perf_counter() - t1
        seq.request, req.seq, req.target = req, seq.id, tokens
        self._report(req, plan, len(tokens), kept)
        req.cache.divergence = closest if kept < len(tokens) else None
        seq.prompt_len = len(tokens)
        self.cache.count(req.cache.route.counter)
        req.cold_at = self.cache.cold_boundary(len(tokens), kept)
        req.boundaries = self.cache.boundary_points(len(tokens), kept, message_tokens(req.params, rendered, offsets))
        req.snapshot_at = self.cache.memory.snapshot_point(len(tokens), kept)
        req.stops = req.boundaries | {p for p in (req.cold_at, req.snapshot_at) if p}
        if kept and req.snapshot_at == kept:
            self.starts.snapshot(seq)
        req.scanner = StopScanner(list(req.params.stop), list(req.params.turn_ends))
        req.prefill_started = time.perf_counter()
        req.events.put(Started(req.cache, req.prompt_tokens, req.prompt_key))
        with self._cond:
            self._active.append(req)

    @staticmethod
    def _report(req: Request, plan: WarmStart, n: int, kept: int) -> None:
        """What the request reports of its warm start: the route and tier it was served by, `kept` of its n
        prompt tokens put back and the rest prefilled."""
        req.prompt_tokens = n
        req.cache.route, req.cache.tier = plan.served(kept)
        req.cache.restored_tokens = kept
        req.cache.prefilled_tokens = n - kept

    def _explain(self, req: Request, tokens: list[int], rendered: bytes, offsets: list[int], plan: WarmStart,
                 held: list[tuple[str, bytes | bytearray]]) -> None:
        """Answers a look-up-only request: what a completion would restore and, short of the whole prompt,
        where it left the closest text held, stored rows included (read here, off the hot path). Nothing is
        claimed, prefilled or counted as a hit or a miss."""
        if plan.tokens < len(tokens):
            stored = [(key.hex(), text) for key, text in self.cache.stored_texts(EXPLAIN_ROWS, req.params.namespace)]
            req.cache.divergence = divergence(rendered, offsets, [*held, *stored])
        self._report(req, plan, len(tokens), plan.tokens)
        req.events.put(Started(req.cache, req.prompt_tokens, req.prompt_key))
        req.timings.total = time.perf_counter() - req.submitted
        t = req.timings
        req.events.put(Done(b"", FinishReason.EXPLAIN, req.prompt_key, req.prompt_key, req.cache, req.prompt_tokens, 0,
                            type(t)(_ms(t.lookup), 0.0, 0.0, 0.0, _ms(t.total))))

    def _prompt(self, p: CompletionParams) -> tuple[list[int], bytes, list[int]]:
        """The prompt's tokens, the bytes they render to, and each token prefix's length in bytes."""
        tokens = self.backend.tokenize(p.prompt, p.namespace.digest)
        if not tokens:
            raise InvalidArgument("the prompt is empty; pass some text")
        self._check_fits(len(tokens))
        pieces = [self.backend.piece(t) for t in tokens]
        return tokens, b"".join(pieces), byte_offsets(pieces)

    def render(self, p: CompletionParams) -> bytes:
        """The raw prompt, or the conversation rendered through the chat template; on the caller's thread."""
        return self._rendered(p, shape=False).text

    def _rendered(self, p: CompletionParams, shape: bool = True) -> chat.Rendering:
        """`render`, and what this model's cache uses of a conversation's shape: where its messages end (where
        a memory that cannot be cut snapshots), the opening of a next turn, and a forced call's layout."""
        messages = p.messages or ((chat.Message("user", p.prompt.decode("utf-8", "replace")),) if p.chat else ())
        if not messages:
            return chat.Rendering(p.prompt)
        be, conversation = self.backend, shape and bool(p.messages)
        return chat.render_conversation(
            p.chat_template or be.chat_template, messages, ends=conversation and self.cache.snapshots_boundaries,
            opening=conversation and self.cache.memory.cuts_states, call=shape and p.tools is not None and
            p.tools.forced, bos=be.bos_text, eos=be.eos_text, model=self.name, tools=p.tools,
            options=dict(p.template_options))

    def count_tokens(self, params: CompletionParams) -> int:
        """The prompt's length in tokens, as a request with these parameters would have it; reads only the
        vocabulary, so it runs on the caller's thread beside the model's."""
        return len(self.backend.tokenize(self.render(params), params.namespace.digest))

    def _tool_sampling(self, p: CompletionParams, rendering: chat.Rendering) -> SamplingParams:
        """The request's sampling, with a forced tool call's grammar written in the bytes the template writes
        the call back in."""
        if p.tools is None or not p.tools.forced:
            return p.sampling
        if p.sampling.grammar:
            raise InvalidArgument("a forced tool call cannot be combined with a grammar or response_format")
        grammar = forced_grammar(p.tools, rendering.call, rendering.text)
        check_gbnf(grammar)
        return dataclasses.replace(p.sampling, grammar=grammar)

    def _check_fits(self, n_tokens: int) -> None:
        if n_tokens >= self.backend.n_ctx:
            raise ContextLengthExceeded(
                f"the prompt is {n_tokens} tokens but the context holds {self.backend.n_ctx}; "
                f"shorten it or load the model with a larger --n-ctx"
            )

    def _prefilling(self) -> bool:
        return any(r.pending is None and len(self.seqs[r.seq].tokens) < len(r.target) for r in self._active)

    def _tick(self, prefill_only: bool = False) -> bool:
        """One batch; returns whether a prefill chunk had to wait for room."""
        for req in [r for r in self._active if r.cancelled.is_set()]:
            self._finish(req, FinishReason.CANCELLED)
        self._sample_stored()
        active = list(self._active)
        slots = [Slot(r.seq, len(self.seqs[r.seq].tokens), r.target, r.pending, r.stops) for r in active]
        memory = self.cache.memory
        batch = plan_batch(slots, memory.chunk, self.backend.n_batch, prefill_only, self.exact.merged,
                           memory.min_batch, memory.spans, self.exact.shared)
        if not batch.items:
            return batch.waiting
        logits: dict[int, np.ndarray] = {}
        try:
            for start, stop in batch.calls:
                self.backend.decode(batch.items[start:stop])
                logits |= {i: self.backend.logits(i - start) for _, i in batch.prefills if start <= i < stop}
            # Prefill rows are copies (the next call overwrites them; a sequence keeps them); the sampling
            # steps, all in the last call, are read in place and taken before anything decodes again.
            rows = [self.backend.row(i - batch.calls[-1][0]) for _, i in batch.samples]
        except BackendError as exc:
            log.error("decode failed: %s", exc)
            for req in active:
                self._fail(req, BarrelError(f"llama.cpp decode failed: {exc}"))
            return False
        for i, idx in batch.prefills:
            self._prefilled(active[i], batch.items[idx].pos + 1, logits[idx])
        for (i, _), row in zip(batch.samples, rows, strict=True):
            self._sampled(active[i], row)
        return batch.waiting

    def _prefilled(self, req: Request, end: int, logits: np.ndarray) -> None:
        """The prompt is in the sequence up to `end`, a chunk boundary: a cold checkpoint or a snapshot there
        if due, sampling if it is all in."""
        seq = self.seqs[req.seq]
        for t in req.target[len(seq.tokens) : end]:
            seq.append(t, self.backend.piece(t), prefilled=True)
        seq.frontier_logits = logits
        if end == len(req.target) and self.cache.memory.cuts_live:
            seq.keep_logits({end: logits})  # the prompt's own: resent, it samples from them once cut back to it
        if end in req.boundaries:
            req.snapshot_saves.append(self.cache.boundary_snapshot(seq))
        elif end == req.cold_at:
            self.cache.save_async(seq, SaveReason.COLD)
        if end == req.snapshot_at:
            self.starts.snapshot(seq)
        if end == len(req.target):
            req.timings.prefill = time.perf_counter() - req.prefill_started
            self._take(req, logits, lambda: self._prefill_over(req, seq, end))

    def _prefill_over(self, req: Request, seq: Sequence, end: int) -> None:
        """Once the first token is out: the end snapshot's read if due, then the prefill's snapshots queued."""
        if req.snapshot_at != end:
            req.snapshot_saves.append(self.cache.end_snapshot(seq))
        req.queue_snapshots()

    def _sampled(self, req: Request, logits: np.ndarray) -> None:
        """The pending token is in KV now; a continued checkpoint if due, then the next token."""
        seq = self.seqs[req.seq]
        seq.append(req.pending, self.backend.piece(req.pending), prefilled=self.exact.generated)
        req.pending = None
        if self.cache.continued_due(req.generated):
            self.cache.save_async(seq, SaveReason.CONTINUED)
        self._take(req, logits)

    def _sample_stored(self) -> None:
        """Requests whose whole prompt was restored with its last logits sample without a decode."""
        for req in list(self._active):
            seq = self.seqs[req.seq]
            whole = req.generated == 0 and req.pending is None and seq.frontier == len(req.target)
            if whole and seq.frontier_logits is not None:
                req.timings.prefill = time.perf_counter() - req.prefill_started
                self._take(req, seq.frontier_logits)

    def _take(self, req: Request, logits: np.ndarray, streamed: Callable[[], None] | None = None) -> None:
        """Samples the next token, streams its text, and finishes the request when a limit is reached.

        `streamed` runs once the token is handed to the front end and before any finish: work on the state the
        prompt left (the end snapshot's read, 25-35 ms at 13k tokens on Gemma 3) that need not delay the first
        token, since sampling changes nothing in KV."""
        seq = self.seqs[req.seq]
        token = self._sample(req, logits)
        if token is None:
            return
        req.generated += 1
        now = time.perf_counter()
        if req.first_token_at is None:
            req.first_token_at = now
            req.timings.ttft = now - req.submitted
        if self.backend.is_eog(token):
            if streamed is not None:
                streamed()
            self._finish(req, FinishReason.STOP, token)
            return
        if req.params.logprobs is not None:
            req.logprobs.append(self._logprob(logits, token, req.params.logprobs))
        out = req.scanner.feed(self.backend.piece(token))
        if out:
            req.events.put(Token(out, req.unsent_logprobs()))
        if streamed is not None:
            streamed()
        if req.scanner.stopped:
            self._finish(req, FinishReason.STOP, token)
        elif req.generated >= req.params.max_tokens or len(seq.tokens) + 1 >= self.backend.n_ctx:
            self._finish(req, FinishReason.LENGTH, token)
        else:
            req.pending = token

    def _sample(self, req: Request, logits: np.ndarray) -> int | None:
        """The sampler's token; None when it failed the request (a grammar that allows nothing here).

        Unconstrained, end-of-generation is masked at the first step; under a grammar the grammar decides."""
        if req.generated == 0 and not req.sampler.constrained:
            logits = logits.copy()
            logits[self.eog_tokens] = -np.inf
        try:
            return req.sampler.sample(logits)
        except InvalidArgument as exc:
            self._fail(req, exc)
            return None

    def _logprob(self, logits: np.ndarray, token: int, n: int) -> TokenLogprob:
        own, top = logprobs(logits, token, n)
        piece = self.backend.piece
        return TokenLogprob(Alternative(token, piece(token), own), tuple(Alternative(t, piece(t), lp) for t, lp in top))

    def _finish(self, req: Request, reason: FinishReason, last: int | None = None) -> None:
        """Appends the last sampled token to the sequence's text, hands the finish save to the writers, then
        answers.

        The prefill's snapshots (all a cancelled prefill read is still exact) and the save are queued before the
        client hears Done, so a next turn finds them stored or in flight (and waits for them), never missing.
        """
        seq = self.seqs[req.seq]
        req.queue_snapshots()
        if reason is FinishReason.CANCELLED:
            log.info("request %d cancelled by its client after %d tokens; generation stopped", req.id, req.generated)
            last = req.pending
        req.pending = None
        tail = b"" if req.scanner.stopped else req.scanner.flush()
        if tail:
            req.events.put(Token(tail, req.unsent_logprobs()))
        if last is not None and len(seq.tokens) >= len(req.target):
            # Text only: a generated token's KV is never reused, so it is not evaluated (see Sequence).
            seq.append(last, self.backend.piece(last), prefilled=False)
        self.cache.save_async(seq, SaveReason.FINISH)
        req.timings.total = time.perf_counter() - req.submitted
        t = req.timings
        req.events.put(
            Done(
                text=req.scanner.text,
                finish_reason=reason,
                key=self.cache.key(bytes(seq.rendered), seq.namespace),
                prompt_key=req.prompt_key,
                cache=req.cache,
                prompt_tokens=req.prompt_tokens,
                completion_tokens=req.generated,
                timings=type(t)(_ms(t.lookup), _ms(t.restore), _ms(t.prefill), _ms(t.ttft), _ms(t.total)),
                logprobs=tuple(req.logprobs[: req.logprobs_sent]),
                stop=req.scanner.matched if req.scanner.matched in req.params.stop else b"",
            )
        )
        if reason is not FinishReason.CANCELLED:
            self._open_next_turn(req, seq)
        self._release(req)

    def _open_next_turn(self, req: Request, seq: Sequence) -> None:
        """Appends the opening of a chat's next turn to its text (not evaluated), which a client that goes on
        sends after the reply: settling prefills it with the reply, unless a stop string cut the reply."""
        held, opening = bytes(seq.rendered), req.params.opening
        expected = bytes(seq.rendered[: seq.offsets[req.prompt_tokens]]) + req.scanner.text + opening
        if not opening or len(expected) <= len(held) or not expected.startswith(held):
            return
        tokens = self.backend.tokenize_tail(expected[len(held) :])
        if len(seq.tokens) + len(tokens) < self.backend.n_ctx and \
                seq.take(seq.tokens + tokens, self.backend.piece, expected) is not None:
            self.cache.count("opening_tokens", len(tokens))

    # ---- settling replies while idle --------------------------------------------------------

    def _take_next_forms(self) -> None:
        """Gives each sequence its reply's next form, tokenised as the next prompt will be, from its first token
        that differs (unevaluated: settling prefills them); not where another request has taken the sequence."""
        with self._cond:
            forms, self._next_forms = self._next_forms, []
        for req, text in forms:
            seq = self.seqs[req.seq]
            reply, held = req.params.prompt + req.scanner.text, bytes(seq.rendered)
            # Still this reply, with at most its end-of-generation token or the next turn's opening after it.
            if seq.idle and held.startswith(reply) and len(held) <= len(reply) + len(req.params.opening) + 64:
                old, tokens = len(seq.tokens), self.backend.tokenize(text, req.params.namespace.digest)
                at = seq.take(tokens, self.backend.piece, text) if len(tokens) < self.backend.n_ctx else None
                if at is not None and at < old:  # not only text added: some of the reply's tokens replaced
                    self.cache.count("next_forms", 1)

    def _settle_point(self, seq: Sequence) -> int:
        """Where settling an idle sequence starts: its last exact reuse point before the end of its text, from
        which the rest is prefilled without a token alone in its batch; 0 when there is nothing to settle."""
        n, memory = len(seq.tokens), self.cache.memory
        if not seq.idle or seq.frontier >= n:
            return 0
        pos_min, pos_max = self.backend.seq_pos_range(seq.id)
        if memory.cuts_live:
            k = memory.live_point(n, seq.frontier, n, n, None, pos_min)
        elif pos_max == seq.frontier - 1 and memory.restore_point(seq.frontier, n, n, None) == seq.frontier:
            k = seq.frontier  # a state that cannot be cut, held at its frontier: a settle under way
        elif seq.snapshot is not None:
            k = memory.restore_point(seq.snapshot.length, n, n, None)
        else:
            k = 0
        return k if 0 < k < n and n - k <= self.cache.policy.settle_tokens else 0

    def _settle_wait(self) -> float | None:
        """Seconds until settling may start (0: now), None when there is nothing to settle."""
        if self._unsettled() is None:
            return None
        return max(0.0, self._idle_at + self.cache.policy.settle_after_ms / 1000.0 - time.monotonic())

    def _unsettled(self) -> tuple[Sequence, int] | None:
        """An idle sequence with text to settle, and where its settling starts."""
        found = next(((s, k) for s in self.seqs if (k := self._settle_point(s))), None)
        self.settling = found is not None
        return found

    def _settle_chunk(self) -> None:
        """Prefills the next canonical chunk of an idle sequence's unsettled text, first putting it back to
        where settling starts (a cut, or for a memory that cannot be cut its snapshot)."""
        found = self._unsettled()
        if found is None:
            return
        seq, k = found
        if k < seq.frontier or self.backend.seq_pos_range(seq.id)[1] != seq.frontier - 1:
            self.cache.save_before_cut(seq, k)
            if self.cache.memory.cuts_live:
                self.backend.seq_rm(seq.id, k, -1)
            else:
                self.backend.state_set(seq.id, memoryview(seq.snapshot.state))
            seq.rewind(k)
            if not self.cache.memory.holds(k, *self.backend.seq_pos_range(seq.id)):
                log.warning("settling sequence %d: llama.cpp does not hold its first %d tokens; dropped", seq.id, k)
                self.backend.seq_rm(seq.id, 0, -1)
                seq.clear()
                return
        start, memory = seq.frontier, self.cache.memory
        end = call_end(start, len(seq.tokens), memory.chunk, 0, min_batch=memory.min_batch, spans=memory.spans)
        try:
            self.backend.decode([BatchItem(seq.tokens[p], p, seq.id, p == end - 1) for p in range(start, end)])
        except BackendError as exc:
            log.error("settling sequence %d failed: %s", seq.id, exc)
            self.backend.seq_rm(seq.id, 0, -1)
            seq.clear()
            return
        seq.prefilled(end, self.backend.logits(end - start - 1))
        self.cache.count("settled_tokens", end - start)

    def _fail(self, req: Request, exc: Exception) -> None:
        seq = self.seqs[req.seq]
        self.backend.seq_rm(seq.id, 0, -1)
        seq.clear()
        req.queue_snapshots()  # what the prefill read before the failure is still exact
        req.events.put(Failed(exc))
        self._release(req)

    def _release(self, req: Request) -> None:
        seq = self.seqs[req.seq]
        seq.request = None
        self.settling = True  # until the loop finds nothing to settle
        self._idle_at = time.monotonic()
        seq.last_used = time.monotonic()
        with self._cond:
            if req in self._active:
                self._active.remove(req)
            self._cond.notify()
