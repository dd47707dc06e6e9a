from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetTrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTrainerStatusResponse(_message.Message):
    __slots__ = ("step", "last_step_unix", "tokens", "world_size", "runs")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_UNIX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    step: int
    last_step_unix: float
    tokens: int
    world_size: int
    runs: _containers.RepeatedCompositeFieldContainer[TrainerRunStatus]
    def __init__(self, step: _Optional[int] = ..., last_step_unix: _Optional[float] = ..., tokens: _Optional[int] = ..., world_size: _Optional[int] = ..., runs: _Optional[_Iterable[_Union[TrainerRunStatus, _Mapping]]] = ...) -> None: ...

class TrainerRunStatus(_message.Message):
    __slots__ = ("name", "step", "last_step_unix", "tokens", "finished")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_UNIX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    name: str
    step: int
    last_step_unix: float
    tokens: int
    finished: bool
    def __init__(self, name: _Optional[str] = ..., step: _Optional[int] = ..., last_step_unix: _Optional[float] = ..., tokens: _Optional[int] = ..., finished: _Optional[bool] = ...) -> None: ...
