from specsplit.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages", "tools_json", "add_generation_prompt", "continue_final_message")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    add_generation_prompt: bool
    continue_final_message: bool
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("num_speculative_tokens", "disable")
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_FIELD_NUMBER: _ClassVar[int]
    num_speculative_tokens: int
    disable: bool
    def __init__(self, num_speculative_tokens: _Optional[int] = ..., disable: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop", "request_id", "speculation", "messages", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "grammar", "prompt_logprobs", "n", "tools_json", "stop_token_ids", "min_tokens", "min_p", "include_stop_str_in_output", "add_generation_prompt", "continue_final_message", "truncate_prompt_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    speculation: Speculation
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    grammar: _common_pb2.Grammar
    prompt_logprobs: int
    n: int
    tools_json: str
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_tokens: int
    min_p: float
    include_stop_str_in_output: bool
    add_generation_prompt: bool
    continue_final_message: bool
    truncate_prompt_tokens: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., n: _Optional[int] = ..., tools_json: _Optional[str] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., min_tokens: _Optional[int] = ..., min_p: _Optional[float] = ..., include_stop_str_in_output: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "proposed_draft_tokens", "accepted_draft_tokens", "accepted_per_position")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    proposed_draft_tokens: int
    accepted_draft_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., proposed_draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "logprobs", "proposed_draft_tokens", "accepted_draft_tokens", "prompt_logprobs", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    proposed_draft_tokens: int
    accepted_draft_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., proposed_draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvBlocks(_message.Message):
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

class ServiceStatus(_message.Message):
    __slots__ = ("name", "address", "reachable", "error", "model", "device", "dtype", "max_model_len", "num_running", "kv", "memory_plan_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    reachable: bool
    error: str
    model: str
    device: str
    dtype: str
    max_model_len: int
    num_running: int
    kv: KvBlocks
    memory_plan_json: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., reachable: _Optional[bool] = ..., error: _Optional[str] = ..., model: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_model_len: _Optional[int] = ..., num_running: _Optional[int] = ..., kv: _Optional[_Union[KvBlocks, _Mapping]] = ..., memory_plan_json: _Optional[str] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("mode", "target_model", "draft_model", "num_speculative_tokens", "disable_by_batch_size", "max_model_len", "max_num_seqs", "max_queue", "vocab_size", "eos_token_ids", "drafter_up", "num_running", "num_waiting", "services", "verify_costs", "draft_costs", "network_s", "async_draft", "branch_hits", "branch_misses")
    MODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_BY_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_UP_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COSTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COSTS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_S_FIELD_NUMBER: _ClassVar[int]
    ASYNC_DRAFT_FIELD_NUMBER: _ClassVar[int]
    BRANCH_HITS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_MISSES_FIELD_NUMBER: _ClassVar[int]
    mode: str
    target_model: str
    draft_model: str
    num_speculative_tokens: int
    disable_by_batch_size: int
    max_model_len: int
    max_num_seqs: int
    max_queue: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    drafter_up: bool
    num_running: int
    num_waiting: int
    services: _containers.RepeatedCompositeFieldContainer[ServiceStatus]
    verify_costs: _containers.RepeatedCompositeFieldContainer[_common_pb2.StepCost]
    draft_costs: _containers.RepeatedCompositeFieldContainer[_common_pb2.StepCost]
    network_s: float
    async_draft: bool
    branch_hits: int
    branch_misses: int
    def __init__(self, mode: _Optional[str] = ..., target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., disable_by_batch_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_queue: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., drafter_up: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., services: _Optional[_Iterable[_Union[ServiceStatus, _Mapping]]] = ..., verify_costs: _Optional[_Iterable[_Union[_common_pb2.StepCost, _Mapping]]] = ..., draft_costs: _Optional[_Iterable[_Union[_common_pb2.StepCost, _Mapping]]] = ..., network_s: _Optional[float] = ..., async_draft: _Optional[bool] = ..., branch_hits: _Optional[int] = ..., branch_misses: _Optional[int] = ...) -> None: ...
