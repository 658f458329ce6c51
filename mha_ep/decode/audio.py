"""Whisper's audio front end in NumPy: read a 16 kHz wav, compute the 80-bin log-mel spectrogram.

Same recipe as openai/whisper ``audio.py`` and transformers' WhisperFeatureExtractor: pad or trim to 30 s
(480,000 samples), STFT with a periodic Hann window of 400 samples, hop 160, centred with reflect padding, power
spectrum with the last frame dropped (3000 frames), Slaney-style mel filter bank (librosa's default), log10 clamped
at 1e-10, floor at (max - 8), then ``(x + 4) / 4``. No torch and no librosa needed.
"""

from __future__ import annotations

import wave

import numpy as np

from mha_ep.shipped import folder as shipped_folder

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS  # 480000

# The shipped utterances (espeak-ng, voice en-us, 150 wpm, resampled to 16 kHz mono 16-bit with sox).
DEFAULT_DIR = shipped_folder()  # the shipped wavs sit beside the shipped models (mha_ep/shipped.py)
UTTERANCES = {
    "speech_1.wav": "The quick brown fox jumps over the lazy dog.",
    "speech_2.wav": "Please call Stella and ask her to bring these things with her from the store.",
    "speech_3.wav": "The weather today is sunny with a light breeze from the west.",
}


def read_wav(path) -> np.ndarray:
    """A mono 16-bit PCM wav at 16 kHz as float32 in [-1, 1]; ValueError names what is off otherwise."""
    with wave.open(str(path), "rb") as w:
        rate, channels, width, n = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
        raw = w.readframes(n)
    if rate != SAMPLE_RATE or channels != 1 or width != 2:
        raise ValueError(
            f"{path}: {rate} Hz, {channels} channel(s), {8 * width}-bit; Whisper needs 16000 Hz mono 16-bit "
            "(resample with: sox in.wav -r 16000 -c 1 -b 16 out.wav)"
        )
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0


def _hz_to_mel(f):
    f = np.asarray(f, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0
    return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep, f / f_sp)


def _mel_to_hz(m):
    m = np.asarray(m, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


def mel_filters(n_mels: int = 80, sr: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """(n_mels, 1 + n_fft // 2) Slaney mel filter bank with Slaney area normalisation (librosa's defaults)."""
    fft_freqs = np.linspace(0, sr / 2, 1 + n_fft // 2)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sr / 2), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels]))[:, None]
    return weights.astype(np.float32)


def log_mel_spectrogram(audio: np.ndarray, n_mels: int = 80) -> np.ndarray:
    """(n_mels, 3000) float32 log-mel features of one clip, padded or trimmed to 30 s."""
    audio = np.asarray(audio, dtype=np.float32)[:N_SAMPLES]
    audio = np.pad(audio, (0, N_SAMPLES - audio.shape[0]))
    padded = np.pad(audio.astype(np.float64), (N_FFT // 2, N_FFT // 2), mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic Hann
    n_frames = 1 + (padded.shape[0] - N_FFT) // HOP_LENGTH
    idx = np.arange(N_FFT)[None, :] + HOP_LENGTH * np.arange(n_frames)[:, None]
    spectrum = np.fft.rfft(padded[idx] * window, axis=1)
    power = (np.abs(spectrum) ** 2)[:-1].T  # (201, 3000)
    mel = mel_filters(n_mels).astype(np.float64) @ power
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


def features_for(paths, n_mels: int = 80) -> np.ndarray:
    """(B, n_mels, 3000) batch of log-mel features for wav files."""
    return np.stack([log_mel_spectrogram(read_wav(p), n_mels) for p in paths])
