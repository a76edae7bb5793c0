from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SyncWorkerCredsRequest(_message.Message):
    __slots__ = ("job", "namespace", "pod", "bootstrap_token")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    job: str
    namespace: str
    pod: str
    bootstrap_token: str
    def __init__(self, job: _Optional[str] = ..., namespace: _Optional[str] = ..., pod: _Optional[str] = ..., bootstrap_token: _Optional[str] = ...) -> None: ...

class SyncWorkerCredsResponse(_message.Message):
    __slots__ = ("nats_url", "user_jwt", "user_seed", "inbox_prefix", "subject_prefix", "expires_at", "worker_num", "rank")
    NATS_URL_FIELD_NUMBER: _ClassVar[int]
    USER_JWT_FIELD_NUMBER: _ClassVar[int]
    USER_SEED_FIELD_NUMBER: _ClassVar[int]
    INBOX_PREFIX_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    WORKER_NUM_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    nats_url: str
    user_jwt: str
    user_seed: bytes
    inbox_prefix: str
    subject_prefix: str
    expires_at: float
    worker_num: int
    rank: int
    def __init__(self, nats_url: _Optional[str] = ..., user_jwt: _Optional[str] = ..., user_seed: _Optional[bytes] = ..., inbox_prefix: _Optional[str] = ..., subject_prefix: _Optional[str] = ..., expires_at: _Optional[float] = ..., worker_num: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...
