"""The LLM section of the perf metrics: a QPC with prefill and decode specializations and its KV
cache as retained state, in the units its users think in (all estimated).

A specialization's batch and tokens per run are its `input_ids` shape (else its symbols, else
its first 2-D input). It is a decode when it runs one token per sequence, a speculative
decode when it verifies k drafts (`num_speculative_tokens` = k, or QEfficient's
`num_logits_to_keep` equal to a seq_len above 1), a prefill otherwise.

- `time_to_first_token_ms`: the prefill of the longest prompt the QPC takes in one run (the
  prompt crossing the host link and the first logits coming back included);
- `chunked_prefill`: a longer prompt in several runs of that prefill (each run is the same
  program: the cache offsets come from `position_ids`): the time to first token of prompts
  of 2, 4, ... runs up to the context;
- `decode`: per decode specialization its batch (with continuous batching a subset of the
  `full_batch_size` cache slots), tokens/s (batch / the estimated latency of one step, host
  transfers included: a step needs the last token's logits before it can run) and time per
  output token;
- `tokens_per_s_full_batch`: the decode specialization with the largest batch;
- `speculative`: per speculative decode its batch, tokens per step (k + 1 when every draft is
  accepted), tokens/s at that best case, and the mean accepted drafts per step it needs to
  beat the plain decode of the same batch (the draft model's own time not counted);
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
from compiler_core.specializations import SPECULATIVE

SEQ_SYMBOLS = ("seq_len", "sequence_length")
BATCH_SYMBOLS = ("batch_size", "batch", "full_batch_size")
SLOT_SYMBOL = "full_batch_size"
CHUNKED_ENTRIES = 4
"""Prompt lengths the chunked-prefill list gives (2, 4, 8, 16 runs, up to the context)."""


def _dims(program: Program, symbols: Mapping[str, int]) -> tuple[int, int]:
    """(batch, tokens per run) of a specialization."""
    host_inputs, _ = program.host_ports()
    shapes = {program.tensors[t].name: program.tensors[t].shape for t in host_inputs}
    ids = shapes.get("input_ids")
    if ids is not None and len(ids) == 2:
        return int(ids[0]), int(ids[1])
    first = next((s for s in shapes.values() if len(s) == 2), (1, 1))
    seq = next((int(symbols[s]) for s in SEQ_SYMBOLS if s in symbols), int(first[1]))
    batch = next((int(symbols[s]) for s in BATCH_SYMBOLS if s in symbols), int(first[0]))
    return batch, seq


def _speculative(symbols: Mapping[str, int], seq: int) -> bool:
    if SPECULATIVE in symbols:
        return True
    return seq > 1 and int(symbols.get("num_logits_to_keep", 1)) == seq


def _context(program: Program, symbols: Mapping[str, int]) -> int | None:
    """The cache length: `ctx_len`, else the [batch, heads, ctx, head_dim] cache's axis 2."""
    if "ctx_len" in symbols:
        return int(symbols["ctx_len"])
    shapes = [program.tensors[i].shape for i in program.retained]
    return max((s[2] for s in shapes if len(s) == 4), default=None)


def llm_report(
    specs: list[tuple[str, Mapping[str, int], Program, Mapping[str, Any]]],
    device: DeviceProfile,
) -> dict[str, Any] | None:
    """`specs`: (name, symbols, program, perf metrics) of each specialization. None when the
    QPC keeps no retained state or has no decode specialization."""
    if not specs or not specs[0][2].retained:
        return None
    prefill: list[tuple[int, str, float, int | None]] = []
    decode: list[dict[str, Any]] = []
    speculative: list[dict[str, Any]] = []
    for name, symbols, program, metrics in specs:
        batch, seq = _dims(program, symbols)
        latency_s = float(metrics["estimated_latency_us"]) / 1e6
        if latency_s <= 0:
            continue
        step = {
            "specialization": name,
            "batch": batch,
            **({"slots": int(symbols[SLOT_SYMBOL])} if SLOT_SYMBOL in symbols else {}),
        }
        if seq == 1:
            decode.append(
                {
                    **step,
                    "tokens_per_s": round(batch / latency_s, 2),
                    "time_per_output_token_ms": round(latency_s * 1e3, 3),
                }
            )
        elif _speculative(symbols, seq):
            speculative.append(
                {
                    **step,
                    "tokens_per_step": seq,
                    "time_per_step_ms": round(latency_s * 1e3, 3),
                    "tokens_per_s_all_accepted": round(batch * seq / latency_s, 2),
                }
            )
        else:
            prefill.append((seq, name, latency_s, _context(program, symbols)))
    if not decode and not speculative:
        return None
    program = specs[0][2]
    cache = [program.tensors[i] for i in program.retained]
    sequences = max((t.shape[0] for t in cache if t.shape), default=1)
    kv_total = sum(t.nbytes for t in cache)
    per_sequence = kv_total // max(1, sequences)
    others = max(p.ddr_size for _, _, p, _ in specs) - kv_total
    room = device.ddr_bytes_per_soc - others
    out: dict[str, Any] = {"estimated": True, "decode": sorted(decode, key=lambda d: d["batch"])}
    if decode:
        full = max(decode, key=lambda d: (d["batch"], d["tokens_per_s"]))
        out["tokens_per_s_full_batch"] = round(full["tokens_per_s"], 2)
        out["full_batch"] = full["batch"]
    if speculative:
        out["speculative"] = [_break_even(s, decode) for s in speculative]
    out.update(
        {
            "kv_bytes_per_sequence": per_sequence,
            "kv_bytes": kv_total,
            "sequences_compiled": sequences,
            "sequences_fit": max(0, room // per_sequence) if per_sequence else None,
        }
    )
    if prefill:
        seq, name, latency_s, context = max(prefill, key=lambda p: (p[0], -p[2]))
        out["prefill_length"] = seq
        out["prefill_specialization"] = name
        out["time_to_first_token_ms"] = round(latency_s * 1e3, 3)
        chunks = [
            {
                "prompt_length": runs * seq,
                "runs": runs,
                "time_to_first_token_ms": round(runs * latency_s * 1e3, 3),
            }
            for runs in (2**i for i in range(1, CHUNKED_ENTRIES + 1))
            if context is not None and runs * seq <= context
        ]
        if chunks:
            out["chunked_prefill"] = chunks
    return out


def _break_even(spec: dict[str, Any], decode: list[dict[str, Any]]) -> dict[str, Any]:
    """The accepted drafts per step at which a speculative step of this batch produces tokens
    as fast as the plain decode of the same batch: (step time / token time) - 1."""
    plain = next((d for d in decode if d["batch"] == spec["batch"]), None)
    if plain is None:
        return spec
    ratio = spec["time_per_step_ms"] / plain["time_per_output_token_ms"]
    return {**spec, "accepted_drafts_to_break_even": round(max(0.0, ratio - 1), 3)}
