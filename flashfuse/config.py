"""Every environment variable flashfuse reads, in one place.

Each is read at the call that uses it (not at import), so a test or a user
can change it between calls; the one exception is ``TRITON_INTERPRET``, which
Triton itself reads when a kernel is defined (``kernels.BUILT_FOR_INTERPRETER``
records it then).

========================== ========= ==================================================
variable                   default   meaning
========================== ========= ==================================================
FLASHFUSE_AUTOTUNE         1         0: take the first kernel config that fits instead
                                     of timing the candidates
FLASHFUSE_TUNING_CACHE     (Triton's file of tuned choices; a path elsewhere, 0: off
                           cache dir)
FLASHFUSE_BWD              (unset)   one_pass / two_pass: force the backward schedule
FLASHFUSE_TMA              (unset)   0 / 1: turn off / force tensor-descriptor loads
FLASHFUSE_HOPPER           (unset)   0: never take the Hopper (Gluon) kernels
FLASHFUSE_HOPPER_DQ        (unset)   separate / atomic / tma: the Hopper backward's
                                     schedule (two deterministic kernels, or dQ
                                     added from the dK/dV kernel)
FLASHFUSE_DECODE           (unset)   0: never take the split-KV decoding kernels;
                                     1: take them whenever the arguments allow
FLASHFUSE_DECODE_SPLITS    (unset)   n: force the decoding kernels' split count
FLASHFUSE_KVCACHE_CHECKS   1         0: skip the host check of cache lengths and
                                     block tables (it synchronises with the device)
TRITON_INTERPRET           (unset)   1 before import: CPU tensors run the Triton
                                     kernels in Triton's interpreter
========================== ========= ==================================================
"""

from __future__ import annotations

import os

# ``os.environ.get`` encodes the name and decodes the value in Python at
# every call, a few microseconds, and a decode call reads four variables.
# CPython's ``os.environ`` keeps the encoded mapping in ``_data``, which its
# own assignments and deletions (``monkeypatch.setenv`` included) update, so
# reading it there sees the same values; anything else reads os.environ.
_ENVIRON = os.environ
_DATA = getattr(_ENVIRON, "_data", None)
_KEYS: dict = {}  # name -> its encoding in _DATA
_VALUES: dict = {}  # encoded value -> value


def _get(name: str, default: str = "") -> str:
    if os.environ is not _ENVIRON or not isinstance(_DATA, dict):
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENVIRON.encodekey(name)
    raw = _DATA.get(key)
    if raw is None:
        return default
    value = _VALUES.get(raw)
    if value is None:
        if len(_VALUES) > 64:
            _VALUES.clear()
        value = _VALUES[raw] = _ENVIRON.decodevalue(raw)
    return value


def autotune() -> bool:
    return _get("FLASHFUSE_AUTOTUNE", "1") != "0"


def tuning_cache() -> str:
    """The raw setting: "" (Triton's cache directory), "0" (off), or a path."""
    return _get("FLASHFUSE_TUNING_CACHE")


def backward_schedule() -> str:
    """"", "one_pass" or "two_pass" as written (checked by the backward)."""
    return _get("FLASHFUSE_BWD").strip().lower()


def tma() -> str:
    """"", "0" or "1" as written (checked by the launcher)."""
    return _get("FLASHFUSE_TMA")


def hopper() -> str:
    """"" or "0" as written: whether the Hopper kernels may be taken."""
    return _get("FLASHFUSE_HOPPER")


def hopper_dq() -> str:
    """"", "separate", "atomic" or "tma" as written (checked by the launcher)."""
    return _get("FLASHFUSE_HOPPER_DQ").strip().lower()


def decode() -> str:
    """"", "0" or "1" as written."""
    return _get("FLASHFUSE_DECODE")


def decode_splits() -> int | None:
    forced = _get("FLASHFUSE_DECODE_SPLITS")
    return max(1, int(forced)) if forced else None


def decode_knobs() -> tuple:
    """``(decode_splits(), autotune(), interpreter_on())`` in one call: the
    settings a decode launch plan depends on, read at every decode call."""
    return decode_splits(), autotune(), interpreter_on()


# The raw values of the variables a decode call reads -> (decode(),
# decode_knobs()) (``decode_settings``).
_DECODE_VARS = ("FLASHFUSE_DECODE", "FLASHFUSE_DECODE_SPLITS", "FLASHFUSE_AUTOTUNE", "TRITON_INTERPRET")
_DECODE_KEYS = tuple(map(_ENVIRON.encodekey, _DECODE_VARS)) if isinstance(_DATA, dict) else ()
_DECODE_SETTINGS: dict = {}


def decode_settings() -> tuple:
    """``(decode(), decode_knobs())`` in one call: the four variables' raw
    values are looked up together and their reading is kept per values
    (a decode call reads them per layer per token; each ``_get`` is a
    Python call of its own)."""
    if os.environ is not _ENVIRON or not isinstance(_DATA, dict):
        return decode(), decode_knobs()
    raw = tuple(map(_DATA.get, _DECODE_KEYS))
    found = _DECODE_SETTINGS.get(raw)
    if found is None:
        if len(_DECODE_SETTINGS) > 64:
            _DECODE_SETTINGS.clear()
        found = _DECODE_SETTINGS[raw] = (decode(), decode_knobs())
    return found


def kvcache_checks() -> bool:
    return _get("FLASHFUSE_KVCACHE_CHECKS", "1") != "0"


def interpreter_on() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set now (tests switch a process to
    the blockwise CPU path by setting it to 0)."""
    return _get("TRITON_INTERPRET") == "1"
