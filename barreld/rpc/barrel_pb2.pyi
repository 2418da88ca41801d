from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompleteRequest(_message.Message):
    __slots__ = ("model", "prompt", "max_tokens", "temperature", "seed", "stop", "parent_key", "chat", "messages", "chat_template", "sampling", "logprobs", "explain", "cache_salt", "tenant")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: bytes
    max_tokens: int
    temperature: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    parent_key: str
    chat: bool
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    chat_template: str
    sampling: Sampling
    logprobs: int
    explain: bool
    cache_salt: str
    tenant: str
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[bytes] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., parent_key: _Optional[str] = ..., chat: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., chat_template: _Optional[str] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., logprobs: _Optional[int] = ..., explain: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "logit_bias", "grammar", "json_schema", "json_object")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    REPEAT_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPEAT_LAST_N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    top_k: int
    top_p: float
    min_p: float
    typical_p: float
    repeat_penalty: float
    repeat_last_n: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    grammar: str
    json_schema: str
    json_object: bool
    def __init__(self, top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., repeat_penalty: _Optional[float] = ..., repeat_last_n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar: _Optional[str] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ...) -> None: ...

class Alternative(_message.Message):
    __slots__ = ("token", "text", "logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: int
    text: bytes
    logprob: float
    def __init__(self, token: _Optional[int] = ..., text: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("chosen", "top")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    chosen: Alternative
    top: _containers.RepeatedCompositeFieldContainer[Alternative]
    def __init__(self, chosen: _Optional[_Union[Alternative, _Mapping]] = ..., top: _Optional[_Iterable[_Union[Alternative, _Mapping]]] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("path", "restored_tokens", "prefilled_tokens", "tier", "divergence")
    PATH_FIELD_NUMBER: _ClassVar[int]
    RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
    path: str
    restored_tokens: int
    prefilled_tokens: int
    tier: str
    divergence: Divergence
    def __init__(self, path: _Optional[str] = ..., restored_tokens: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ..., tier: _Optional[str] = ..., divergence: _Optional[_Union[Divergence, _Mapping]] = ...) -> None: ...

class Divergence(_message.Message):
    __slots__ = ("matched_tokens", "matched_bytes", "cached", "prompt", "against")
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    AGAINST_FIELD_NUMBER: _ClassVar[int]
    matched_tokens: int
    matched_bytes: int
    cached: bytes
    prompt: bytes
    against: str
    def __init__(self, matched_tokens: _Optional[int] = ..., matched_bytes: _Optional[int] = ..., cached: _Optional[bytes] = ..., prompt: _Optional[bytes] = ..., against: _Optional[str] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("lookup", "restore", "prefill", "ttft", "total")
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TTFT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    lookup: float
    restore: float
    prefill: float
    ttft: float
    total: float
    def __init__(self, lookup: _Optional[float] = ..., restore: _Optional[float] = ..., prefill: _Optional[float] = ..., ttft: _Optional[float] = ..., total: _Optional[float] = ...) -> None: ...

class CompleteStarted(_message.Message):
    __slots__ = ("cache", "prompt_tokens", "prompt_key", "model")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    cache: CacheInfo
    prompt_tokens: int
    prompt_key: str
    model: str
    def __init__(self, cache: _Optional[_Union[CacheInfo, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., prompt_key: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class CompleteToken(_message.Message):
    __slots__ = ("text", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: bytes
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[bytes] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class CompleteDone(_message.Message):
    __slots__ = ("text", "model", "finish_reason", "key", "prompt_key", "cache", "prompt_tokens", "completion_tokens", "timings_ms", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_MS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: bytes
    model: str
    finish_reason: str
    key: str
    prompt_key: str
    cache: CacheInfo
    prompt_tokens: int
    completion_tokens: int
    timings_ms: Timings
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[bytes] = ..., model: _Optional[str] = ..., finish_reason: _Optional[str] = ..., key: _Optional[str] = ..., prompt_key: _Optional[str] = ..., cache: _Optional[_Union[CacheInfo, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., timings_ms: _Optional[_Union[Timings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class CompleteEvent(_message.Message):
    __slots__ = ("started", "token", "done")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    started: CompleteStarted
    token: CompleteToken
    done: CompleteDone
    def __init__(self, started: _Optional[_Union[CompleteStarted, _Mapping]] = ..., token: _Optional[_Union[CompleteToken, _Mapping]] = ..., done: _Optional[_Union[CompleteDone, _Mapping]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("name", "path", "tier", "n_ctx", "n_batch", "n_seq_max", "policy", "fingerprint", "n_threads", "n_gpu_layers", "flash_attn", "type_k", "type_v", "swa_full", "aliases", "stop")
    class PolicyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    N_BATCH_FIELD_NUMBER: _ClassVar[int]
    N_SEQ_MAX_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    N_THREADS_FIELD_NUMBER: _ClassVar[int]
    N_GPU_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FLASH_ATTN_FIELD_NUMBER: _ClassVar[int]
    TYPE_K_FIELD_NUMBER: _ClassVar[int]
    TYPE_V_FIELD_NUMBER: _ClassVar[int]
    SWA_FULL_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    tier: str
    n_ctx: int
    n_batch: int
    n_seq_max: int
    policy: _containers.ScalarMap[str, str]
    fingerprint: str
    n_threads: int
    n_gpu_layers: int
    flash_attn: bool
    type_k: str
    type_v: str
    swa_full: bool
    aliases: _containers.RepeatedScalarFieldContainer[str]
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., tier: _Optional[str] = ..., n_ctx: _Optional[int] = ..., n_batch: _Optional[int] = ..., n_seq_max: _Optional[int] = ..., policy: _Optional[_Mapping[str, str]] = ..., fingerprint: _Optional[str] = ..., n_threads: _Optional[int] = ..., n_gpu_layers: _Optional[int] = ..., flash_attn: _Optional[bool] = ..., type_k: _Optional[str] = ..., type_v: _Optional[str] = ..., swa_full: _Optional[bool] = ..., aliases: _Optional[_Iterable[str]] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "path", "fingerprint", "tier", "n_ctx", "n_batch", "n_seq_max", "state", "running", "queued", "live", "policy", "quant", "is_default", "memory", "swa_window", "reuse", "n_threads", "n_gpu_layers", "gpu_layers", "flash_attn", "type_k", "type_v", "swa_full", "prefill_chunk", "error", "aliases", "stop", "tool_format", "exact_reuse", "settling")
    class PolicyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    N_BATCH_FIELD_NUMBER: _ClassVar[int]
    N_SEQ_MAX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    QUANT_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    SWA_WINDOW_FIELD_NUMBER: _ClassVar[int]
    REUSE_FIELD_NUMBER: _ClassVar[int]
    N_THREADS_FIELD_NUMBER: _ClassVar[int]
    N_GPU_LAYERS_FIELD_NUMBER: _ClassVar[int]
    GPU_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FLASH_ATTN_FIELD_NUMBER: _ClassVar[int]
    TYPE_K_FIELD_NUMBER: _ClassVar[int]
    TYPE_V_FIELD_NUMBER: _ClassVar[int]
    SWA_FULL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    EXACT_REUSE_FIELD_NUMBER: _ClassVar[int]
    SETTLING_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    fingerprint: str
    tier: str
    n_ctx: int
    n_batch: int
    n_seq_max: int
    state: str
    running: int
    queued: int
    live: int
    policy: _containers.ScalarMap[str, str]
    quant: str
    is_default: bool
    memory: str
    swa_window: int
    reuse: str
    n_threads: int
    n_gpu_layers: int
    gpu_layers: int
    flash_attn: bool
    type_k: str
    type_v: str
    swa_full: bool
    prefill_chunk: int
    error: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    stop: _containers.RepeatedScalarFieldContainer[str]
    tool_format: str
    exact_reuse: ExactReuse
    settling: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., fingerprint: _Optional[str] = ..., tier: _Optional[str] = ..., n_ctx: _Optional[int] = ..., n_batch: _Optional[int] = ..., n_seq_max: _Optional[int] = ..., state: _Optional[str] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., live: _Optional[int] = ..., policy: _Optional[_Mapping[str, str]] = ..., quant: _Optional[str] = ..., is_default: _Optional[bool] = ..., memory: _Optional[str] = ..., swa_window: _Optional[int] = ..., reuse: _Optional[str] = ..., n_threads: _Optional[int] = ..., n_gpu_layers: _Optional[int] = ..., gpu_layers: _Optional[int] = ..., flash_attn: _Optional[bool] = ..., type_k: _Optional[str] = ..., type_v: _Optional[str] = ..., swa_full: _Optional[bool] = ..., prefill_chunk: _Optional[int] = ..., error: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., stop: _Optional[_Iterable[str]] = ..., tool_format: _Optional[str] = ..., exact_reuse: _Optional[_Union[ExactReuse, _Mapping]] = ..., settling: _Optional[bool] = ...) -> None: ...

class ExactReuse(_message.Message):
    __slots__ = ("grain", "generated", "source", "probe_ms", "rule", "min_batch", "merged", "spans", "shared")
    GRAIN_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROBE_MS_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    MIN_BATCH_FIELD_NUMBER: _ClassVar[int]
    MERGED_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    grain: int
    generated: bool
    source: str
    probe_ms: float
    rule: str
    min_batch: int
    merged: bool
    spans: bool
    shared: int
    def __init__(self, grain: _Optional[int] = ..., generated: _Optional[bool] = ..., source: _Optional[str] = ..., probe_ms: _Optional[float] = ..., rule: _Optional[str] = ..., min_batch: _Optional[int] = ..., merged: _Optional[bool] = ..., spans: _Optional[bool] = ..., shared: _Optional[int] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadModelReply(_message.Message):
    __slots__ = ("saved",)
    SAVED_FIELD_NUMBER: _ClassVar[int]
    saved: int
    def __init__(self, saved: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsReply(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class CacheRow(_message.Message):
    __slots__ = ("key", "model", "tier", "size", "tokens", "text_bytes", "save_reason", "status", "refcount", "hits", "last_used", "created", "location", "memory", "frontier", "blocks", "own_bytes", "shared_bytes", "tenant", "namespace")
    KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAVE_REASON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REFCOUNT_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    FRONTIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OWN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    key: str
    model: str
    tier: str
    size: int
    tokens: int
    text_bytes: int
    save_reason: str
    status: str
    refcount: int
    hits: int
    last_used: float
    created: float
    location: str
    memory: str
    frontier: int
    blocks: int
    own_bytes: int
    shared_bytes: int
    tenant: str
    namespace: str
    def __init__(self, key: _Optional[str] = ..., model: _Optional[str] = ..., tier: _Optional[str] = ..., size: _Optional[int] = ..., tokens: _Optional[int] = ..., text_bytes: _Optional[int] = ..., save_reason: _Optional[str] = ..., status: _Optional[str] = ..., refcount: _Optional[int] = ..., hits: _Optional[int] = ..., last_used: _Optional[float] = ..., created: _Optional[float] = ..., location: _Optional[str] = ..., memory: _Optional[str] = ..., frontier: _Optional[int] = ..., blocks: _Optional[int] = ..., own_bytes: _Optional[int] = ..., shared_bytes: _Optional[int] = ..., tenant: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class CacheDumpRequest(_message.Message):
    __slots__ = ("model", "tier", "tenant")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    model: str
    tier: str
    tenant: str
    def __init__(self, model: _Optional[str] = ..., tier: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class CacheDumpReply(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[CacheRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[CacheRow, _Mapping]]] = ...) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("bytes", "quota", "rows", "stored_bytes", "logical_bytes", "dedup_ratio")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEDUP_RATIO_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    quota: int
    rows: int
    stored_bytes: int
    logical_bytes: int
    dedup_ratio: float
    def __init__(self, bytes: _Optional[int] = ..., quota: _Optional[int] = ..., rows: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., logical_bytes: _Optional[int] = ..., dedup_ratio: _Optional[float] = ...) -> None: ...

class CacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStatsReply(_message.Message):
    __slots__ = ("counters", "tiers", "redis_json")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TiersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TierUsage
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TierUsage, _Mapping]] = ...) -> None: ...
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    REDIS_JSON_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.ScalarMap[str, int]
    tiers: _containers.MessageMap[str, TierUsage]
    redis_json: str
    def __init__(self, counters: _Optional[_Mapping[str, int]] = ..., tiers: _Optional[_Mapping[str, TierUsage]] = ..., redis_json: _Optional[str] = ...) -> None: ...

class CacheGcRequest(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class CacheGcReply(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    def __init__(self, evicted: _Optional[int] = ...) -> None: ...

class CacheEvictBytesRequest(_message.Message):
    __slots__ = ("bytes", "tiers")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, bytes: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class CacheEvictBytesReply(_message.Message):
    __slots__ = ("evicted", "bytes_freed")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    bytes_freed: int
    def __init__(self, evicted: _Optional[int] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class CacheVerifyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheVerifyProgress(_message.Message):
    __slots__ = ("done", "total")
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    done: int
    total: int
    def __init__(self, done: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class CacheVerifyResult(_message.Message):
    __slots__ = ("checked", "bad")
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    BAD_FIELD_NUMBER: _ClassVar[int]
    checked: int
    bad: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, checked: _Optional[int] = ..., bad: _Optional[_Iterable[str]] = ...) -> None: ...

class CacheVerifyEvent(_message.Message):
    __slots__ = ("progress", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: CacheVerifyProgress
    result: CacheVerifyResult
    def __init__(self, progress: _Optional[_Union[CacheVerifyProgress, _Mapping]] = ..., result: _Optional[_Union[CacheVerifyResult, _Mapping]] = ...) -> None: ...

class SchedulerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStatusReply(_message.Message):
    __slots__ = ("status_json",)
    STATUS_JSON_FIELD_NUMBER: _ClassVar[int]
    status_json: str
    def __init__(self, status_json: _Optional[str] = ...) -> None: ...

class DaemonStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DaemonStatusReply(_message.Message):
    __slots__ = ("pid", "uptime_s", "socket", "data_dir", "version", "models", "config", "http")
    PID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    DATA_DIR_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    HTTP_FIELD_NUMBER: _ClassVar[int]
    pid: int
    uptime_s: float
    socket: str
    data_dir: str
    version: str
    models: int
    config: str
    http: str
    def __init__(self, pid: _Optional[int] = ..., uptime_s: _Optional[float] = ..., socket: _Optional[str] = ..., data_dir: _Optional[str] = ..., version: _Optional[str] = ..., models: _Optional[int] = ..., config: _Optional[str] = ..., http: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
