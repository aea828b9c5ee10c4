from plexus.proto.plexus.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_NONE: _ClassVar[TaskKind]
    TASK_TRAIN: _ClassVar[TaskKind]
    TASK_EVALUATE: _ClassVar[TaskKind]
    TASK_SECAGG_ADVERTISE: _ClassVar[TaskKind]
    TASK_SECAGG_SHARE: _ClassVar[TaskKind]
    TASK_SECAGG_MASKED_INPUT: _ClassVar[TaskKind]
    TASK_SECAGG_UNMASK: _ClassVar[TaskKind]
    TASK_SPLIT_TRAIN: _ClassVar[TaskKind]
    TASK_SPLIT_EVALUATE: _ClassVar[TaskKind]

class ModelEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_DENSE: _ClassVar[ModelEncoding]
    MODEL_FP16: _ClassVar[ModelEncoding]
    MODEL_DELTA8: _ClassVar[ModelEncoding]
    MODEL_DELTA4: _ClassVar[ModelEncoding]

class ResultStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESULT_UNSPECIFIED: _ClassVar[ResultStatus]
    RESULT_EVALUATED: _ClassVar[ResultStatus]
    RESULT_DECLINED: _ClassVar[ResultStatus]
    RESULT_FAILED: _ClassVar[ResultStatus]
    RESULT_TRAINED: _ClassVar[ResultStatus]
TASK_NONE: TaskKind
TASK_TRAIN: TaskKind
TASK_EVALUATE: TaskKind
TASK_SECAGG_ADVERTISE: TaskKind
TASK_SECAGG_SHARE: TaskKind
TASK_SECAGG_MASKED_INPUT: TaskKind
TASK_SECAGG_UNMASK: TaskKind
TASK_SPLIT_TRAIN: TaskKind
TASK_SPLIT_EVALUATE: TaskKind
MODEL_DENSE: ModelEncoding
MODEL_FP16: ModelEncoding
MODEL_DELTA8: ModelEncoding
MODEL_DELTA4: ModelEncoding
RESULT_UNSPECIFIED: ResultStatus
RESULT_EVALUATED: ResultStatus
RESULT_DECLINED: ResultStatus
RESULT_FAILED: ResultStatus
RESULT_TRAINED: ResultStatus

class JoinRequest(_message.Message):
    __slots__ = ("agent_version", "models", "datasets", "policy_digest", "dataset_rows", "children")
    class DatasetRowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    POLICY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATASET_ROWS_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    agent_version: str
    models: _containers.RepeatedScalarFieldContainer[str]
    datasets: _containers.RepeatedScalarFieldContainer[str]
    policy_digest: str
    dataset_rows: _containers.ScalarMap[str, int]
    children: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, agent_version: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., datasets: _Optional[_Iterable[str]] = ..., policy_digest: _Optional[str] = ..., dataset_rows: _Optional[_Mapping[str, int]] = ..., children: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("federation", "site", "poll_timeout_s")
    FEDERATION_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    POLL_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    federation: str
    site: str
    poll_timeout_s: float
    def __init__(self, federation: _Optional[str] = ..., site: _Optional[str] = ..., poll_timeout_s: _Optional[float] = ...) -> None: ...

class NextTaskRequest(_message.Message):
    __slots__ = ("wait_s",)
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    wait_s: float
    def __init__(self, wait_s: _Optional[float] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("kind", "task_id", "job_id", "round", "model_round", "config_yaml", "nonce", "deadline_unix_s", "seed", "secagg", "local_steps")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MODEL_ROUND_FIELD_NUMBER: _ClassVar[int]
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SECAGG_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    kind: TaskKind
    task_id: str
    job_id: str
    round: int
    model_round: int
    config_yaml: str
    nonce: bytes
    deadline_unix_s: float
    seed: int
    secagg: SecAggPayload
    local_steps: int
    def __init__(self, kind: _Optional[_Union[TaskKind, str]] = ..., task_id: _Optional[str] = ..., job_id: _Optional[str] = ..., round: _Optional[int] = ..., model_round: _Optional[int] = ..., config_yaml: _Optional[str] = ..., nonce: _Optional[bytes] = ..., deadline_unix_s: _Optional[float] = ..., seed: _Optional[int] = ..., secagg: _Optional[_Union[SecAggPayload, _Mapping]] = ..., local_steps: _Optional[int] = ...) -> None: ...

class SecAggAdvert(_message.Message):
    __slots__ = ("site", "c_pk", "s_pk", "num_samples", "b_commitment", "signature", "cert_pem")
    SITE_FIELD_NUMBER: _ClassVar[int]
    C_PK_FIELD_NUMBER: _ClassVar[int]
    S_PK_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    B_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CERT_PEM_FIELD_NUMBER: _ClassVar[int]
    site: str
    c_pk: bytes
    s_pk: bytes
    num_samples: int
    b_commitment: bytes
    signature: bytes
    cert_pem: bytes
    def __init__(self, site: _Optional[str] = ..., c_pk: _Optional[bytes] = ..., s_pk: _Optional[bytes] = ..., num_samples: _Optional[int] = ..., b_commitment: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., cert_pem: _Optional[bytes] = ...) -> None: ...

class SecAggPayload(_message.Message):
    __slots__ = ("adverts", "threshold", "total_weight", "clip", "frac_bits", "shares_for_you", "u2", "u3", "version")
    class SharesForYouEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    ADVERTS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    FRAC_BITS_FIELD_NUMBER: _ClassVar[int]
    SHARES_FOR_YOU_FIELD_NUMBER: _ClassVar[int]
    U2_FIELD_NUMBER: _ClassVar[int]
    U3_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    adverts: _containers.RepeatedCompositeFieldContainer[SecAggAdvert]
    threshold: int
    total_weight: int
    clip: float
    frac_bits: int
    shares_for_you: _containers.ScalarMap[str, bytes]
    u2: _containers.RepeatedScalarFieldContainer[str]
    u3: _containers.RepeatedScalarFieldContainer[str]
    version: int
    def __init__(self, adverts: _Optional[_Iterable[_Union[SecAggAdvert, _Mapping]]] = ..., threshold: _Optional[int] = ..., total_weight: _Optional[int] = ..., clip: _Optional[float] = ..., frac_bits: _Optional[int] = ..., shares_for_you: _Optional[_Mapping[str, bytes]] = ..., u2: _Optional[_Iterable[str]] = ..., u3: _Optional[_Iterable[str]] = ..., version: _Optional[int] = ...) -> None: ...

class ShareReveal(_message.Message):
    __slots__ = ("peer", "kind", "x", "y")
    PEER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    Y_FIELD_NUMBER: _ClassVar[int]
    peer: str
    kind: str
    x: int
    y: bytes
    def __init__(self, peer: _Optional[str] = ..., kind: _Optional[str] = ..., x: _Optional[int] = ..., y: _Optional[bytes] = ...) -> None: ...

class SecAggMessage(_message.Message):
    __slots__ = ("task_id", "job_id", "round", "nonce", "advert", "shares", "reveal", "metrics", "eval_metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class EvalMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ADVERT_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    REVEAL_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    EVAL_METRICS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    job_id: str
    round: int
    nonce: bytes
    advert: SecAggAdvert
    shares: SharesMessage
    reveal: RevealMessage
    metrics: _containers.ScalarMap[str, float]
    eval_metrics: _containers.ScalarMap[str, float]
    def __init__(self, task_id: _Optional[str] = ..., job_id: _Optional[str] = ..., round: _Optional[int] = ..., nonce: _Optional[bytes] = ..., advert: _Optional[_Union[SecAggAdvert, _Mapping]] = ..., shares: _Optional[_Union[SharesMessage, _Mapping]] = ..., reveal: _Optional[_Union[RevealMessage, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., eval_metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SharesMessage(_message.Message):
    __slots__ = ("ciphertexts",)
    class CiphertextsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    CIPHERTEXTS_FIELD_NUMBER: _ClassVar[int]
    ciphertexts: _containers.ScalarMap[str, bytes]
    def __init__(self, ciphertexts: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class RevealMessage(_message.Message):
    __slots__ = ("reveals",)
    REVEALS_FIELD_NUMBER: _ClassVar[int]
    reveals: _containers.RepeatedCompositeFieldContainer[ShareReveal]
    def __init__(self, reveals: _Optional[_Iterable[_Union[ShareReveal, _Mapping]]] = ...) -> None: ...

class FetchModelRequest(_message.Message):
    __slots__ = ("task_id", "have_round", "have_sha256", "zero_base")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    HAVE_ROUND_FIELD_NUMBER: _ClassVar[int]
    HAVE_SHA256_FIELD_NUMBER: _ClassVar[int]
    ZERO_BASE_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    have_round: int
    have_sha256: bytes
    zero_base: bool
    def __init__(self, task_id: _Optional[str] = ..., have_round: _Optional[int] = ..., have_sha256: _Optional[bytes] = ..., zero_base: _Optional[bool] = ...) -> None: ...

class ModelMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ModelHeader
    chunk: _tensor_pb2.Chunk
    def __init__(self, header: _Optional[_Union[ModelHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ...) -> None: ...

class ModelHeader(_message.Message):
    __slots__ = ("job_id", "round", "manifest", "encoding", "base_round", "sha256", "zero_base")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    BASE_ROUND_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ZERO_BASE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    manifest: _tensor_pb2.Manifest
    encoding: ModelEncoding
    base_round: int
    sha256: bytes
    zero_base: bool
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., manifest: _Optional[_Union[_tensor_pb2.Manifest, _Mapping]] = ..., encoding: _Optional[_Union[ModelEncoding, str]] = ..., base_round: _Optional[int] = ..., sha256: _Optional[bytes] = ..., zero_base: _Optional[bool] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("task_id", "job_id", "round", "nonce", "num_samples", "metrics", "eval_metrics", "manifest", "partial")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class EvalMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    EVAL_METRICS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    job_id: str
    round: int
    nonce: bytes
    num_samples: int
    metrics: _containers.ScalarMap[str, float]
    eval_metrics: _containers.ScalarMap[str, float]
    manifest: _tensor_pb2.Manifest
    partial: PartialSum
    def __init__(self, task_id: _Optional[str] = ..., job_id: _Optional[str] = ..., round: _Optional[int] = ..., nonce: _Optional[bytes] = ..., num_samples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., eval_metrics: _Optional[_Mapping[str, float]] = ..., manifest: _Optional[_Union[_tensor_pb2.Manifest, _Mapping]] = ..., partial: _Optional[_Union[PartialSum, _Mapping]] = ...) -> None: ...

class PartialSum(_message.Message):
    __slots__ = ("updates", "contributors")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    updates: int
    contributors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, updates: _Optional[int] = ..., contributors: _Optional[_Iterable[str]] = ...) -> None: ...

class UpdateMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    chunk: _tensor_pb2.Chunk
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class TaskResult(_message.Message):
    __slots__ = ("task_id", "job_id", "round", "nonce", "status", "reason", "eval_metrics")
    class EvalMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVAL_METRICS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    job_id: str
    round: int
    nonce: bytes
    status: ResultStatus
    reason: str
    eval_metrics: _containers.ScalarMap[str, float]
    def __init__(self, task_id: _Optional[str] = ..., job_id: _Optional[str] = ..., round: _Optional[int] = ..., nonce: _Optional[bytes] = ..., status: _Optional[_Union[ResultStatus, str]] = ..., reason: _Optional[str] = ..., eval_metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ResultReply(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class TensorData(_message.Message):
    __slots__ = ("dtype", "shape", "data", "name")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    name: str
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., name: _Optional[str] = ...) -> None: ...

class SplitOpen(_message.Message):
    __slots__ = ("task_id", "job_id", "round", "nonce", "batches")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    job_id: str
    round: int
    nonce: bytes
    batches: int
    def __init__(self, task_id: _Optional[str] = ..., job_id: _Optional[str] = ..., round: _Optional[int] = ..., nonce: _Optional[bytes] = ..., batches: _Optional[int] = ...) -> None: ...

class SplitBatch(_message.Message):
    __slots__ = ("seq", "activations", "labels")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    activations: TensorData
    labels: TensorData
    def __init__(self, seq: _Optional[int] = ..., activations: _Optional[_Union[TensorData, _Mapping]] = ..., labels: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...

class SplitGrad(_message.Message):
    __slots__ = ("seq", "grad")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    seq: int
    grad: TensorData
    def __init__(self, seq: _Optional[int] = ..., grad: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...

class SplitDone(_message.Message):
    __slots__ = ("num_samples", "metrics", "weights")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    num_samples: int
    metrics: _containers.ScalarMap[str, float]
    weights: _containers.RepeatedCompositeFieldContainer[TensorData]
    def __init__(self, num_samples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., weights: _Optional[_Iterable[_Union[TensorData, _Mapping]]] = ...) -> None: ...

class SplitSum(_message.Message):
    __slots__ = ("seq", "grads")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    grads: _containers.RepeatedCompositeFieldContainer[TensorData]
    def __init__(self, seq: _Optional[int] = ..., grads: _Optional[_Iterable[_Union[TensorData, _Mapping]]] = ...) -> None: ...

class SplitMessage(_message.Message):
    __slots__ = ("open", "batch", "grad", "done", "sum")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    open: SplitOpen
    batch: SplitBatch
    grad: SplitGrad
    done: SplitDone
    sum: SplitSum
    def __init__(self, open: _Optional[_Union[SplitOpen, _Mapping]] = ..., batch: _Optional[_Union[SplitBatch, _Mapping]] = ..., grad: _Optional[_Union[SplitGrad, _Mapping]] = ..., done: _Optional[_Union[SplitDone, _Mapping]] = ..., sum: _Optional[_Union[SplitSum, _Mapping]] = ...) -> None: ...

class SplitReply(_message.Message):
    __slots__ = ("seq", "tensor", "loss", "correct", "message", "turn_rows", "grads")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TURN_ROWS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    tensor: TensorData
    loss: float
    correct: int
    message: str
    turn_rows: int
    grads: _containers.RepeatedCompositeFieldContainer[TensorData]
    def __init__(self, seq: _Optional[int] = ..., tensor: _Optional[_Union[TensorData, _Mapping]] = ..., loss: _Optional[float] = ..., correct: _Optional[int] = ..., message: _Optional[str] = ..., turn_rows: _Optional[int] = ..., grads: _Optional[_Iterable[_Union[TensorData, _Mapping]]] = ...) -> None: ...
