from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Versions(_message.Message):
    __slots__ = ("policy_version", "adapter_version", "schedule_version")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    adapter_version: int
    schedule_version: int
    def __init__(self, policy_version: _Optional[int] = ..., adapter_version: _Optional[int] = ..., schedule_version: _Optional[int] = ...) -> None: ...

class Schedule(_message.Message):
    __slots__ = ("budgets", "bin_width", "page_size", "sink_blocks", "local_blocks", "dense_layers", "version", "name")
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    BIN_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SINK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DENSE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    budgets: _containers.RepeatedScalarFieldContainer[int]
    bin_width: int
    page_size: int
    sink_blocks: int
    local_blocks: int
    dense_layers: _containers.RepeatedScalarFieldContainer[int]
    version: int
    name: str
    def __init__(self, budgets: _Optional[_Iterable[int]] = ..., bin_width: _Optional[int] = ..., page_size: _Optional[int] = ..., sink_blocks: _Optional[int] = ..., local_blocks: _Optional[int] = ..., dense_layers: _Optional[_Iterable[int]] = ..., version: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "max_new_tokens", "top_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    max_new_tokens: int
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., top_logprobs: _Optional[int] = ...) -> None: ...
