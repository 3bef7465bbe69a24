from services.api.sparrow.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]

class AckStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_STATUS_UNSPECIFIED: _ClassVar[AckStatus]
    ACK_STATUS_ACCEPTED: _ClassVar[AckStatus]
    ACK_STATUS_DUPLICATE: _ClassVar[AckStatus]
    ACK_STATUS_REJECTED: _ClassVar[AckStatus]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORTED: FinishReason
ACK_STATUS_UNSPECIFIED: AckStatus
ACK_STATUS_ACCEPTED: AckStatus
ACK_STATUS_DUPLICATE: AckStatus
ACK_STATUS_REJECTED: AckStatus

class StreamTrajectoriesRequest(_message.Message):
    __slots__ = ("hello", "trajectory")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    hello: GeneratorHello
    trajectory: Trajectory
    def __init__(self, hello: _Optional[_Union[GeneratorHello, _Mapping]] = ..., trajectory: _Optional[_Union[Trajectory, _Mapping]] = ...) -> None: ...

class StreamTrajectoriesResponse(_message.Message):
    __slots__ = ("hello", "ack")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    hello: TrainerHello
    ack: TrajectoryAck
    def __init__(self, hello: _Optional[_Union[TrainerHello, _Mapping]] = ..., ack: _Optional[_Union[TrajectoryAck, _Mapping]] = ...) -> None: ...

class GeneratorHello(_message.Message):
    __slots__ = ("generator_id", "versions")
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    generator_id: str
    versions: _common_pb2.Versions
    def __init__(self, generator_id: _Optional[str] = ..., versions: _Optional[_Union[_common_pb2.Versions, _Mapping]] = ...) -> None: ...

class TrainerHello(_message.Message):
    __slots__ = ("latest",)
    LATEST_FIELD_NUMBER: _ClassVar[int]
    latest: _common_pb2.Versions
    def __init__(self, latest: _Optional[_Union[_common_pb2.Versions, _Mapping]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_seconds", "generate_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    generate_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., generate_seconds: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "group_id", "sample_index", "prompt_token_ids", "token_ids", "logprobs", "top_logprobs", "kv_budgets", "versions", "finish_reason", "timings", "generator_id", "probe")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGETS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    group_id: str
    sample_index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    kv_budgets: _containers.RepeatedScalarFieldContainer[int]
    versions: _common_pb2.Versions
    finish_reason: FinishReason
    timings: Timings
    generator_id: str
    probe: bool
    def __init__(self, trajectory_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., kv_budgets: _Optional[_Iterable[int]] = ..., versions: _Optional[_Union[_common_pb2.Versions, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., generator_id: _Optional[str] = ..., probe: _Optional[bool] = ...) -> None: ...

class TrajectoryAck(_message.Message):
    __slots__ = ("trajectory_id", "status", "reason")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    status: AckStatus
    reason: str
    def __init__(self, trajectory_id: _Optional[str] = ..., status: _Optional[_Union[AckStatus, str]] = ..., reason: _Optional[str] = ...) -> None: ...
