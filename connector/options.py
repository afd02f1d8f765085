"""The connector's options (``kv_connector_extra_config``): one frozen, typed
object, validated once when the connector is built.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVFillConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"fill_std": 0.1}}'
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from kvfill.bank import BankError, BankIndex
from kvfill.kernels import ValueSpec
from kvfill.kernels.backend import BACKENDS
from kvfill.kernels.values import ValueSpecError

from .bank_fit import PLACEMENTS
from .planner import Granularity

VERIFY_MODES = ("log", "raise")
PAST_BANK = ("wrap", "rotate")
FILL_MODES = ("constant", "normal", "replay")
STAGING_MIB = 256  # the default device staging of a replayed bank (kernels/staging.py STAGING_BYTES)
MAX_STAGING_MIB = 1 << 20  # 1 TiB: past any device; larger values are typos (2**63 was taken)


class OptionError(ValueError):
    """A bad ``kv_connector_extra_config`` entry: names the key, the value and what was expected."""

    def __init__(self, key: str, value: Any, expected: str):
        super().__init__(
            f"KVFillConnector: kv_connector_extra_config[{key!r}] = {value!r} is invalid; expected {expected}"
        )


@dataclass(frozen=True)
class FillOptions:
    """Field names are the config keys; defaults are the in-tree connector's behaviour."""

    fill_mode: str | None = None       # "constant" / "normal" / "replay"; None: normal if fill_std > 0 else constant
    fill_mean: float = 0.015           # as the in-tree connector
    fill_std: float = 0.0              # 0: constant fill_mean; > 0: normal(mean, std)
    seed: int = 0                      # values are a function of (seed, layer, token, element)
    bank: str | None = None            # replay: a bank file recorded by `python -m kvfill.record`
    startup_fill: bool = False         # fill whole caches once at registration
    granularity: Granularity = Granularity.TOKEN  # "token": external slots only; "block": whole blocks
    refill_on_preemption: bool = True  # a preempted request is filled again, not prefilled for real
    backend: str = "auto"              # "auto" / "triton" / "torch"
    page_image_mib: int = 1024         # torch backend: memory for whole pages kept to copy again (0: none)
    verify: str | None = None          # None / "log" / "raise": re-check every fill (debug aid; syncs)
    record_dir: str | None = None      # record role (kvfill.record): save prompt KV rows here, fill nothing
    record_positions: int = 0          # record role: cap on the positions [0, N) saved per prompt (0: whole)
    record_engine: str | None = None   # record role: digest of the recording's engine flags, equal on every node
    record_flags: Any = None           # record role: {flag: digest of its value}, to name the flags nodes differ in
    zero_packed: bool = False          # DeepSeek's indexer and fp8_ds_mla rows get zeros, as the in-tree connector
    bank_placement: str = "auto"       # replay: "device" / "host" (rows streamed per step) / "auto" (device if it fits)
    staging_mib: int = STAGING_MIB     # bank_placement "host": device staging for a step's rows (MiB)
    past_bank: str = "wrap"            # replay past a recorded sequence's end: "wrap" / "rotate" (keys re-rotated)
    values: ValueSpec = field(init=False, repr=False, compare=False)
    bank_index: BankIndex | None = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        keys = {"mean": "fill_mean", "std": "fill_std", "seed": "seed"}
        try:
            values = ValueSpec(self.fill_mean, self.fill_std, self.seed)
        except ValueSpecError as exc:
            raise OptionError(keys[exc.field], exc.value, exc.expected) from None
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "fill_mean", values.mean)
        object.__setattr__(self, "fill_std", values.std)
        for key in ("startup_fill", "refill_on_preemption", "zero_packed"):
            if not isinstance(getattr(self, key), bool):
                raise OptionError(key, getattr(self, key), "true or false")
        try:
            object.__setattr__(self, "granularity", Granularity(self.granularity))
        except ValueError:
            raise OptionError("granularity", self.granularity, "'token' or 'block'") from None
        if self.backend not in BACKENDS:
            raise OptionError("backend", self.backend, f"one of {list(BACKENDS)}")
        if isinstance(self.page_image_mib, bool) or not isinstance(self.page_image_mib, int) \
                or self.page_image_mib < 0:
            raise OptionError("page_image_mib", self.page_image_mib, "an int >= 0 (MiB; 0 keeps no page images)")
        if self.bank_placement not in PLACEMENTS:
            raise OptionError("bank_placement", self.bank_placement, f"one of {list(PLACEMENTS)}")
        if isinstance(self.staging_mib, bool) or not isinstance(self.staging_mib, int) or \
                not 1 <= self.staging_mib <= MAX_STAGING_MIB:
            raise OptionError("staging_mib", self.staging_mib, f"an int in [1, {MAX_STAGING_MIB}] (MiB of device "
                                                               f"staging for a bank kept in host memory)")
        if self.past_bank not in PAST_BANK:
            raise OptionError("past_bank", self.past_bank, f"one of {list(PAST_BANK)}")
        if self.verify not in (None, *VERIFY_MODES):
            raise OptionError("verify", self.verify, "false, true, 'log' or 'raise'")
        self._check_mode()
        if self.record_dir is None and self.record_positions:
            raise OptionError("record_positions", self.record_positions, "0 (unset) without record_dir")
        if self.record_engine is not None and (self.record_dir is None or not isinstance(self.record_engine, str)):
            raise OptionError("record_engine", self.record_engine, "a digest string, with record_dir")
        if self.record_flags is not None:
            flags = self.record_flags
            if isinstance(flags, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in flags):
                flags = dict(flags)  # dataclasses.replace of options already made
            if self.record_engine is None or not isinstance(flags, Mapping) or \
                    not all(isinstance(k, str) and isinstance(v, str) for k, v in flags.items()):
                raise OptionError("record_flags", flags, "a mapping of flag names to digest strings, with "
                                                         "record_engine")
            object.__setattr__(self, "record_flags", tuple(sorted(flags.items())))
        if self.record_dir is not None and self.zero_packed:
            raise OptionError("zero_packed", self.zero_packed, "false with record_dir (a recording reads every cache; "
                                                               "zeros are a fill's choice)")
        if self.record_dir is not None:
            if not isinstance(self.record_dir, str) or not self.record_dir:
                raise OptionError("record_dir", self.record_dir, "a directory path")
            if os.path.exists(self.record_dir) and not os.path.isdir(self.record_dir):
                raise OptionError("record_dir", self.record_dir, "a directory path (it names an existing file)")
            if isinstance(self.record_positions, bool) or not isinstance(self.record_positions, int) \
                    or self.record_positions < 0:
                raise OptionError("record_positions", self.record_positions,
                                  "an int >= 0 with record_dir (the most positions saved per prompt; 0: all)")

    def _check_mode(self) -> None:
        """``fill_mode`` against ``fill_std`` and ``bank``; the bank's index read once."""
        mode = self.fill_mode
        if mode is None:
            mode = "replay" if self.bank is not None else ("normal" if self.fill_std > 0 else "constant")
        if mode not in FILL_MODES:
            raise OptionError("fill_mode", self.fill_mode, f"one of {list(FILL_MODES)}")
        if mode == "normal" and self.fill_std <= 0:
            raise OptionError("fill_std", self.fill_std, "a finite number > 0 with fill_mode 'normal'")
        if mode == "constant" and self.fill_std > 0:
            raise OptionError("fill_std", self.fill_std, "0 with fill_mode 'constant' (or fill_mode 'normal')")
        if mode == "replay" and self.bank is None:
            raise OptionError("bank", None, "the path of a bank file with fill_mode 'replay' "
                                            "(record one with `python -m kvfill.record`)")
        if mode != "replay" and self.bank_placement != "auto":
            raise OptionError("bank_placement", self.bank_placement, "'auto' (unset) without a bank: it says where "
                                                                     "a replayed bank is kept")
        if mode != "replay" and self.staging_mib != STAGING_MIB:
            raise OptionError("staging_mib", self.staging_mib, f"{STAGING_MIB} (unset) without a bank: it sizes the "
                                                               f"staging a replayed bank's rows go through")
        if mode != "replay" and self.past_bank != "wrap":
            raise OptionError("past_bank", self.past_bank, "'wrap' (unset) without a bank: it says what replay writes "
                                                           "past a recorded sequence's end")
        if mode != "replay" and self.bank is not None:
            raise OptionError("fill_mode", self.fill_mode, "'replay' (or unset) with a bank")
        if mode == "replay" and self.startup_fill:
            # A startup fill writes every block before any request exists: no
            # prompt prefix picks its rows, and the requests' own fills skip it.
            raise OptionError("startup_fill", self.startup_fill,
                              "false with 'bank' (replay fills each request's blocks with its own rows)")
        index = None
        if self.bank is not None:
            if not isinstance(self.bank, str):
                raise OptionError("bank", self.bank, "the path of a bank file")
            try:
                index = BankIndex.read(self.bank)
            except BankError as exc:
                raise OptionError("bank", self.bank, f"a readable kvfill bank ({exc})") from None
        object.__setattr__(self, "fill_mode", mode)
        object.__setattr__(self, "bank_index", index)

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse what the engine's ``max_model_len`` makes impossible: a
        request never has more positions, so recording past it saves nothing."""
        if self.recording and max_model_len and self.record_positions > max_model_len:
            raise OptionError("record_positions", self.record_positions,
                              f"an int <= the engine's max_model_len ({max_model_len}): no prompt can have more "
                              f"positions, so nothing would be recorded")

    @property
    def replay(self) -> bool:
        return self.fill_mode == "replay"

    @property
    def recording(self) -> bool:
        return self.record_dir is not None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "FillOptions":
        """Options from ``kv_connector_extra_config``; an unknown key is an
        error listing the valid ones.  ``verify``: true means ``"raise"``."""
        extra = dict(extra or {})
        valid = sorted(f.name for f in fields(cls) if f.init)
        unknown = sorted(set(extra) - set(valid))
        if unknown:
            raise ValueError(
                f"KVFillConnector: unknown kv_connector_extra_config key(s) {unknown}; valid keys: {valid}"
            )
        if extra.get("verify") is True:
            extra["verify"] = "raise"
        elif extra.get("verify") is False:
            extra["verify"] = None
        return cls(**extra)

    def summary(self) -> str:
        if self.recording:
            cap = f" (at most {self.record_positions})" if self.record_positions else ""
            return f"recording each prompt's positions{cap} to {self.record_dir}"
        if self.replay:
            idx = self.bank_index
            lo, hi = int(idx.lengths.min()), int(idx.lengths.max())
            what = (f"replay fill from {self.bank} ({idx.num_sequences} sequences of "
                    f"{lo if lo == hi else f'{lo}-{hi}'} positions")
        else:
            kind = "random" if self.fill_std > 0 else "constant"
            what = f"{kind} fill (mean={self.fill_mean:g}, std={self.fill_std:g}, seed={self.seed}"
        return f"{what}, {self.granularity.value} granularity), startup_fill={self.startup_fill}, verify={self.verify}"
