from specsplit.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyItem(_message.Message):
    __slots__ = ("seq_id", "draft_token_ids", "draft_probs", "draft_probs_one", "draft_parents", "prefill_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_ONE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedScalarFieldContainer[float]
    draft_probs_one: bool
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    prefill_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[float]] = ..., draft_probs_one: _Optional[bool] = ..., draft_parents: _Optional[_Iterable[int]] = ..., prefill_tokens: _Optional[int] = ...) -> None: ...

class VerifyBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ...) -> None: ...

class ResolveBatch(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[_common_pb2.PackedRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[_common_pb2.PackedRow, _Mapping]]] = ...) -> None: ...

class AbandonStep(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("seq_id", "num_accepted", "token_ids", "pending_position", "logprobs", "features", "prompt_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PENDING_POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_accepted: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    pending_position: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    features: _common_pb2.Features
    prompt_logprobs: _common_pb2.PromptLogprobs
    def __init__(self, seq_id: _Optional[str] = ..., num_accepted: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., pending_position: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...

class VerifyResults(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ...) -> None: ...

class VerifierRequest(_message.Message):
    __slots__ = ("id", "add", "verify", "resolve", "release", "abandon")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    RESOLVE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    id: int
    add: _common_pb2.AddSeqs
    verify: VerifyBatch
    resolve: ResolveBatch
    release: _common_pb2.Release
    abandon: AbandonStep
    def __init__(self, id: _Optional[int] = ..., add: _Optional[_Union[_common_pb2.AddSeqs, _Mapping]] = ..., verify: _Optional[_Union[VerifyBatch, _Mapping]] = ..., resolve: _Optional[_Union[ResolveBatch, _Mapping]] = ..., release: _Optional[_Union[_common_pb2.Release, _Mapping]] = ..., abandon: _Optional[_Union[AbandonStep, _Mapping]] = ...) -> None: ...

class VerifierResponse(_message.Message):
    __slots__ = ("id", "error", "compute_s", "ack", "results")
    ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    id: int
    error: _common_pb2.Status
    compute_s: float
    ack: _common_pb2.Ack
    results: VerifyResults
    def __init__(self, id: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., compute_s: _Optional[float] = ..., ack: _Optional[_Union[_common_pb2.Ack, _Mapping]] = ..., results: _Optional[_Union[VerifyResults, _Mapping]] = ...) -> None: ...
