from services.api.sparrow.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FetchPolicyDeltaRequest(_message.Message):
    __slots__ = ("version", "base_version", "chunk_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    base_version: int
    chunk_bytes: int
    def __init__(self, version: _Optional[int] = ..., base_version: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class GetPolicySourceRequest(_message.Message):
    __slots__ = ("generator_id", "version", "held_version", "relay_address", "failed_sources")
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_VERSION_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FAILED_SOURCES_FIELD_NUMBER: _ClassVar[int]
    generator_id: str
    version: int
    held_version: int
    relay_address: str
    failed_sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, generator_id: _Optional[str] = ..., version: _Optional[int] = ..., held_version: _Optional[int] = ..., relay_address: _Optional[str] = ..., failed_sources: _Optional[_Iterable[str]] = ...) -> None: ...

class GetPolicySourceResponse(_message.Message):
    __slots__ = ("version", "result_sha256", "delta_base_version", "sources", "published_unix_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RESULT_SHA256_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    result_sha256: str
    delta_base_version: int
    sources: _containers.RepeatedScalarFieldContainer[str]
    published_unix_seconds: float
    def __init__(self, version: _Optional[int] = ..., result_sha256: _Optional[str] = ..., delta_base_version: _Optional[int] = ..., sources: _Optional[_Iterable[str]] = ..., published_unix_seconds: _Optional[float] = ...) -> None: ...

class WatchVersionsRequest(_message.Message):
    __slots__ = ("generator_id",)
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    generator_id: str
    def __init__(self, generator_id: _Optional[str] = ...) -> None: ...

class WatchVersionsResponse(_message.Message):
    __slots__ = ("latest",)
    LATEST_FIELD_NUMBER: _ClassVar[int]
    latest: _common_pb2.Versions
    def __init__(self, latest: _Optional[_Union[_common_pb2.Versions, _Mapping]] = ...) -> None: ...

class FetchPolicyRequest(_message.Message):
    __slots__ = ("version", "chunk_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    chunk_bytes: int
    def __init__(self, version: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class FetchAdapterRequest(_message.Message):
    __slots__ = ("version", "chunk_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    chunk_bytes: int
    def __init__(self, version: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class WeightFile(_message.Message):
    __slots__ = ("path", "size_bytes", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("version", "files", "lora_rank", "lora_target_modules", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    files: _containers.RepeatedCompositeFieldContainer[WeightFile]
    lora_rank: int
    lora_target_modules: _containers.RepeatedScalarFieldContainer[str]
    base_version: int
    def __init__(self, version: _Optional[int] = ..., files: _Optional[_Iterable[_Union[WeightFile, _Mapping]]] = ..., lora_rank: _Optional[int] = ..., lora_target_modules: _Optional[_Iterable[str]] = ..., base_version: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: WeightManifest
    chunk: FileChunk
    def __init__(self, manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[FileChunk, _Mapping]] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("path", "offset", "data")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    data: bytes
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
