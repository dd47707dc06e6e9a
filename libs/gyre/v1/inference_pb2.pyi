from gyre.v1 import weights_pb2 as _weights_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "rollback", "model")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    version: _weights_pb2.WeightsVersion
    rollback: bool
    model: str
    def __init__(self, version: _Optional[_Union[_weights_pb2.WeightsVersion, _Mapping]] = ..., rollback: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("step", "load_seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    load_seconds: float
    def __init__(self, step: _Optional[int] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class ReloadWeightsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadWeightsResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class GetInferenceStatusRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetInferenceStatusResponse(_message.Message):
    __slots__ = ("model", "step", "backend", "running", "waiting", "ready")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    model: str
    step: int
    backend: str
    running: int
    waiting: int
    ready: bool
    def __init__(self, model: _Optional[str] = ..., step: _Optional[int] = ..., backend: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., ready: _Optional[bool] = ...) -> None: ...
