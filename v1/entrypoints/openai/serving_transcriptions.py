"""/v1/audio/transcriptions and /v1/audio/translations: form checks, upload decoding, formats.

The upload is decoded off the event loop (the one `load_audio` of a request) in chunks of
--audio-chunk-seconds that `v1.engine.transcription.chunk_events` transcribes one after another,
so a long file holds a few chunks in memory. Options are checked before the upload is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from fastapi import Form, Request, UploadFile
from fastapi.responses import PlainTextResponse, Response

from v1.audio import SAMPLE_RATE, AudioError
from v1.audio.decode import stream_audio
from v1.core.errors import EngineDeadError
from v1.engine.transcription import (
    AsyncTranscriber,
    ChunkMerger,
    TranscriptionEvent,
    TranscriptionOptions,
    TranscriptionPlanner,
    TranscriptionResult,
    WindowText,
    chunk_events,
)
from v1.entrypoints.openai import transcript_formats as formats
from v1.entrypoints.openai.errors import APIError, bad_request, engine_dead_error
from v1.entrypoints.openai.http_limits import read_upload_bounded
from v1.entrypoints.openai.metrics import ServerMetrics
from v1.entrypoints.openai.protocol import MAX_LENGTH_PENALTY, TRANSCRIPTION_FORMATS, random_id
from v1.entrypoints.openai.serving_engine import (
    ServerSettings,
    ServingBase,
    SSEResponse,
    json_response,
    lora_unreadable_error,
    map_input_errors,
    run_until_disconnected,
    sse_error,
    sse_event,
)
from v1.sampling_params import SamplingParams

_TIMED_FORMATS = ("srt", "vtt", "verbose_json")
MAX_CONCURRENT_DECODES = 2
"""Uploads decoded at once (off the event loop); more wait, which bounds decoding memory."""
CHUNKS_AHEAD = 1
"""Decoded chunks waiting for their turn; the decoder pauses beyond that."""


@dataclass
class AudioRequest:
    """The multipart fields of a transcription or translation request."""

    task: str
    file: UploadFile
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    response_format: str = "json"
    timestamp_granularities: list[str] = field(default_factory=list)
    stream: bool = False
    decoding: dict[str, Any] = field(default_factory=dict)
    """Extra form fields beam_size, best_of, patience, length_penalty and
    FASTER_WHISPER_FORM_FIELDS (those sent), as `TranscriptionOptions` fields."""


FASTER_WHISPER_FORM_FIELDS = (
    "vad_filter",
    "vad_parameters",
    "hotwords",
    "prefix",
    "hallucination_silence_threshold",
    "multilingual",
    "without_timestamps",
    "max_initial_timestamp",
    "suppress_tokens",
    "suppress_blank",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "clip_timestamps",
    "batch_size",
    "condition_on_previous_text",
    "compression_ratio_threshold",
    "log_prob_threshold",
    "no_speech_threshold",
)
"""faster-whisper's transcribe options the transcription and translation forms take (same
names and meaning; vad_parameters a JSON object, suppress_tokens comma-separated ids,
clip_timestamps "start,end,..." seconds of the whole upload, which each chunk of a long upload
takes its part of; condition_on_previous_text within each chunk of a long upload)."""

FORM_TO_OPTION = {"log_prob_threshold": "logprob_threshold"}
"""Form fields (faster-whisper's names) whose transcribe option is named otherwise."""
OPTION_TO_FORM = {option: form for form, option in FORM_TO_OPTION.items()}


def decoding_options(
    beam_size: int | None,
    best_of: int | None,
    patience: float | None,
    length_penalty: float | None,
    **faster_whisper: Any,
) -> dict[str, Any]:
    """The decoding form fields a client sent (openai-whisper's and faster-whisper's names), as
    transcribe options; a malformed vad_parameters or suppress_tokens is a 400."""
    values = {
        "beam_size": beam_size,
        "best_of": best_of,
        "patience": patience,
        "length_penalty": length_penalty,
    }
    unknown = sorted(set(faster_whisper) - set(FASTER_WHISPER_FORM_FIELDS))
    assert not unknown, unknown  # the routes pass only these
    values.update({FORM_TO_OPTION.get(k, k): v for k, v in faster_whisper.items()})
    if isinstance(values.get("vad_parameters"), str):
        import json

        try:
            values["vad_parameters"] = json.loads(values["vad_parameters"])
        except json.JSONDecodeError as e:
            raise bad_request(
                f"vad_parameters must be a JSON object: {e}", param="vad_parameters"
            ) from e
        if not isinstance(values["vad_parameters"], dict):
            raise bad_request("vad_parameters must be a JSON object", param="vad_parameters")
    if isinstance(values.get("suppress_tokens"), str):
        try:
            values["suppress_tokens"] = [
                int(t) for t in values["suppress_tokens"].split(",") if t.strip()
            ]
        except ValueError as e:
            raise bad_request(
                "suppress_tokens must be comma-separated token ids", param="suppress_tokens"
            ) from e
    return {name: value for name, value in values.items() if value is not None}


async def decoding_form(
    beam_size: Annotated[int | None, Form()] = None,
    best_of: Annotated[int | None, Form()] = None,
    patience: Annotated[float | None, Form()] = None,
    length_penalty: Annotated[float | None, Form()] = None,
    vad_filter: Annotated[bool | None, Form()] = None,
    vad_parameters: Annotated[str | None, Form()] = None,
    hotwords: Annotated[str | None, Form()] = None,
    prefix: Annotated[str | None, Form()] = None,
    without_timestamps: Annotated[bool | None, Form()] = None,
    max_initial_timestamp: Annotated[float | None, Form()] = None,
    suppress_tokens: Annotated[str | None, Form()] = None,
    suppress_blank: Annotated[bool | None, Form()] = None,
    repetition_penalty: Annotated[float | None, Form()] = None,
    no_repeat_ngram_size: Annotated[int | None, Form()] = None,
    clip_timestamps: Annotated[str | None, Form()] = None,
    batch_size: Annotated[int | None, Form()] = None,
    condition_on_previous_text: Annotated[bool | None, Form()] = None,
    compression_ratio_threshold: Annotated[float | None, Form()] = None,
    log_prob_threshold: Annotated[float | None, Form()] = None,
    no_speech_threshold: Annotated[float | None, Form()] = None,
) -> dict[str, Any]:
    """The decoding form fields both audio routes take (a FastAPI dependency: the routes'
    declared fields include these), as transcribe options; a bad value is a 400."""
    if length_penalty is not None and not abs(length_penalty) <= MAX_LENGTH_PENALTY:
        raise APIError(
            400,
            f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], got "
            f"{length_penalty!r}",
            param="length_penalty",
            code="invalid_value",
        )
    return decoding_options(
        beam_size,
        best_of,
        patience,
        length_penalty,
        vad_filter=vad_filter,
        vad_parameters=vad_parameters,
        hotwords=hotwords,
        prefix=prefix,
        without_timestamps=without_timestamps,
        max_initial_timestamp=max_initial_timestamp,
        suppress_tokens=suppress_tokens,
        suppress_blank=suppress_blank,
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
        clip_timestamps=clip_timestamps,
        batch_size=batch_size,
        condition_on_previous_text=condition_on_previous_text,
        compression_ratio_threshold=compression_ratio_threshold,
        log_prob_threshold=log_prob_threshold,
        no_speech_threshold=no_speech_threshold,
    )


class ServingTranscriptions(ServingBase):
    serves_lora = True
    """`model=<adapter name>` transcribes and translates with that LoRA adapter."""

    def __init__(self, engine: Any, settings: ServerSettings, metrics: ServerMetrics) -> None:
        super().__init__(engine, settings, metrics)
        self.decode_pool = ThreadPoolExecutor(MAX_CONCURRENT_DECODES, thread_name_prefix="v1-audio")
        self.transcriber: AsyncTranscriber | None = engine.transcriber
        """The engine's (None: not a speech model)."""

    async def create(self, req: AudioRequest, request: Request) -> Response:
        endpoint = f"/v1/audio/{'translations' if req.task == 'translate' else 'transcriptions'}"
        self.check_model(req.model)
        if self.transcriber is None:
            raise self.wrong_endpoint(endpoint, "a Whisper speech model")
        request_id = random_id("trsc")
        planner = await self._planner(req, request_id)
        data = await self._read_upload(req.file)
        chunks = self._decode_chunks(data)
        first = await _first_chunk(chunks)  # decoding errors are 400s before any work
        if req.stream:
            return SSEResponse(self._stream(planner, first, chunks, request_id))
        try:
            result = await map_input_errors(
                run_until_disconnected(
                    request, self._transcribe_chunks(planner, first, chunks, request_id)
                )
            )
        except (APIError, EngineDeadError):
            raise
        except RuntimeError as e:  # TranscriptionError: the engine failed a window
            lora_error = lora_unreadable_error(str(e))
            if lora_error is not None:
                raise lora_error from e
            raise APIError(500, f"transcription failed: {e}", code="engine_error") from e
        finally:
            await chunks.aclose()
        self.metrics.observe_transcription(result)
        self.metrics.observe_finish(endpoint, "stop")
        return self._format(result, req)

    async def _transcribe_chunks(
        self,
        planner: TranscriptionPlanner,
        first: np.ndarray,
        chunks: AsyncIterator[np.ndarray],
        request_id: str,
    ) -> TranscriptionResult:
        merged = ChunkMerger()
        events = self._chunk_events(planner, first, chunks, request_id, merged)
        async with contextlib.aclosing(events):
            async for _ in events:
                pass
        return merged.result()

    def _chunk_events(
        self,
        planner: TranscriptionPlanner,
        first: np.ndarray,
        chunks: AsyncIterator[np.ndarray],
        request_id: str,
        merged: ChunkMerger,
    ) -> AsyncIterator[TranscriptionEvent]:
        assert self.transcriber is not None
        return chunk_events(self.transcriber, planner, first, chunks, request_id, merged)

    # ---- input ----
    async def _planner(self, req: AudioRequest, request_id: str) -> TranscriptionPlanner:
        """Every option checked, once (400s naming the field), before the upload is read."""
        assert self.transcriber is not None
        self._check_form(req)
        try:
            options = TranscriptionOptions(
                language=req.language or None,
                task=req.task,
                # without_timestamps: timed formats get one segment per window (faster-whisper)
                timestamps=req.response_format in _TIMED_FORMATS
                and not req.decoding.get("without_timestamps"),
                prompt=req.prompt or None,
                sampling_params=SamplingParams(temperature=req.temperature, max_tokens=None),
                word_timestamps="word" in req.timestamp_granularities,
                **req.decoding,
            )
            options.fallback(SamplingParams(temperature=req.temperature))  # the thresholds
        except ValueError as e:
            message = str(e)
            name = message.split(" ", 1)[0]
            if name in OPTION_TO_FORM:  # the client's name for it
                name = OPTION_TO_FORM[name]
                message = name + message[message.index(" ") :]
            raise bad_request(message, param=name) from e
        try:
            return await self.transcriber.prepare(
                options,
                f"{request_id}-0",
                stream_text=req.stream,
                lora_request=self.lora_for(req.model or ""),
            )
        except ValueError as e:
            # Language and task: the form's language (the task is the endpoint's); the
            # alignment heads: word timestamps.
            param = "timestamp_granularities" if "alignment_heads" in str(e) else "language"
            raise bad_request(str(e), param=param) from e

    def _check_form(self, req: AudioRequest) -> None:
        """The checks of the form itself (formats, granularities, temperature, streaming)."""
        if req.response_format not in TRANSCRIPTION_FORMATS:
            raise bad_request(
                f"response_format must be one of {list(TRANSCRIPTION_FORMATS)}, got "
                f"{req.response_format!r}",
                param="response_format",
            )
        for granularity in req.timestamp_granularities:
            if granularity not in ("segment", "word"):
                raise bad_request(
                    f"timestamp_granularities must be 'segment' or 'word', got {granularity!r}",
                    param="timestamp_granularities",
                )
            if req.response_format != "verbose_json":
                raise bad_request(
                    "timestamp_granularities needs response_format=verbose_json",
                    param="timestamp_granularities",
                )
        if not math.isfinite(req.temperature) or not 0.0 <= req.temperature <= 1.0:
            raise bad_request(
                f"temperature must be in [0, 1], got {req.temperature}", param="temperature"
            )
        if req.stream and ("beam_size" in req.decoding or "best_of" in req.decoding):
            raise bad_request("beam_size and best_of cannot stream", param="stream")
        if req.stream and req.response_format not in ("json", "text"):
            raise bad_request(
                "stream=true is available with response_format json or text only",
                param="stream",
            )

    async def _read_upload(self, upload: UploadFile) -> bytes:
        return await read_upload_bounded(upload, self.settings.max_audio_bytes)

    async def _decode_chunks(self, data: bytes) -> AsyncIterator[np.ndarray]:
        """The 16 kHz waveform in --audio-chunk-seconds chunks, decoded on the audio threads while the
        caller works on earlier chunks (at most CHUNKS_AHEAD wait). AudioError: a 400."""
        loop = asyncio.get_running_loop()
        chunk_samples = self.settings.audio_chunk_seconds * SAMPLE_RATE
        sink = _AsyncChunkSink(loop, chunk_samples, CHUNKS_AHEAD)
        limits = (self.settings.max_audio_seconds, self.settings.max_audio_bytes)
        decoding = loop.run_in_executor(self.decode_pool, _decode_into, data, sink, *limits)
        try:
            while True:
                item = await sink.queue.get()
                if item is _END:
                    return
                if isinstance(item, AudioError):
                    raise bad_request(str(item), param="file", code="invalid_audio") from item
                if isinstance(item, BaseException):
                    raise item
                sink.took()
                yield item
        finally:
            sink.closed.set()  # a decoder waiting to hand over a chunk gives up
            decoding.add_done_callback(lambda f: f.cancelled() or f.exception())

    # ---- output ----
    def _format(self, result: Any, req: AudioRequest) -> Response:
        fmt = req.response_format
        if fmt == "text":
            return PlainTextResponse(result.text.strip() + "\n")
        if fmt == "srt":
            return PlainTextResponse(formats.to_srt(result.segments))
        if fmt == "vtt":
            return PlainTextResponse(formats.to_vtt(result.segments), media_type="text/vtt")
        if fmt == "verbose_json":
            # OpenAI: segments by default or when asked for; words only when asked for.
            granularities = req.timestamp_granularities
            body = formats.to_verbose_json(
                result,
                req.task,
                with_segments=not granularities or "segment" in granularities,
                with_words="word" in granularities,
            )
            omitted = {name for name in ("segments", "words") if getattr(body, name) is None}
            return Response(body.model_dump_json(exclude=omitted), media_type="application/json")
        return json_response(formats.to_json(result))

    async def _stream(
        self,
        planner: TranscriptionPlanner,
        first: np.ndarray,
        chunks: AsyncIterator[np.ndarray],
        request_id: str,
    ) -> AsyncIterator[str]:
        """`transcript.text.delta` events in audio order, then `transcript.text.done`."""
        merged = ChunkMerger()
        try:
            events = self._chunk_events(planner, first, chunks, request_id, merged)
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, WindowText):
                        yield sse_event({"type": "transcript.text.delta", "delta": event.text})
            result = merged.result()
            self.metrics.observe_transcription(result)
            kind = "translations" if planner.task == "translate" else "transcriptions"
            self.metrics.observe_finish(f"/v1/audio/{kind}", "stop")
            yield sse_event(
                {
                    "type": "transcript.text.done",
                    "text": result.text,
                    "usage": formats.usage(result.duration).model_dump(),
                }
            )
        except EngineDeadError as e:
            yield sse_error(engine_dead_error(e))
        except APIError as e:
            yield sse_error(e)
        except ValueError as e:
            yield sse_error(bad_request(str(e)))
        except RuntimeError as e:
            yield sse_error(APIError(500, f"transcription failed: {e}", code="engine_error"))
        finally:
            await chunks.aclose()


_END = object()
"""Queue marker: the decoder handed over every chunk."""


class _DecodeCancelled(Exception):
    """The consumer went away; the decoder stops."""


class _AsyncChunkSink:
    """A ChunkSink (v1.audio.decode) for the decoding thread that feeds an asyncio queue:
    `put` hands a chunk over without waiting for the event loop, and blocks the decoder only
    while `max_ahead` chunks are not yet taken (`took` gives room back); `finish` hands over
    the end marker or the error, never blocking.

    The decoder must not wait for the loop to run: under a burst of uploads the busy loop
    takes tens of ms to get to each hand-over, and a decoding thread waiting on it admitted
    only ~2 requests a step (session 20's server step trace; MAX_CONCURRENT_DECODES threads)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, chunk_samples: int, max_ahead: int) -> None:
        self.loop = loop
        self.chunk_samples = chunk_samples
        self.queue: asyncio.Queue[Any] = asyncio.Queue()  # bounded by `room`
        self.room = threading.Semaphore(max_ahead)
        self.closed = threading.Event()

    def put(self, chunk: Any) -> None:
        while not self.room.acquire(timeout=0.1):
            if self.closed.is_set():
                raise _DecodeCancelled()
        if self.closed.is_set():
            raise _DecodeCancelled()
        self.loop.call_soon_threadsafe(self.queue.put_nowait, chunk)

    def took(self) -> None:
        """The consumer took a chunk: the decoder may hand over another."""
        self.room.release()

    def finish(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _decode_into(data: bytes, sink: _AsyncChunkSink, max_seconds: float, max_bytes: int) -> None:
    """Runs on an audio thread: decodes into `sink`, then its end marker or the error."""
    try:
        stream_audio(data, sink, max_seconds=max_seconds, max_bytes=max_bytes)
        sink.finish(_END)
    except _DecodeCancelled:
        return
    except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            sink.finish(e)


async def _first_chunk(chunks: AsyncIterator[np.ndarray]) -> np.ndarray:
    chunk = await anext(chunks, None)
    if chunk is None:
        raise bad_request("audio contains no samples", param="file", code="invalid_audio")
    return chunk
