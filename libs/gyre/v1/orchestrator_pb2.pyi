from gyre.v1 import weights_pb2 as _weights_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NotifyWeightsRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: _weights_pb2.WeightsVersion
    def __init__(self, version: _Optional[_Union[_weights_pb2.WeightsVersion, _Mapping]] = ...) -> None: ...

class NotifyWeightsResponse(_message.Message):
    __slots__ = ("accepted", "latest_step")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LATEST_STEP_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    latest_step: int
    def __init__(self, accepted: _Optional[bool] = ..., latest_step: _Optional[int] = ...) -> None: ...

class GetOrchestratorStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("address", "step", "healthy")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    address: str
    step: int
    healthy: bool
    def __init__(self, address: _Optional[str] = ..., step: _Optional[int] = ..., healthy: _Optional[bool] = ...) -> None: ...

class GetOrchestratorStatusResponse(_message.Message):
    __slots__ = ("step", "latest_weights_step", "replicas", "in_use_steps")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_WEIGHTS_STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    IN_USE_STEPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    latest_weights_step: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    in_use_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., latest_weights_step: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., in_use_steps: _Optional[_Iterable[int]] = ...) -> None: ...
