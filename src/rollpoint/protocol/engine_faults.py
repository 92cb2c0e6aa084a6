"""Bad engine data on purpose: the vocabulary of the scripted policy's ``policy.faults``.

Owns :class:`EngineFault` (one corruption and the calls it hits) and the bad values each
corruption puts in place. The run config (``policy.faults``) and the scripted policy
(:mod:`rollpoint.policy.scripted_faults`, which applies them) both read it; it lives here,
apart from the policy server, so loading a config does not load that server.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import Field, model_validator

from rollpoint.protocol.model_base import StrictModel

Corruption = Literal["oversized_reply", "token_data", "tool_call_id"]
TokenDataHow = Literal[
    "id_too_large",
    "id_string",
    "id_float",
    "id_negative",
    "logprob_positive",
    "logprob_string",
    "logprob_null",
]
BAD_VALUES: dict[str, Any] = {
    "id_too_large": 2**31,
    "id_string": "13",
    "id_float": 13.0,
    "id_negative": -1,
    "logprob_positive": 0.5,
    "logprob_string": "x",
    "logprob_null": None,
}
"""What each ``token_data`` corruption puts in place of one id or one logprob."""
TOKEN_DATA_HOWS: tuple[TokenDataHow, ...] = get_args(TokenDataHow)
PADDING = "oversized reply padding "
"""What an oversized reply's content is padded with (repeated, cut to ``pad_bytes``): ASCII,
so it is as many bytes on the wire, and easy to find in a transcript."""
MAX_PAD_BYTES = 256 * 1024 * 1024


class EngineFault(StrictModel):
    """One corruption, and which of the calls it can corrupt get it."""

    corrupt: Corruption
    calls: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1, max_length=1024)]
    """Which of the calls this fault can corrupt get it: 1 is the first such call."""
    how: TokenDataHow | None = None
    """``token_data`` only: which bad value, in place of which field."""
    pad_bytes: Annotated[int, Field(ge=1, le=MAX_PAD_BYTES)] | None = None
    """``oversized_reply`` only: bytes of padding added to the reply's content."""

    @model_validator(mode="after")
    def _check(self) -> EngineFault:
        if self.calls != sorted(set(self.calls)):
            raise ValueError(f"calls must be increasing call numbers, got {self.calls}")
        if (self.how is None) == (self.corrupt == "token_data"):
            raise ValueError("how is required for token_data, and only for it")
        if (self.pad_bytes is None) == (self.corrupt == "oversized_reply"):
            raise ValueError("pad_bytes is required for oversized_reply, and only for it")
        return self
