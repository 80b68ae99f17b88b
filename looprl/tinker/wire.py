"""Tinker's protobuf messages (`tinker/proto/tinker_public_pb2`, shipped in the SDK) read
into plain values and written back: the `forward_backward` request, its
`ForwardBackwardOutput` and the `SampleResponse`. Anything a text model cannot take
(image or audio chunks, an unknown dtype) is refused here with a `RequestError`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from looprl.errors import RequestError

PROTO_CONTENT_TYPE = "application/x-protobuf"


def _proto() -> Any:
    """The SDK's generated module (imported late: the SDK is an optional install)."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as err:
        raise RequestError(
            f"the Tinker server needs the tinker SDK's protobuf messages: pip install "
            f"tinker==0.38.0 ({err})"
        ) from None
    return tinker_public_pb2


@dataclass
class Datum:
    """One training sequence: its input tokens and its named per-position inputs."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class ForwardBackward:
    """A decoded `ForwardBackwardRequest`."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    config: dict[str, float]
    data: list[Datum]
    # what made the data unservable: refused in its turn, so the queue keeps its order
    refusal: str | None = None


def _numpy_dtype(pb: Any, dtype: int) -> np.dtype:
    table = {
        pb.DTYPE_FLOAT32: np.dtype(np.float32),
        pb.DTYPE_INT64: np.dtype(np.int64),
        pb.DTYPE_INT32: np.dtype(np.int32),
    }
    if dtype not in table:
        raise RequestError(f"tensor dtype {dtype} is not served; send float32 or int64 tensors")
    return table[dtype]


def _tensor(pb: Any, msg: Any, name: str) -> np.ndarray:
    """A proto `Tensor` as a dense numpy array of its declared shape."""
    dtype = _numpy_dtype(pb, msg.dtype)
    shape = list(msg.shape)
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) != 2:
            raise RequestError(f"loss_fn_inputs[{name!r}]: a sparse tensor must be 2-D")
        dense = np.zeros(shape, dtype=dtype)
        for row in range(shape[0]):
            cols = col[crow[row] : crow[row + 1]]
            dense[row, cols] = values[crow[row] : crow[row + 1]]
        return dense
    flat = np.frombuffer(msg.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != flat.size:
        raise RequestError(
            f"loss_fn_inputs[{name!r}]: shape {shape} does not hold its {flat.size} values"
        )
    return flat.reshape(shape) if shape else flat


def model_input_tokens(chunks: list[dict[str, Any]]) -> list[int]:
    """A JSON `ModelInput`'s chunks as one token list; only text chunks are served."""
    tokens: list[int] = []
    for chunk in chunks:
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise RequestError(
                f"model input chunk type {kind!r} is not served: this server runs text "
                "models only; send encoded_text chunks"
            )
        tokens.extend(int(t) for t in chunk["tokens"])
    return tokens


def decode_forward_backward(body: bytes, encoding: str | None) -> ForwardBackward:
    """The protobuf body of POST /forward_backward (zstd-compressed if so declared)."""
    pb = _proto()
    if encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as err:  # protobuf's DecodeError: a body that is not the message
        raise RequestError(
            f"forward_backward body is not a ForwardBackwardRequest: {err}"
        ) from None
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "number":
            config[key] = float(value.number)
    out = ForwardBackward(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        forward_only=msg.forward_only,
        config=config,
        data=[],
    )
    try:
        out.data = [_datum(pb, datum, i) for i, datum in enumerate(msg.data)]
    except RequestError as err:
        out.refusal = str(err)
    return out


def _datum(pb: Any, datum: Any, index: int) -> Datum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise RequestError(
                f"data[{index}]: model input chunk type {kind!r} is not served: this server "
                "runs text models only; send encoded_text chunks"
            )
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    inputs = {name: _tensor(pb, t, name) for name, t in datum.loss_fn_inputs.items()}
    return Datum(tokens=tokens, inputs=inputs)


def encode_forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput`: one ArrayRecord holding each datum's `logprobs` (float32,
    the datums' values end to end with their byte offsets), and the metrics."""
    pb = _proto()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    arrays = [np.asarray(lp, dtype=np.float32) for lp in logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    field = record.fields["logprobs"]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = offsets.tobytes()
    field.dtype = pb.DTYPE_FLOAT32
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


@dataclass
class Sequence:
    """One sampled sequence as the `SampleResponse` carries it."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # True: a stop token or string ended it; False: max_tokens did
    top_ids: np.ndarray | None = None  # [len, k] with topk_sample_logprobs
    top_logprobs: np.ndarray | None = None


def _topk(pb: Any, ids: np.ndarray, logprobs: np.ndarray) -> Any:
    return pb.TopkLogprobs(
        token_ids=np.asarray(ids, dtype=np.int32).tobytes(),
        logprobs=np.asarray(logprobs, dtype=np.float32).tobytes(),
        k=int(ids.shape[1]),
        length=int(ids.shape[0]),
    )


def encode_sample_response(
    sequences: list[Sequence],
    prompt_logprobs: np.ndarray | None,
    prompt_top: tuple[np.ndarray, np.ndarray] | None,
) -> bytes:
    """`SampleResponse`: the sequences, and the prompt's logprobs (NaN at position 0)."""
    pb = _proto()
    out = pb.SampleResponse()
    for seq in sequences:
        msg = out.sequences.add()
        msg.stop_reason = pb.STOP_REASON_STOP if seq.stopped else pb.STOP_REASON_LENGTH
        msg.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        msg.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.top_ids is not None and seq.top_logprobs is not None and seq.top_ids.size:
            msg.topk_sampled_logprobs.CopyFrom(_topk(pb, seq.top_ids, seq.top_logprobs))
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if prompt_top is not None:
        out.topk_prompt_logprobs.CopyFrom(_topk(pb, *prompt_top))
    return out.SerializeToString()
