from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetTrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTrainerStatusResponse(_message.Message):
    __slots__ = ("step", "last_step_unix", "tokens", "world_size")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_UNIX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    step: int
    last_step_unix: float
    tokens: int
    world_size: int
    def __init__(self, step: _Optional[int] = ..., last_step_unix: _Optional[float] = ..., tokens: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...
