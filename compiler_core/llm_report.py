"""The LLM section of the perf metrics: a QPC with prefill and decode specializations and its KV
cache as retained state, in the units its users think in (all estimated).

- `time_to_first_token_ms`: the prefill of the longest prompt the QPC takes in one run (the
  prompt crossing the host link and the first logits coming back included);
- `decode`: per decode specialization (seq_len 1) its batch, tokens/s (batch / the estimated
  latency of one step, host transfers included: a step needs the last token's logits before
  it can run) and time per output token;
- `tokens_per_s_full_batch`: the decode specialization with the largest batch;
- `kv_bytes_per_sequence`: the retained state one sequence keeps on the device, at its stored
  size (fp16, or MXINT8 blocks);
- `sequences_fit`: how many sequences' caches the SoC's DDR holds beside everything else the
  program places there (weights, I/O, activations): the batch a recompile could serve.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from compiler_core.devices import DeviceProfile
from compiler_core.lowering.program import Program

SEQ_SYMBOLS = ("seq_len", "sequence_length")
BATCH_SYMBOLS = ("batch_size", "batch", "full_batch_size")


def _dims(program: Program, symbols: Mapping[str, int]) -> tuple[int, int]:
    """(batch, tokens per run) of a specialization: its symbols, else its first 2-D input."""
    host_inputs, _ = program.host_ports()
    first = next(
        (program.tensors[t].shape for t in host_inputs if len(program.tensors[t].shape) == 2),
        (1, 1),
    )
    seq = next((int(symbols[s]) for s in SEQ_SYMBOLS if s in symbols), int(first[1]))
    batch = next((int(symbols[s]) for s in BATCH_SYMBOLS if s in symbols), int(first[0]))
    return batch, seq


def llm_report(
    specs: list[tuple[str, Mapping[str, int], Program, Mapping[str, Any]]],
    device: DeviceProfile,
) -> dict[str, Any] | None:
    """`specs`: (name, symbols, program, perf metrics) of each specialization. None when the
    QPC keeps no retained state or has no decode specialization."""
    if not specs or not specs[0][2].retained:
        return None
    prefill: list[tuple[int, str, float]] = []
    decode: list[dict[str, Any]] = []
    for name, symbols, program, metrics in specs:
        batch, seq = _dims(program, symbols)
        latency_s = float(metrics["estimated_latency_us"]) / 1e6
        if seq > 1:
            prefill.append((seq, name, latency_s))
        elif latency_s > 0:
            decode.append(
                {
                    "specialization": name,
                    "batch": batch,
                    "tokens_per_s": round(batch / latency_s, 2),
                    "time_per_output_token_ms": round(latency_s * 1e3, 3),
                }
            )
    if not decode:
        return None
    program = specs[0][2]
    cache = [program.tensors[i] for i in program.retained]
    sequences = max((t.shape[0] for t in cache if t.shape), default=1)
    kv_total = sum(t.nbytes for t in cache)
    per_sequence = kv_total // max(1, sequences)
    others = max(p.ddr_size for _, _, p, _ in specs) - kv_total
    room = device.ddr_bytes_per_soc - others
    full = max(decode, key=lambda d: (d["batch"], d["tokens_per_s"]))
    out: dict[str, Any] = {
        "estimated": True,
        "decode": sorted(decode, key=lambda d: d["batch"]),
        "tokens_per_s_full_batch": round(full["tokens_per_s"], 2),
        "full_batch": full["batch"],
        "kv_bytes_per_sequence": per_sequence,
        "kv_bytes": kv_total,
        "sequences_compiled": sequences,
        "sequences_fit": max(0, room // per_sequence) if per_sequence else None,
    }
    if prefill:
        seq, name, latency_s = max(prefill)
        out["prefill_length"] = seq
        out["prefill_specialization"] = name
        out["time_to_first_token_ms"] = round(latency_s * 1e3, 3)
    return out
