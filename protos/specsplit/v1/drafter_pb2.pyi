from specsplit.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeItem(_message.Message):
    __slots__ = ("seq_id", "new_token_ids", "k", "pending_drafts", "pre_draft", "features", "tree_nodes", "prefill_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    PENDING_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    PRE_DRAFT_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    k: int
    pending_drafts: _containers.RepeatedScalarFieldContainer[int]
    pre_draft: bool
    features: _common_pb2.Features
    tree_nodes: int
    prefill_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., pending_drafts: _Optional[_Iterable[int]] = ..., pre_draft: _Optional[bool] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., tree_nodes: _Optional[int] = ..., prefill_tokens: _Optional[int] = ...) -> None: ...

class ProposeBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("seq_id", "token_ids", "probs", "probs_one", "parents")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    PROBS_ONE_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    probs_one: bool
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ..., probs_one: _Optional[bool] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class Proposals(_message.Message):
    __slots__ = ("proposals",)
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    def __init__(self, proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ...) -> None: ...

class RowRequest(_message.Message):
    __slots__ = ("seq_id", "position")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    position: int
    def __init__(self, seq_id: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...

class FetchRows(_message.Message):
    __slots__ = ("fetch",)
    FETCH_FIELD_NUMBER: _ClassVar[int]
    fetch: _containers.RepeatedCompositeFieldContainer[RowRequest]
    def __init__(self, fetch: _Optional[_Iterable[_Union[RowRequest, _Mapping]]] = ...) -> None: ...

class QRows(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[_common_pb2.PackedRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[_common_pb2.PackedRow, _Mapping]]] = ...) -> None: ...

class DrafterRequest(_message.Message):
    __slots__ = ("id", "add", "propose", "fetch_rows", "release")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    FETCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    id: int
    add: _common_pb2.AddSeqs
    propose: ProposeBatch
    fetch_rows: FetchRows
    release: _common_pb2.Release
    def __init__(self, id: _Optional[int] = ..., add: _Optional[_Union[_common_pb2.AddSeqs, _Mapping]] = ..., propose: _Optional[_Union[ProposeBatch, _Mapping]] = ..., fetch_rows: _Optional[_Union[FetchRows, _Mapping]] = ..., release: _Optional[_Union[_common_pb2.Release, _Mapping]] = ...) -> None: ...

class DrafterResponse(_message.Message):
    __slots__ = ("id", "error", "compute_s", "ack", "proposals", "rows")
    ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    id: int
    error: _common_pb2.Status
    compute_s: float
    ack: _common_pb2.Ack
    proposals: Proposals
    rows: QRows
    def __init__(self, id: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., compute_s: _Optional[float] = ..., ack: _Optional[_Union[_common_pb2.Ack, _Mapping]] = ..., proposals: _Optional[_Union[Proposals, _Mapping]] = ..., rows: _Optional[_Union[QRows, _Mapping]] = ...) -> None: ...
