"""Example mutate guard: redacts e-mail addresses and card numbers.

Every string value of a call's JSON arguments, at any depth (keys are left
alone), has its e-mail addresses and its card-number-like digit runs (13 to 19
digits, optionally grouped by single spaces or dashes) replaced with
``[REDACTED]``. A call is rewritten only when something changed; others get no
verdict and proceed as they are. A call whose arguments cannot be read as a
JSON object is steered: what the redactor cannot read it cannot clean, so it
never lets it through.

A mutate guard's rewrites apply only within its grant (SPEC.md R11), so this
one registers with role ``mutate`` and grant ``*`` by default
(``--grant-tools``).

Run::

    python guards/python/examples/pii_redactor.py \\
        --port 0 [--mesh 127.0.0.1:50051] [--delay-ms 200] [--luhn]

Flags: the kit's (``--help``) plus ``--delay-ms N`` (wait N ms before
answering, waking early if the mesh cancels) and ``--luhn`` (redact only digit
runs that pass the Luhn check, as real card numbers do).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Callable

from guardmesh import guard as gg

UNREADABLE = ("The arguments of this call could not be read as a JSON object, so it was "
              "not judged and not run. Send them as one plain JSON object and retry.")


def read_args(call: gg.Call) -> dict | None:
    """The call's arguments as a dict ("" is ``{}``), or None when they cannot
    be read as a JSON object. A guard that cannot read a call cannot judge it:
    it skips it (steer) rather than let it through unjudged."""
    if not call.arguments.strip():
        return {}
    try:
        value = json.loads(call.arguments)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


REDACTED = "[REDACTED]"
EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def make_redactor(luhn: bool) -> Callable[[str], str]:
    def card(match: re.Match) -> str:
        digits = re.sub(r"\D", "", match.group(0))
        return REDACTED if not luhn or luhn_ok(digits) else match.group(0)

    def redact_text(text: str) -> str:
        return CARD.sub(card, EMAIL.sub(REDACTED, text))

    return redact_text


def redact(value: Any, redact_text: Callable[[str], str]) -> Any:
    """A copy of a JSON value with every string value redacted."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {key: redact(item, redact_text) for key, item in value.items()}
    if isinstance(value, list):
        return [redact(item, redact_text) for item in value]
    return value


def make_judge(luhn: bool, delay_ms: int):
    redact_text = make_redactor(luhn)

    def judge(batch: gg.Batch):
        if delay_ms and not batch.sleep(delay_ms / 1000.0):
            return
        for call in batch.calls:
            args = read_args(call)
            if args is None:
                yield gg.steer(call.call_id, UNREADABLE)
                continue
            redacted = redact(args, redact_text)
            if redacted != args:
                yield gg.rewrite(call.call_id, arguments=redacted)

    return judge


def main() -> None:
    parser = gg.argument_parser(__doc__.splitlines()[0], name="pii-redactor",
                                role="mutate", grant_tools="*")
    parser.add_argument("--delay-ms", type=int, default=0,
                        help="wait this long before answering (for tests)")
    parser.add_argument("--luhn", action="store_true",
                        help="redact only digit runs that pass the Luhn check")
    args = parser.parse_args()
    sys.exit(gg.run(make_judge(args.luhn, args.delay_ms), args))


if __name__ == "__main__":
    main()
