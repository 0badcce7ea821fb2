"""v1.core.serial: wire messages round-trip, arrays travel as aux frames without copies, and
malformed input raises DecodeError (never pickle)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
import zmq

from v1.core.protocol import (
    EncoderInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ReadyMessage,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
)
from v1.core.serial import ARRAY_EXT, TENSOR_EXT, DecodeError, MsgpackDecoder, MsgpackEncoder
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)


def roundtrip(obj, type_, copy_frames=True):
    frames = MsgpackEncoder().encode(obj)
    if copy_frames:
        frames = [bytes(f) for f in frames]
    return frames, MsgpackDecoder(type_).decode(frames)


def test_request_with_audio_roundtrips_with_audio_in_an_aux_frame():
    audio = np.random.default_rng(0).standard_normal(16000).astype(np.float32)
    req = EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=7, stop=["x"], seed=3),
        encoder_input=EncoderInput(num_encoder_tokens=1500, content_hash="abc", audio=audio),
        eos_token_id=2,
        priority=-1,
    )
    frames, out = roundtrip(req, EngineCoreRequest)
    assert len(frames) == 2 and len(frames[1]) == audio.nbytes
    assert len(frames[0]) < 400  # the samples are not inside the msgpack payload
    assert out.sampling_params == req.sampling_params and out.priority == -1
    np.testing.assert_array_equal(out.encoder_input.audio, audio)
    assert out.encoder_input.audio.dtype == np.float32


@pytest.mark.parametrize(
    "array",
    [
        np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        np.array(3.5, dtype=np.float64),  # 0-d
        np.zeros((0, 5), dtype=np.int16),  # empty
        np.array([True, False, True]),
        np.arange(10, dtype=">i4"),  # big-endian keeps its byte order
        np.arange(6, dtype=np.float16).reshape(3, 2).T,  # non-contiguous
        np.array([1 + 2j, 3j], dtype=np.complex64),
    ],
    ids=["3d", "0d", "empty", "bool", "bigendian", "noncontig", "complex"],
)
def test_arrays_roundtrip_exactly(array):
    outs = EngineCoreOutputs(outputs=[EngineCoreOutput("a", [], pooled_output=array)])
    frames, decoded = roundtrip(outs, EngineCoreOutputs)
    got = decoded.outputs[0].pooled_output
    assert len(frames) == 2
    assert got.dtype == array.dtype and got.shape == array.shape
    np.testing.assert_array_equal(got, array)


def test_several_arrays_get_their_own_frames_in_order():
    arrays = [np.full(n, n, dtype=np.int64) for n in (1, 2, 3)]
    outs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(f"r{i}", [i], pooled_output=a) for i, a in enumerate(arrays)],
        utility_output=UtilityOutput(5, result={"emb": arrays[2], "n": np.int32(7)}),
    )
    frames, decoded = roundtrip(outs, EngineCoreOutputs)
    assert [len(f) for f in frames[1:]] == [8, 16, 24, 24]
    for a, o in zip(arrays, decoded.outputs, strict=True):
        np.testing.assert_array_equal(o.pooled_output, a)
    assert decoded.utility_output.result["n"] == 7  # numpy scalars become plain numbers
    np.testing.assert_array_equal(decoded.utility_output.result["emb"], arrays[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_torch_tensors_roundtrip_as_tensors(dtype):
    tensor = (torch.arange(12) % 3).to(dtype).reshape(3, 4)
    outs = EngineCoreOutputs(outputs=[EngineCoreOutput("t", [], pooled_output=tensor)])
    frames, decoded = roundtrip(outs, EngineCoreOutputs)
    got = decoded.outputs[0].pooled_output
    assert isinstance(got, torch.Tensor) and got.dtype == dtype and got.shape == (3, 4)
    assert torch.equal(got, tensor)
    assert msgspec.msgpack.decode(frames[0])[0][0][5].code == TENSOR_EXT


def test_small_messages_roundtrip():
    for obj, type_ in [
        (UtilityRequest(7, "get_stats", [1, "x"]), UtilityRequest),
        (ReadyMessage(num_kv_blocks=10, max_model_len=256), ReadyMessage),
        (ReadyMessage(status="FAILED", error="boom"), ReadyMessage),
        (["a", "b"], list[str]),
        (
            EngineCoreRequest(
                request_id="p", prompt_token_ids=[5], pooling_params=PoolingParams(task="score")
            ),
            EngineCoreRequest,
        ),
        (
            EngineCoreOutputs(
                outputs=[
                    EngineCoreOutput(
                        "x",
                        [4, 5],
                        new_logprob_token_ids=[[4, 1], [5, 5]],
                        new_logprobs=[[-0.1, -0.05], [-0.2, -0.2]],
                        new_logprob_ranks=[2, 1],
                        finish_reason=FinishReason.STOP,
                        stop_reason="\n",
                    )
                ],
                scheduler_stats=SchedulerStats(num_running_reqs=3, kv_cache_usage=0.5),
            ),
            EngineCoreOutputs,
        ),
    ]:
        frames, out = roundtrip(obj, type_)
        assert len(frames) == 1 and out == obj


def test_wire_layout_matches_docs():
    """docs/protocol.md promises these exact msgpack shapes; a custom frontend relies on them."""
    arr = np.arange(3, dtype=np.float32)
    out = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r", [9], finish_reason=FinishReason.LENGTH, pooled_output=arr)],
        timestamp=1.5,
    )
    frames = MsgpackEncoder().encode(out)
    raw = msgspec.msgpack.decode(frames[0])
    # array_like structs are positional lists of every field
    assert raw[1:] == [1.5, None, None, False, None]
    item = raw[0][0]
    assert item[:5] == ["r", [9], None, None, None] and item[6:10] == [1, None, None, 0]
    assert len(item) == len(EngineCoreOutput.__struct_fields__)
    # a shorter list decodes: missing trailing fields take their defaults
    short = MsgpackDecoder(EngineCoreOutput).decode([msgspec.msgpack.encode(["r", [9]])])
    assert short == EngineCoreOutput("r", [9])
    ext = item[5]
    assert ext.code == ARRAY_EXT and msgspec.msgpack.decode(ext.data) == ["<f4", [3], 1]
    assert bytes(frames[1]) == arr.tobytes()
    # non-array_like structs are maps without default-valued fields
    req = EngineCoreRequest(request_id="q", prompt_token_ids=[1])
    assert msgspec.msgpack.decode(MsgpackEncoder().encode(req)[0]) == {
        "request_id": "q",
        "prompt_token_ids": [1],
    }
    assert msgspec.msgpack.decode(MsgpackEncoder().encode(UtilityRequest(3, "m"))[0]) == [
        3,
        "m",
        [],
        0,
    ]
    # A frontend of one core may leave client_index out (docs/protocol.md, UTILITY).
    short = msgspec.msgpack.encode([3, "m", []])
    assert MsgpackDecoder(UtilityRequest).decode([short]) == UtilityRequest(3, "m", [], 0)


def test_decoded_arrays_are_views_of_the_received_zmq_frames():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://serial-zero-copy")
    b.connect("inproc://serial-zero-copy")
    try:
        audio = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: above zmq's copy threshold
        frames = MsgpackEncoder().encode(
            EngineCoreRequest(
                request_id="z",
                prompt_token_ids=[1],
                encoder_input=EncoderInput(num_encoder_tokens=1, content_hash="h", audio=audio),
            )
        )
        # the encoder hands zmq the array's own memory
        assert np.shares_memory(np.frombuffer(frames[1], dtype=np.float32), audio)
        a.send_multipart(frames, copy=False)
        received = b.recv_multipart(copy=False)
        decoded = MsgpackDecoder(EngineCoreRequest).decode(received).encoder_input.audio
        frame_view = np.frombuffer(received[1].buffer, dtype=np.uint8)
        assert decoded.ctypes.data == frame_view.ctypes.data  # same memory, no copy
        assert decoded.nbytes == frame_view.nbytes
        np.testing.assert_array_equal(decoded, audio)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def _outputs_with(value) -> bytes:
    return msgspec.msgpack.encode([[["r", [], None, None, None, value]]])


def _ext(code, dtype="<f4", shape=(2,), index=1, *offset):
    return msgspec.msgpack.Ext(code, msgspec.msgpack.encode([dtype, list(shape), index, *offset]))


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "empty message"),
        ([b"\xc1garbage"], "malformed message"),
        ([msgspec.msgpack.encode({"request_id": 3})], "malformed message"),
        ([_outputs_with(msgspec.msgpack.Ext(9, b""))], "unknown msgpack ext type 9"),
        ([_outputs_with(_ext(ARRAY_EXT))], "refers to frame 1"),
        ([_outputs_with(_ext(ARRAY_EXT, index=0)), b"x" * 8], "refers to frame 0"),
        ([_outputs_with(_ext(ARRAY_EXT)), b"x" * 7], "holds 7 bytes"),
        ([_outputs_with(_ext(ARRAY_EXT, dtype="O")), b"x" * 16], "not bool or a number"),
        ([_outputs_with(_ext(ARRAY_EXT, dtype="nope")), b"x" * 8], "unknown array dtype"),
        ([_outputs_with(_ext(ARRAY_EXT, shape=(-2, -4))), b"x" * 32], "negative"),
        ([_outputs_with(msgspec.msgpack.Ext(ARRAY_EXT, b"\xc1")), b"x" * 8], "array header"),
        ([_outputs_with(_ext(TENSOR_EXT, dtype="float99")), b"x" * 8], "unknown tensor dtype"),
        ([_outputs_with(_ext(ARRAY_EXT, "<f4", (2,), 1, 4)), b"x" * 8], "at byte 4 needs 12"),
        ([_outputs_with(_ext(ARRAY_EXT, "<f4", (2,), 1, -4)), b"x" * 8], "array header"),
        ([_outputs_with(_ext(TENSOR_EXT, "float32", (2,), 1, 0)), b"x" * 8], "array header"),
        ([_outputs_with(_ext(ARRAY_EXT, "<f4", (2,), 1, 0, 0)), b"x" * 8], "array header"),
        ([_outputs_with(_ext(ARRAY_EXT, "<f4", ("2",), 1)), b"x" * 8], "array header"),
    ],
)
def test_malformed_messages_raise_decode_error(frames, match):
    with pytest.raises(DecodeError, match=match):
        MsgpackDecoder(EngineCoreOutputs).decode(frames)


def test_unsupported_objects_are_refused_not_pickled():
    encoder = MsgpackEncoder()

    class Custom:
        pass

    for value in (Custom(), np.array([Custom()], dtype=object), np.array(["s"])):
        with pytest.raises(TypeError):
            encoder.encode(UtilityOutput(1, result=value))
    # the encoder is reusable after a failure and frames do not leak between messages
    assert len(encoder.encode(UtilityOutput(1, result=np.zeros(2)))) == 2
    assert len(encoder.encode(UtilityOutput(1, result=3))) == 1


def test_shared_views_travel_in_one_frame_of_their_base():
    """The core's encoder (share_views) sends a step's pooled rows, views of one host array, as
    one aux frame with byte offsets; arrays that are not such views keep their own frames, and
    a frontend's encoder (the default) never sends a base for a view."""
    flat = np.arange(6 * 8, dtype=np.float32)
    rows = [flat[i * 8 : (i + 1) * 8] for i in range(6)]
    strided = np.arange(12.0).reshape(3, 4)[:, 1]  # not contiguous: copied, its own frame
    message = UtilityOutput(1, result=[*rows, np.ones(3), strided])
    frames = MsgpackEncoder(share_views=True).encode(message)
    assert len(frames) == 1 + 3  # payload, the rows' base, the ones, the strided copy
    assert bytes(frames[1]) == flat.tobytes()
    got = MsgpackDecoder(UtilityOutput).decode(frames).result
    for row, want in zip(got[:6], rows, strict=True):
        np.testing.assert_array_equal(row, want)
        assert row.base is not None  # a view of the received frame, no copy
    np.testing.assert_array_equal(got[6], np.ones(3))
    np.testing.assert_array_equal(got[7], strided)
    window = np.arange(100, dtype=np.float32)[10:20]  # a window of a longer signal
    plain = MsgpackEncoder().encode(UtilityOutput(2, result=[window, *rows[:2]]))
    assert [memoryview(f).nbytes for f in plain[1:]] == [40, 32, 32]  # only what is sent
