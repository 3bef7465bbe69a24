from services.api.sparrow.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Probe(_message.Message):
    __slots__ = ("share", "budgets", "expires_at")
    SHARE_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    share: float
    budgets: _containers.RepeatedScalarFieldContainer[int]
    expires_at: float
    def __init__(self, share: _Optional[float] = ..., budgets: _Optional[_Iterable[int]] = ..., expires_at: _Optional[float] = ...) -> None: ...

class SetScheduleRequest(_message.Message):
    __slots__ = ("schedule", "probe")
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    schedule: _common_pb2.Schedule
    probe: Probe
    def __init__(self, schedule: _Optional[_Union[_common_pb2.Schedule, _Mapping]] = ..., probe: _Optional[_Union[Probe, _Mapping]] = ...) -> None: ...

class SetScheduleResponse(_message.Message):
    __slots__ = ("schedule_version",)
    SCHEDULE_VERSION_FIELD_NUMBER: _ClassVar[int]
    schedule_version: int
    def __init__(self, schedule_version: _Optional[int] = ...) -> None: ...

class LoadVersionsRequest(_message.Message):
    __slots__ = ("policy_version", "adapter_version")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    adapter_version: int
    def __init__(self, policy_version: _Optional[int] = ..., adapter_version: _Optional[int] = ...) -> None: ...

class LoadVersionsResponse(_message.Message):
    __slots__ = ("serving",)
    SERVING_FIELD_NUMBER: _ClassVar[int]
    serving: _common_pb2.Versions
    def __init__(self, serving: _Optional[_Union[_common_pb2.Versions, _Mapping]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace_seconds",)
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    grace_seconds: float
    def __init__(self, grace_seconds: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("groups_finished", "groups_returned")
    GROUPS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    groups_finished: int
    groups_returned: int
    def __init__(self, groups_finished: _Optional[int] = ..., groups_returned: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("generator_id", "serving", "in_flight_sequences", "draining", "schedule", "probe")
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    generator_id: str
    serving: _common_pb2.Versions
    in_flight_sequences: int
    draining: bool
    schedule: _common_pb2.Schedule
    probe: Probe
    def __init__(self, generator_id: _Optional[str] = ..., serving: _Optional[_Union[_common_pb2.Versions, _Mapping]] = ..., in_flight_sequences: _Optional[int] = ..., draining: _Optional[bool] = ..., schedule: _Optional[_Union[_common_pb2.Schedule, _Mapping]] = ..., probe: _Optional[_Union[Probe, _Mapping]] = ...) -> None: ...
