from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "coupling", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "grammar", "min_tokens", "min_tokens_stop_ids", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    COUPLING_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    coupling: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    grammar: Grammar
    min_tokens: int
    min_tokens_stop_ids: _containers.RepeatedScalarFieldContainer[int]
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., coupling: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., min_tokens: _Optional[int] = ..., min_tokens_stop_ids: _Optional[_Iterable[int]] = ..., min_p: _Optional[float] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "ebnf")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    ebnf: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ...) -> None: ...

class SeqAdd(_message.Message):
    __slots__ = ("seq_id", "prompt_token_ids", "params", "logprobs", "feature_layers", "generated", "prompt_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    logprobs: int
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    generated: int
    prompt_logprobs: int
    def __init__(self, seq_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., logprobs: _Optional[int] = ..., feature_layers: _Optional[_Iterable[int]] = ..., generated: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("start", "rows", "width", "bf16")
    START_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    BF16_FIELD_NUMBER: _ClassVar[int]
    start: int
    rows: int
    width: int
    bf16: bytes
    def __init__(self, start: _Optional[int] = ..., rows: _Optional[int] = ..., width: _Optional[int] = ..., bf16: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class AddSeqs(_message.Message):
    __slots__ = ("seqs",)
    SEQS_FIELD_NUMBER: _ClassVar[int]
    seqs: _containers.RepeatedCompositeFieldContainer[SeqAdd]
    def __init__(self, seqs: _Optional[_Iterable[_Union[SeqAdd, _Mapping]]] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("seq_ids", "finished")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    finished: bool
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., finished: _Optional[bool] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PackedRow(_message.Message):
    __slots__ = ("seq_id", "size", "values", "indices", "sparse")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    size: int
    values: bytes
    indices: bytes
    sparse: bool
    def __init__(self, seq_id: _Optional[str] = ..., size: _Optional[int] = ..., values: _Optional[bytes] = ..., indices: _Optional[bytes] = ..., sparse: _Optional[bool] = ...) -> None: ...

class KvStats(_message.Message):
    __slots__ = ("paged", "num_blocks", "free_blocks", "block_size", "prefix_caching")
    PAGED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    paged: bool
    num_blocks: int
    free_blocks: int
    block_size: int
    prefix_caching: bool
    def __init__(self, paged: _Optional[bool] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., prefix_caching: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("role", "model", "device", "dtype", "vocab_size", "max_model_len", "max_num_seqs", "eos_token_ids", "tokenizer_dir", "kv", "num_running", "num_sessions", "memory_plan_json", "serving", "num_speculative_tokens", "step_costs", "feature_layers", "sampling_features")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIR_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_COSTS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FEATURES_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    device: str
    dtype: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_dir: str
    kv: KvStats
    num_running: int
    num_sessions: int
    memory_plan_json: str
    serving: bool
    num_speculative_tokens: int
    step_costs: _containers.RepeatedCompositeFieldContainer[StepCost]
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    sampling_features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_dir: _Optional[str] = ..., kv: _Optional[_Union[KvStats, _Mapping]] = ..., num_running: _Optional[int] = ..., num_sessions: _Optional[int] = ..., memory_plan_json: _Optional[str] = ..., serving: _Optional[bool] = ..., num_speculative_tokens: _Optional[int] = ..., step_costs: _Optional[_Iterable[_Union[StepCost, _Mapping]]] = ..., feature_layers: _Optional[_Iterable[int]] = ..., sampling_features: _Optional[_Iterable[str]] = ...) -> None: ...

class StepCost(_message.Message):
    __slots__ = ("batch", "rows", "seconds")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    batch: int
    rows: int
    seconds: float
    def __init__(self, batch: _Optional[int] = ..., rows: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
