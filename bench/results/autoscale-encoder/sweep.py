"""The shift settings tried in the simulator before run 5 (2026-12-04-autoscale-encoder.md):
`python bench/results/autoscale-encoder/sweep.py` from the repository root."""

from __future__ import annotations

import contextlib
import io
import itertools
from pathlib import Path

from bench.autoscale import parser
from bench.autoscale_sim import shift

TABLE = Path(__file__).parent / "table-bench-model-0.12cpu.json"

for rp, rd, ttft, ph in itertools.product([2.6, 3.0], [2.0, 2.5], [2.0, 3.0], [60, 90]):
    args = parser().parse_args(
        f"--phase-s {ph} --rate-prefill {rp} --long-prompt 512 --rate-decode {rd} "
        f"--long-output 128 --ttft-s {ttft} --tpot-s 0.1".split()
    )
    with contextlib.redirect_stdout(io.StringIO()):
        fixed, scaled = shift(args, TABLE)
    print(
        rp, rd, ttft, ph,
        "fixed", round(100 * fixed["slo"]["attainment"]),
        [round(100 * x) for x in fixed["attainment_by_bucket"]],
        "auto", round(100 * scaled["slo"]["attainment"]),
        [round(100 * x) for x in scaled["attainment_by_bucket"]],
        [(m["role"], round(m["switched_s"])) for m in scaled["moves"]],
    )  # fmt: skip
