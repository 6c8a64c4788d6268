"""Reference files (an omni-reference request's ``references``, ``generate --reference``):
file bytes -> an image ``ConditionImage``, a ``ReferenceAudio`` or a ``ReferenceVideo``.

One decoder for the HTTP route (``server.fields.references``) and the CLI. The kind is read
off the file's signature: a WAV file (``RIFF....WAVE``, integer PCM of 8, 16, 24 or 32 bits,
mono or stereo, read with the standard library's ``wave``) is an audio reference at its own
rate; a video container (MP4/MOV, WebM/Matroska, AVI) is a video reference, probed with PyAV
(``video_reference.probe``: decodable, its size, frames, rate and soundtrack) and carried as
the file; anything else is decoded as an image (``image_input.decode_image``: PNG, JPEG, WebP,
bounded by ``max_pixels``). Errors are ``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

import io
import struct
import wave

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.media import video_reference
from ditserve.engine.media.image_input import DEFAULT_MAX_PIXELS, decode_image
from ditserve.engine.reference_media import Reference, ReferenceAudio

MAX_AUDIO_SECONDS = 60.0  # a soundtrack longer than any clip is cut anyway (15 s)


def is_wav(data: bytes) -> bool:
    return data[:4] == b"RIFF" and data[8:12] == b"WAVE"


# A QuickTime file's first atom: ``ftyp`` (MP4, MOV since 2001), or one older files start
# with; Matroska/WebM's EBML magic; RIFF AVI.
_FIRST_ATOMS = (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot")


def is_video(data: bytes) -> bool:
    return data[4:8] in _FIRST_ATOMS or data[:4] == b"\x1a\x45\xdf\xa3" or \
        (data[:4] == b"RIFF" and data[8:12] == b"AVI ")


def decode_reference(data: bytes, *, field: str = "references",
                     max_pixels: int = DEFAULT_MAX_PIXELS) -> Reference:
    """A reference file's bytes -> the reference (see module docstring)."""
    if is_video(data):
        return video_reference.probe(data, field=field)
    if is_wav(data):
        return decode_wav(data, field=field)
    return decode_image(data, field=field, max_pixels=max_pixels)


def decode_wav(data: bytes, *, field: str = "references") -> ReferenceAudio:
    """Integer-PCM WAV bytes -> float32 samples in [-1, 1], channel-major, at the file's
    rate (nothing resampled)."""
    import numpy as np

    try:
        with wave.open(io.BytesIO(data)) as reader:
            channels, width = reader.getnchannels(), reader.getsampwidth()
            rate, count = reader.getframerate(), reader.getnframes()
            if channels not in (1, 2):
                raise InvalidRequestError(field, "a WAV reference is mono or "
                                          f"stereo, got {channels} channels")
            if not 0 < count <= MAX_AUDIO_SECONDS * rate:
                raise InvalidRequestError(field, "a WAV reference holds 1 to "
                                          f"{MAX_AUDIO_SECONDS:g} s of samples, got {count}")
            raw = reader.readframes(count)
    except (wave.Error, EOFError, struct.error) as e:
        raise InvalidRequestError(field, f"not a readable integer-PCM WAV file "
                                  f"({e})") from e
    if len(raw) != count * channels * width:
        raise InvalidRequestError(field, "the WAV file is truncated")
    if width == 3:  # 24-bit: widen to 32 bits, sign kept
        triples = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3)
        padded = np.zeros((triples.shape[0], 4), dtype=np.uint8)
        padded[:, 1:] = triples
        ints = padded.view("<i4").reshape(-1).astype(np.float64)
        scale = float(2**31)
    elif width == 1:  # 8-bit WAV is unsigned
        ints = np.frombuffer(raw, dtype=np.uint8).astype(np.float64) - 128.0
        scale = 128.0
    else:
        ints = np.frombuffer(raw, dtype=f"<i{width}").astype(np.float64)
        scale = float(2 ** (8 * width - 1))
    planes = (ints / scale).astype("<f4").reshape(-1, channels).T  # interleaved -> planes
    return ReferenceAudio(rate, channels, np.ascontiguousarray(planes).tobytes())
