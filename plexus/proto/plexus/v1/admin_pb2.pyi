from plexus.proto.plexus.v1 import federation_pb2 as _federation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitJobRequest(_message.Message):
    __slots__ = ("config_yaml", "request_id")
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    config_yaml: str
    request_id: str
    def __init__(self, config_yaml: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobSummary(_message.Message):
    __slots__ = ("job_id", "name", "status", "rounds", "current_round", "message", "submitted_by", "created_unix_s", "updated_unix_s", "strategy")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_BY_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    status: str
    rounds: int
    current_round: int
    message: str
    submitted_by: str
    created_unix_s: float
    updated_unix_s: float
    strategy: str
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., status: _Optional[str] = ..., rounds: _Optional[int] = ..., current_round: _Optional[int] = ..., message: _Optional[str] = ..., submitted_by: _Optional[str] = ..., created_unix_s: _Optional[float] = ..., updated_unix_s: _Optional[float] = ..., strategy: _Optional[str] = ...) -> None: ...

class JobList(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobSummary]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobSummary, _Mapping]]] = ...) -> None: ...

class SiteMetric(_message.Message):
    __slots__ = ("site", "kind", "name", "value")
    SITE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    site: str
    kind: str
    name: str
    value: float
    def __init__(self, site: _Optional[str] = ..., kind: _Optional[str] = ..., name: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class RoundInfo(_message.Message):
    __slots__ = ("round", "status", "opened_unix_s", "closed_unix_s", "contributors", "total_samples", "message")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OPENED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    CLOSED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    round: int
    status: str
    opened_unix_s: float
    closed_unix_s: float
    contributors: _containers.RepeatedScalarFieldContainer[str]
    total_samples: int
    message: str
    def __init__(self, round: _Optional[int] = ..., status: _Optional[str] = ..., opened_unix_s: _Optional[float] = ..., closed_unix_s: _Optional[float] = ..., contributors: _Optional[_Iterable[str]] = ..., total_samples: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SiteStatus(_message.Message):
    __slots__ = ("site", "status", "round", "reason")
    SITE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    site: str
    status: str
    round: int
    reason: str
    def __init__(self, site: _Optional[str] = ..., status: _Optional[str] = ..., round: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class MetricRow(_message.Message):
    __slots__ = ("round", "site", "kind", "name", "value")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    round: int
    site: str
    kind: str
    name: str
    value: float
    def __init__(self, round: _Optional[int] = ..., site: _Optional[str] = ..., kind: _Optional[str] = ..., name: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class JobDetail(_message.Message):
    __slots__ = ("summary", "config_yaml", "rounds", "site_events", "metrics")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SITE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    summary: JobSummary
    config_yaml: str
    rounds: _containers.RepeatedCompositeFieldContainer[RoundInfo]
    site_events: _containers.RepeatedCompositeFieldContainer[SiteStatus]
    metrics: _containers.RepeatedCompositeFieldContainer[MetricRow]
    def __init__(self, summary: _Optional[_Union[JobSummary, _Mapping]] = ..., config_yaml: _Optional[str] = ..., rounds: _Optional[_Iterable[_Union[RoundInfo, _Mapping]]] = ..., site_events: _Optional[_Iterable[_Union[SiteStatus, _Mapping]]] = ..., metrics: _Optional[_Iterable[_Union[MetricRow, _Mapping]]] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("unix_s", "kind", "round", "site", "message", "summary")
    UNIX_S_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    unix_s: float
    kind: str
    round: int
    site: str
    message: str
    summary: JobSummary
    def __init__(self, unix_s: _Optional[float] = ..., kind: _Optional[str] = ..., round: _Optional[int] = ..., site: _Optional[str] = ..., message: _Optional[str] = ..., summary: _Optional[_Union[JobSummary, _Mapping]] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("job_id", "round")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class ListSitesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SiteInfo(_message.Message):
    __slots__ = ("site", "last_seen_unix_s", "online", "policy_digest", "models", "datasets", "agent_version", "dataset_rows", "revoked", "children", "kind")
    class DatasetRowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SITE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ONLINE_FIELD_NUMBER: _ClassVar[int]
    POLICY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATASET_ROWS_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    site: str
    last_seen_unix_s: float
    online: bool
    policy_digest: str
    models: _containers.RepeatedScalarFieldContainer[str]
    datasets: _containers.RepeatedScalarFieldContainer[str]
    agent_version: str
    dataset_rows: _containers.ScalarMap[str, int]
    revoked: bool
    children: _containers.RepeatedScalarFieldContainer[str]
    kind: str
    def __init__(self, site: _Optional[str] = ..., last_seen_unix_s: _Optional[float] = ..., online: _Optional[bool] = ..., policy_digest: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., datasets: _Optional[_Iterable[str]] = ..., agent_version: _Optional[str] = ..., dataset_rows: _Optional[_Mapping[str, int]] = ..., revoked: _Optional[bool] = ..., children: _Optional[_Iterable[str]] = ..., kind: _Optional[str] = ...) -> None: ...

class SiteList(_message.Message):
    __slots__ = ("sites",)
    SITES_FIELD_NUMBER: _ClassVar[int]
    sites: _containers.RepeatedCompositeFieldContainer[SiteInfo]
    def __init__(self, sites: _Optional[_Iterable[_Union[SiteInfo, _Mapping]]] = ...) -> None: ...

class AuditEntry(_message.Message):
    __slots__ = ("seq", "at", "actor", "action", "subject", "details_json", "hash")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    at: float
    actor: str
    action: str
    subject: str
    details_json: str
    hash: str
    def __init__(self, seq: _Optional[int] = ..., at: _Optional[float] = ..., actor: _Optional[str] = ..., action: _Optional[str] = ..., subject: _Optional[str] = ..., details_json: _Optional[str] = ..., hash: _Optional[str] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ("verify", "limit", "sign_head")
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    SIGN_HEAD_FIELD_NUMBER: _ClassVar[int]
    verify: bool
    limit: int
    sign_head: bool
    def __init__(self, verify: _Optional[bool] = ..., limit: _Optional[int] = ..., sign_head: _Optional[bool] = ...) -> None: ...

class AuditReply(_message.Message):
    __slots__ = ("entries", "verified", "problem", "count", "signed_head_json")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SIGNED_HEAD_JSON_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AuditEntry]
    verified: bool
    problem: str
    count: int
    signed_head_json: str
    def __init__(self, entries: _Optional[_Iterable[_Union[AuditEntry, _Mapping]]] = ..., verified: _Optional[bool] = ..., problem: _Optional[str] = ..., count: _Optional[int] = ..., signed_head_json: _Optional[str] = ...) -> None: ...
