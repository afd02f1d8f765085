"""``--also-replay NAME:KEY=VALUE,...``: replay again beside ``replay``,
with another bank or the connector's other replay settings, each a run of
its own against the same real prefill.  One check then compares, say, a
bank of the prompts' first half written past its end as recorded
(``past_bank=wrap``) and re-rotated (``past_bank=rotate``), or the bank kept
in host memory (``bank_placement=host``), while real prefill - at depth the
check's cost - runs once.

A run inherits replay's settings (``--bank`` or the check's recording,
``--bank-placement``, ``--past-bank``) and overrides those it names:

    --also-replay replay-host:bank_placement=host replay-half:bank=half.safetensors,past_bank=rotate
"""
from __future__ import annotations

import os
import re

KEYS = {"bank": None, "bank_placement": ("auto", "device", "host"), "past_bank": ("wrap", "rotate")}
NAME = re.compile(r"replay-[a-z0-9][a-z0-9-]*")
FORM = "NAME:KEY=VALUE[,KEY=VALUE...] with NAME replay-<lower-case letters, digits, dashes>"


def parse(values: list[str] | None) -> dict[str, dict[str, str]]:
    """``--also-replay``'s values as run name -> the settings it overrides
    (a bank as an absolute path); CheckError naming a malformed value."""
    from .cli import CheckError

    out: dict[str, dict[str, str]] = {}
    for value in values or ():
        name, sep, rest = value.partition(":")
        if not NAME.fullmatch(name) or not sep:
            raise CheckError(f"--also-replay {value!r}: expected {FORM} (e.g. replay-host:bank_placement=host)")
        if name in out:
            raise CheckError(f"--also-replay {value!r}: {name} is named twice; expected each run once")
        settings: dict[str, str] = {}
        for item in rest.split(","):
            key, eq, setting = item.partition("=")
            if not eq or key not in KEYS or not setting:
                raise CheckError(f"--also-replay {value!r}: {item!r} is not a setting; expected KEY=VALUE with KEY "
                                 f"one of {list(KEYS)}")
            if KEYS[key] and setting not in KEYS[key]:
                raise CheckError(f"--also-replay {value!r}: {key} {setting!r}; expected one of {list(KEYS[key])}")
            if key in settings:
                raise CheckError(f"--also-replay {value!r}: {key} is given twice; expected each setting once")
            settings[key] = os.path.abspath(setting) if key == "bank" else setting
        out[name] = settings
    return out


def replay_config(run: str, cfg, bank: str | None) -> dict:
    """The ``kv_connector_extra_config`` of ``replay`` (``run`` "replay")
    or of an ``--also-replay`` run: the check's replay settings, the run's
    own over them; ``bank``: the check's (``--bank`` or its recording)."""
    own = cfg.also_replay.get(run, {})  # none for "replay": its names start "replay-"
    placement = own.get("bank_placement", cfg.bank_placement)
    past = own.get("past_bank", cfg.past_bank)
    return {"fill_mode": "replay", "bank": own.get("bank", bank), **({"verify": "raise"} if cfg.verify else {}),
            **({"bank_placement": placement} if placement != "auto" else {}),
            **({"past_bank": past} if past != "wrap" else {})}


def fill_runs(cfg) -> list[str]:
    """Every run the check compares with real prefill: ``--fills``, then ``--also-replay``'s."""
    return [*cfg.fills, *cfg.also_replay]
