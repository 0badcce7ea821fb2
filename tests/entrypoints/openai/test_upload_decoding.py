"""The upload decoder's hand-over to the event loop (`_AsyncChunkSink`): a decoding thread never
waits for the loop to run (a busy loop under a burst of uploads admitted only ~2 requests a
step while the decoders waited on it), and still pauses while CHUNKS_AHEAD chunks are untaken."""

from __future__ import annotations

import asyncio
import io
import threading

import numpy as np
import soundfile as sf

from v1.entrypoints.openai.serving_transcriptions import _END, _AsyncChunkSink, _decode_into

SR = 16000


def _wav(seconds: float) -> bytes:
    samples = (0.1 * np.random.default_rng(0).standard_normal(int(seconds * SR))).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, samples, SR, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _decode_in_thread(data: bytes, sink: _AsyncChunkSink) -> threading.Thread:
    thread = threading.Thread(target=_decode_into, args=(data, sink, 3600.0, 1 << 30))
    thread.start()
    return thread


def _drain(loop: asyncio.AbstractEventLoop, sink: _AsyncChunkSink) -> list:
    items = []
    while not sink.queue.empty():
        items.append(loop.run_until_complete(sink.queue.get()))
    return items


def test_a_short_upload_decodes_without_the_loop_running() -> None:
    loop = asyncio.new_event_loop()
    try:
        sink = _AsyncChunkSink(loop, chunk_samples=30 * SR, max_ahead=1)
        thread = _decode_in_thread(_wav(2.0), sink)
        thread.join(timeout=10)
        assert not thread.is_alive()  # the loop never ran: the decoder did not wait for it
        loop.run_until_complete(asyncio.sleep(0))  # the scheduled hand-overs run
        items = _drain(loop, sink)
        assert len(items) == 2 and items[1] is _END
        assert items[0].shape == (2 * SR,)
    finally:
        loop.close()


def test_a_long_upload_pauses_until_its_chunks_are_taken() -> None:
    loop = asyncio.new_event_loop()
    try:
        sink = _AsyncChunkSink(loop, chunk_samples=SR, max_ahead=1)  # 1 s chunks
        thread = _decode_in_thread(_wav(3.0), sink)
        thread.join(timeout=1.0)
        assert thread.is_alive()  # one chunk handed over, the next waits for room
        chunks = []
        while True:
            loop.run_until_complete(asyncio.sleep(0.05))
            items = _drain(loop, sink)
            for item in items:
                if item is not _END:
                    chunks.append(item)
                    sink.took()
            if items and items[-1] is _END:
                break
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert [c.shape[0] for c in chunks] == [SR, SR, SR]
    finally:
        loop.close()


def test_a_consumer_that_leaves_stops_a_waiting_decoder() -> None:
    loop = asyncio.new_event_loop()
    try:
        sink = _AsyncChunkSink(loop, chunk_samples=SR, max_ahead=1)
        thread = _decode_in_thread(_wav(5.0), sink)
        thread.join(timeout=0.5)
        assert thread.is_alive()
        sink.closed.set()  # what the request's chunk iterator does when it closes
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        loop.close()
