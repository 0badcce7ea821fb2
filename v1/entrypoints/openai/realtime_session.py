"""The Realtime API's session objects, both dialects: a client's `session` -> `SessionConfig`
(every key checked; unknown or unsupported ones are errors, not ignored) and a
`SessionConfig` -> the session object the server's events carry; and an append's audio."""

from __future__ import annotations

import base64
import binascii
from dataclasses import replace
from typing import Any

from v1.engine.realtime import RealtimeError, ServerVad, SessionConfig


def session_config(session: dict[str, Any], current: SessionConfig, beta: bool) -> SessionConfig:
    """A `session.update` (GA) or `transcription_session.update` (beta) applied to `current`."""
    return _beta_config(session, current) if beta else _ga_config(session, current)


def ga_session(session_id: str, config: SessionConfig, model_name: str) -> dict[str, Any]:
    return {
        "type": "transcription",
        "id": session_id,
        "object": "realtime.transcription_session",
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": config.input_sample_rate},
                "transcription": _transcription(config, model_name),
                "turn_detection": _turn_detection(config.turn_detection),
                "noise_reduction": None,
            }
        },
        "include": [],
    }


def beta_session(session_id: str, config: SessionConfig, model_name: str) -> dict[str, Any]:
    return {
        "id": session_id,
        "object": "realtime.transcription_session",
        "input_audio_format": "pcm16",
        "input_audio_sample_rate": config.input_sample_rate,
        "input_audio_transcription": _transcription(config, model_name),
        "turn_detection": _turn_detection(config.turn_detection),
        "input_audio_noise_reduction": None,
        "modalities": ["text"],
        "include": [],
    }


def _transcription(config: SessionConfig, model_name: str) -> dict[str, Any]:
    return {"model": model_name, "language": config.language, "prompt": config.prompt or ""}


def _ga_config(session: dict[str, Any], current: SessionConfig) -> SessionConfig:
    kind = session.get("type", "transcription")
    if kind != "transcription":
        raise RealtimeError(
            f"session.type must be 'transcription' on this server, got {kind!r}",
            "invalid_value",
            "session.type",
        )
    _reject_unknown(session, {"type", "audio", "include", "id", "object"}, "session")
    if session.get("include"):
        raise RealtimeError("include is not supported (no logprobs)", "invalid_value", "include")
    audio = _object(session.get("audio"), "session.audio")
    audio_input = _object(audio.get("input"), "session.audio.input")
    config = current
    if "format" in audio_input:
        config = replace(config, input_sample_rate=_format_rate(audio_input["format"], "format"))
    if "transcription" in audio_input:
        config = _with_transcription(config, audio_input["transcription"], "transcription")
    if "turn_detection" in audio_input:
        config = replace(config, turn_detection=_turn_detection_of(audio_input["turn_detection"]))
    _no_noise_reduction(audio_input.get("noise_reduction"), "audio.input.noise_reduction")
    return config


def _beta_config(session: dict[str, Any], current: SessionConfig) -> SessionConfig:
    known = {
        "input_audio_format",
        "input_audio_sample_rate",
        "input_audio_transcription",
        "turn_detection",
        "input_audio_noise_reduction",
        "modalities",
        "include",
        "client_secret",
        "id",
        "object",
    }
    _reject_unknown(session, known, "session")
    if session.get("include"):
        raise RealtimeError("include is not supported (no logprobs)", "invalid_value", "include")
    config = current
    if "input_audio_format" in session:
        config = replace(
            config,
            input_sample_rate=_format_rate(session["input_audio_format"], "input_audio_format"),
        )
    rate = session.get("input_audio_sample_rate")
    if rate is not None:
        if isinstance(rate, bool) or not isinstance(rate, int):
            raise RealtimeError(
                f"input_audio_sample_rate must be an integer, got {rate!r}",
                "invalid_value",
                "input_audio_sample_rate",
            )
        config = replace(config, input_sample_rate=rate)
    if "input_audio_transcription" in session:
        config = _with_transcription(
            config, session["input_audio_transcription"], "input_audio_transcription"
        )
    if "turn_detection" in session:
        config = replace(config, turn_detection=_turn_detection_of(session["turn_detection"]))
    _no_noise_reduction(session.get("input_audio_noise_reduction"), "input_audio_noise_reduction")
    return config


def _format_rate(value: Any, param: str) -> int:
    """OpenAI's audio formats: 'pcm16' (beta; 24 kHz) or {type: 'audio/pcm', rate}."""
    if value == "pcm16":
        return 24_000
    if isinstance(value, dict) and value.get("type", "audio/pcm") == "audio/pcm":
        rate = value.get("rate", 24_000)
        if isinstance(rate, bool) or not isinstance(rate, int):
            raise RealtimeError(
                f"{param}.rate must be an integer, got {rate!r}", "invalid_value", param
            )
        return rate
    raise RealtimeError(
        f"{param} must be 'pcm16' or {{'type': 'audio/pcm', 'rate': 16000 | 24000}} (PCM16 "
        f"mono little-endian; G.711 is not supported), got {value!r}",
        "invalid_value",
        param,
    )


def _with_transcription(config: SessionConfig, value: Any, param: str) -> SessionConfig:
    if value is None:
        return replace(config, language=None, prompt=None)
    value = _object(value, param)
    _reject_unknown(value, {"model", "language", "prompt"}, param)
    updates: dict[str, Any] = {}
    for name in ("language", "prompt"):
        if name in value:
            item = value[name]
            if item is not None and not isinstance(item, str):
                raise RealtimeError(
                    f"{param}.{name} must be a string, got {item!r}",
                    "invalid_value",
                    f"{param}.{name}",
                )
            updates[name] = item or None
    return replace(config, **updates)


def model_field(session: dict[str, Any], beta: bool) -> str | None:
    if beta:
        transcription = session.get("input_audio_transcription")
    else:
        transcription = ((session.get("audio") or {}).get("input") or {}).get("transcription")
    model = transcription.get("model") if isinstance(transcription, dict) else None
    if model is not None and not isinstance(model, str):
        raise RealtimeError(f"model must be a string, got {model!r}", "invalid_value", "model")
    return model


def _turn_detection_of(value: Any) -> ServerVad | None:
    if value is None:
        return None
    value = _object(value, "turn_detection")
    kind = value.get("type", "server_vad")
    if kind != "server_vad":
        raise RealtimeError(
            f"turn_detection.type must be 'server_vad' (or turn_detection null for manual "
            f"commits), got {kind!r}",
            "invalid_value",
            "turn_detection.type",
        )
    _reject_unknown(
        value,
        {"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response"},
        "turn_detection",
    )
    fields: dict[str, Any] = {}
    for name, kinds in (
        ("threshold", (int, float)),
        ("prefix_padding_ms", (int,)),
        ("silence_duration_ms", (int,)),
    ):
        item = value.get(name)
        if item is None:
            continue
        if isinstance(item, bool) or not isinstance(item, kinds):
            raise RealtimeError(
                f"turn_detection.{name} must be a number, got {item!r}",
                "invalid_value",
                f"turn_detection.{name}",
            )
        fields[name] = item
    return ServerVad(**fields)


def _turn_detection(vad: ServerVad | None) -> dict[str, Any] | None:
    if vad is None:
        return None
    return {
        "type": "server_vad",
        "threshold": vad.threshold,
        "prefix_padding_ms": vad.prefix_padding_ms,
        "silence_duration_ms": vad.silence_duration_ms,
    }


def _no_noise_reduction(value: Any, param: str) -> None:
    if value is not None:
        raise RealtimeError("noise reduction is not supported; send null", "invalid_value", param)


def _object(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RealtimeError(f"{param} must be an object, got {value!r}", "invalid_value", param)
    return value


def _reject_unknown(value: dict[str, Any], known: set[str], param: str) -> None:
    unknown = sorted(set(value) - known)
    if unknown:
        raise RealtimeError(
            f"{param} has unsupported fields {unknown}; known: {sorted(known)}",
            "unknown_parameter",
            f"{param}.{unknown[0]}",
        )


def audio_bytes(event: dict[str, Any]) -> bytes:
    audio = event.get("audio")
    if not isinstance(audio, str):
        raise RealtimeError(
            "audio must be a base64 string of PCM16 audio", "invalid_value", "audio"
        )
    try:
        return base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RealtimeError(f"audio is not valid base64: {e}", "invalid_value", "audio") from e
