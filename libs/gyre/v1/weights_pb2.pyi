from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WeightsVersion(_message.Message):
    __slots__ = ("step", "digest", "transport", "locator")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LOCATOR_FIELD_NUMBER: _ClassVar[int]
    step: int
    digest: str
    transport: str
    locator: str
    def __init__(self, step: _Optional[int] = ..., digest: _Optional[str] = ..., transport: _Optional[str] = ..., locator: _Optional[str] = ...) -> None: ...
