"""Typed reads of JSON request fields (wrong types -> CodecError naming the field) and the
sampling parameters that every generation endpoint shares."""

from __future__ import annotations

from daemon.api.codecs.base import CodecError, JsonObject
from daemon.loop.request import SamplingParams


def get_int(
    body: JsonObject,
    name: str,
    default: int | None = None,
    *,
    lo: int | None = None,
    hi: int | None = None,
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise CodecError(f"'{name}' must be an integer, got {_kind(value)}", name)
    _check_range(name, value, lo, hi)
    return value


def get_float(
    body: JsonObject,
    name: str,
    default: float | None = None,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CodecError(f"'{name}' must be a number, got {_kind(value)}", name)
    if lo_open and lo is not None and value <= lo:
        raise CodecError(f"'{name}' must be greater than {lo}, got {value}", name)
    _check_range(name, value, lo, hi)
    return float(value)


def get_bool(body: JsonObject, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CodecError(f"'{name}' must be a boolean, got {_kind(value)}", name)
    return value


def get_str(body: JsonObject, name: str, default: str | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise CodecError(f"'{name}' must be a string, got {_kind(value)}", name)
    return value


def get_object(body: JsonObject, name: str) -> JsonObject:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CodecError(f"'{name}' must be an object, got {_kind(value)}", name)
    return value


def get_stop(body: JsonObject, name: str = "stop", max_items: int = 64) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise CodecError(f"'{name}' must be a string or a list of strings", name)
    if len(value) > max_items:
        raise CodecError(f"'{name}' may hold at most {max_items} strings", name)
    return value


def get_int_list(body: JsonObject, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise CodecError(f"'{name}' must be a list of integers", name)
    return value


MAX_LOGIT_BIAS = 1024  # entries: each costs a little host work in every step the request samples


def get_logit_bias(body: JsonObject, name: str = "logit_bias") -> dict[int, float]:
    """OpenAI's `logit_bias`: token id (a decimal string) -> bias in [-100, 100]."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CodecError(f"'{name}' must be an object, got {_kind(value)}", name)
    if len(value) > MAX_LOGIT_BIAS:
        raise CodecError(f"'{name}' holds at most {MAX_LOGIT_BIAS} tokens", name)
    bias: dict[int, float] = {}
    for key, v in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise CodecError(f"'{name}' keys must be token ids, got {key[:32]!r}", name)
        if isinstance(v, bool) or not isinstance(v, int | float) or not -100 <= v <= 100:
            raise CodecError(f"'{name}' values must be numbers in [-100, 100]", name)
        bias[int(key)] = float(v)
    return bias


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sampling_params(
    body: JsonObject,
    *,
    max_tokens: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The sampling fields shared by completions, chat, responses and messages."""
    top_k = get_int(body, "top_k", 0, lo=-1)
    seed = get_int(body, "seed", lo=-(2**63), hi=2**64 - 1)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=get_float(body, "temperature", 1.0, lo=0.0),
            top_p=get_float(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
            top_k=0 if top_k == -1 else top_k,
            min_p=get_float(body, "min_p", 0.0, lo=0.0, hi=1.0),
            presence_penalty=get_float(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
            frequency_penalty=get_float(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
            repetition_penalty=get_float(body, "repetition_penalty", 1.0, lo=0.0, lo_open=True),
            seed=seed,
            stop=get_stop(body),
            stop_token_ids=get_int_list(body, "stop_token_ids"),
            ignore_eos=get_bool(body, "ignore_eos"),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=get_logit_bias(body),
            include_stop_str_in_output=get_bool(body, "include_stop_str_in_output"),
        )
    except ValueError as e:  # SamplingParams' own checks, should ours miss one
        raise CodecError(str(e)) from None


def _check_range(name: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise CodecError(f"'{name}' must be at least {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise CodecError(f"'{name}' must be at most {hi}, got {value}", name)


def _kind(value: object) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)
