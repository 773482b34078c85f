"""Our C++ CPU kernels against the torch path they replace, side by side in one process.

    python -m bench.cpu_kernels attention [--dtypes bf16 fp32 --batches 1 16 64 --contexts 256 512 1024]
    python -m bench.cpu_kernels scatter [--batch 64 --context 400 --block-sizes 16 64 --adjacency 1 0.81 0.6 0]
    python -m bench.cpu_kernels verify [--batch 64 --context 400 --drafts 0 1 2 4 8]
    python -m bench.cpu_kernels prefill [--dtypes bf16 fp32 --chunks 256/256 2000/2000 32/300]
    python -m bench.cpu_kernels sampling [--batches 16 64 --vocab 49152]
    python -m bench.cpu_kernels linear [--rows 1 2 4 8 16 64]
    python -m bench.cpu_kernels layers --model /tmp/smollm2-hf [--batches 1 2 16 64 --dtype bf16]
    python -m bench.cpu_kernels engine --model /tmp/smollm2-hf [--concurrency 16 64 --dtype bf16]

`attention`: one layer's paged decode attention at SmolLM2-135M's shapes (9 / 3 heads, head_dim
64, blocks of 16 scattered over a pool), the C++ op (its vector kernel, and its scalar one: what
a CPU without the vector path runs) vs gather + SDPA, alternating calls, medians.
`scatter`: a decode step's paged attention over 30 layers, each with its own cache (so it reads
from memory, not from the last level cache, as a step does), by how often a sequence's next
block follows its last one in memory (adjacency 1: every table ascending; 0: blocks
anywhere), caches in plain pages and in huge pages (`daemon.models.huge_pages`, the
engine's), alternating, medians.
`verify`: the same step where each sequence verifies k drafts (1 + k rows, one a position,
as the runner lays them out): the rows of a request side by side, which the op reads as one
span (each chunk of K/V from memory once), against the same rows interleaved across requests
(every row reads its context itself, as the op did before spans), alternating, medians.
`prefill`: one layer's causal prefill attention of a chunk of n tokens at the end of ctx
(`n/ctx`), the C++ op vs `chunk_attention` (SDPA's flash kernel, as the engine called it
before), GFLOP/s.
`sampling`: `sample` on [B, vocab] logits with the C++ sampler vs the torch path, alternating;
greedy: the C++ `greedy_rows` vs torch's `max`.
`linear`: the linears of a decode step at SmolLM2-135M's shapes (30 layers' q/k/v, o, gate/up
and down, and the tied head; each its own weight, so they are read from memory) on M rows:
`small_linear` (weights in place, up to 8 rows) vs oneDNN's GEMM on the bf16 weights packed,
oneDNN's fp32 GEMM on them widened (bf16 rows in and out: the plan on CPUs without bf16
arithmetic) and MKL's fp32 `F.linear`, alternating, medians; GB/s of bf16 weights read.
`layers`: a decode step's 30 layers and final norm (the tokens embedded, the logits not) of a
real model at B sequences (contexts of ~300 tokens in blocks of their own), through the fused
op (`FusedDecode`, one C++ call) vs the compiled decode layer (30 calls of inductor's graph),
alternating, medians; with how far each path's hidden states are from the model's eager
layers' (the largest difference over the largest value) and how often their greedy tokens
agree with eager's. Both round bf16 where eager does (the compiled graphs since inductor's
`emulate_precision_casts`; before it, the compiled layer drifted: see
bench/results/2026-12-07-fused-decode.md).
`engine`: decode tok/s of one engine with the kernel on and off (DEEPINFER_CPU_KERNELS=0's
path), alternating runs of the same seeded workload; decode tok/s counts the tokens produced
after the last request's first token, over that window.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import statistics

import torch

from bench.common import STAT, Request, machine, make_workload, median_us, quiet_logs, run_ours
from daemon.models import huge_pages
from kernels import paged_attention_cpu
from kernels.paged_attention_cpu import context_mask, paged_decode_attention, paged_decode_reference

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HQ, HKV, DIM = 9, 3, 64  # SmolLM2-135M's attention heads


def header(what: str, args: argparse.Namespace) -> None:
    print(
        f"{what}, one layer, {HQ}/{HKV} heads, head_dim {DIM}, "
        f"{args.stat} of {args.reps}, {machine()}"
    )


def attention(args: argparse.Namespace) -> None:
    paged_attention_cpu.build()
    hq, hkv, dim, bs = HQ, HKV, DIM, 16
    header("paged decode attention", args)
    print("dtype  batch  ctx   op µs (auto)  op µs (1 piece)  scalar µs  gather+SDPA µs  speed-up")
    for name in args.dtypes:
        dtype = DTYPES[name]
        for b in args.batches:
            for ctx in args.contexts:
                blocks = -(-ctx // bs)
                pool = max(b * blocks, 4096)  # a pool larger than the caches hold
                g = torch.Generator().manual_seed(b * ctx)
                kc = torch.randn(pool * bs, hkv, dim, generator=g).to(dtype)
                vc = torch.randn(pool * bs, hkv, dim, generator=g).to(dtype)
                q = torch.randn(b, hq, dim, generator=g).to(dtype)
                lens = torch.full((b,), ctx)
                tables = torch.randperm(pool, generator=g)[: b * blocks].view(b, blocks)
                mask = context_mask(lens, blocks * bs)

                def op(
                    splits: int, generic: bool = False, q=q, kc=kc, vc=vc, tables=tables, lens=lens
                ) -> object:
                    return paged_decode_attention(
                        q, kc, vc, tables, lens, dim**-0.5, bs, splits=splits, generic=generic
                    )

                def ref(q=q, kc=kc, vc=vc, tables=tables, mask=mask) -> object:
                    return paged_decode_reference(q, kc, vc, tables, mask, dim**-0.5, bs)

                fns = {
                    "op": lambda: op(0),
                    "op1": lambda: op(1),
                    "scalar": lambda: op(0, generic=True),
                    "ref": ref,
                }
                t = median_us(fns, args.reps, args.stat)
                print(
                    f"{name:5s} {b:6d} {ctx:5d} {t['op']:13.1f} {t['op1']:16.1f} "
                    f"{t['scalar']:10.1f} {t['ref']:15.1f} {t['ref'] / t['op']:8.2f}x",
                    flush=True,
                )


def scatter_tables(batch: int, blocks: int, pool: int, adjacency: float, seed: int) -> torch.Tensor:
    """[batch, blocks] block ids, all distinct, in a pool of `pool`: each sequence's next block
    follows its last one in memory with probability `adjacency` (when that one is unused),
    else comes from anywhere in the pool."""
    rng = random.Random(seed)
    order = list(range(pool))
    rng.shuffle(order)
    used: set[int] = set()
    rows = []
    for _ in range(batch):
        row: list[int] = []
        for i in range(blocks):
            nxt = row[-1] + 1 if row else -1
            if i and rng.random() < adjacency and nxt < pool and nxt not in used:
                block = nxt
            else:
                block = order.pop()
                while block in used:
                    block = order.pop()
            used.add(block)
            row.append(block)
        rows.append(row)
    return torch.tensor(rows)


def own_caches(
    content: torch.Tensor, layers: int, huge: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`layers` (K, V) pairs, each its own copy of `content` (so a step over them reads from
    memory, as a real one does, not from the last level cache); `huge`: in huge pages, as
    the engine's (`daemon.models.huge_pages`)."""

    def copy() -> torch.Tensor:
        if huge:
            return huge_pages.zeros(tuple(content.shape), content.dtype).copy_(content)
        return content.clone()

    return [(copy(), copy()) for _ in range(layers)]


def attend_layers(
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
) -> None:
    """One decode step's paged attention: the same rows over every layer's cache."""
    for k, v in caches:
        paged_decode_attention(q, k, v, tables, lens, q.shape[-1] ** -0.5, block_size)


def scatter(args: argparse.Namespace) -> None:
    paged_attention_cpu.build()
    hq, hkv, dim, layers, dtype = HQ, HKV, DIM, args.layers, DTYPES[args.dtype]
    print(
        f"paged decode attention over {layers} layers' own caches, {args.dtype}, batch "
        f"{args.batch}, {args.context} positions, {hq}/{hkv} heads, head_dim {dim}, "
        f"median ms a step of {args.reps}, {machine()}"
    )
    print("block size  adjacency  plain pages ms  huge pages ms  plain ÷ huge")
    for bs in args.block_sizes:
        blocks = -(-args.context // bs)
        pool = 2 * args.batch * blocks  # room for tables to spread
        shape = (pool * bs, hkv, dim)
        g = torch.Generator().manual_seed(bs)
        content = torch.randn(shape, generator=g).to(dtype)
        caches = {kind: own_caches(content, layers, kind == "huge") for kind in ("plain", "huge")}
        del content
        q = torch.randn(args.batch, hq, dim, generator=g).to(dtype)
        lens = torch.full((args.batch,), args.context)
        for adj in args.adjacency:
            tables = scatter_tables(args.batch, blocks, pool, adj, seed=bs)
            steps = {
                kind: functools.partial(attend_layers, layers_, q, tables, lens, bs)
                for kind, layers_ in caches.items()
            }
            t = median_us(steps, args.reps)
            print(
                f"{bs:10d} {adj:10.2f} {t['plain'] / 1e3:15.2f} {t['huge'] / 1e3:14.2f} "
                f"{t['plain'] / t['huge']:12.2f}x",
                flush=True,
            )


def verify(args: argparse.Namespace) -> None:
    paged_attention_cpu.build()
    hq, hkv, dim, layers, dtype, bs = HQ, HKV, DIM, args.layers, DTYPES[args.dtype], 16
    print(
        f"paged decode attention with verify rows over {layers} layers' own caches (huge "
        f"pages), {args.dtype}, {args.batch} sequences at {args.context} positions, tables at "
        f"adjacency {args.adjacency}, median ms a step of {args.reps}, {machine()}"
    )
    print("drafts  rows  spans ms  interleaved ms  interleaved ÷ spans  ms a row (spans)")
    blocks = -(-(args.context + max(args.drafts)) // bs)
    pool = 2 * args.batch * blocks
    shape = (pool * bs, hkv, dim)
    g = torch.Generator().manual_seed(0)
    content = torch.randn(shape, generator=g).to(dtype)
    caches = own_caches(content, layers, huge=True)
    del content
    tables = scatter_tables(args.batch, blocks, pool, args.adjacency, seed=0)
    for k in args.drafts:
        rows = k + 1
        # row (b, j): sequence b's position context + j
        by_request = torch.arange(args.batch).repeat_interleave(rows)
        lens = torch.arange(rows).repeat(args.batch) + args.context - k
        interleave = torch.arange(args.batch * rows).view(args.batch, rows).t().flatten()
        q = torch.randn(args.batch * rows, hq, dim, generator=g).to(dtype)
        layouts = {
            "spans": (q, tables[by_request], lens),
            "interleaved": (q[interleave], tables[by_request[interleave]], lens[interleave]),
        }
        steps = {
            kind: functools.partial(attend_layers, caches, *rows_, bs)
            for kind, rows_ in layouts.items()
        }
        t = median_us(steps, args.reps)
        print(
            f"{k:6d} {args.batch * rows:5d} {t['spans'] / 1e3:9.2f} {t['interleaved'] / 1e3:15.2f} "
            f"{t['interleaved'] / t['spans']:19.2f}x {t['spans'] / 1e3 / (args.batch * rows):17.3f}",
            flush=True,
        )


def prefill(args: argparse.Namespace) -> None:
    from daemon.models.attention import chunk_attention
    from kernels.prefill_attention_cpu import prefill_attention, supports

    hq, hkv, dim = HQ, HKV, DIM
    header("prefill attention", args)
    print("dtype  n/ctx        op ms  GFLOP/s   SDPA ms  GFLOP/s  speed-up")
    for name in args.dtypes:
        dtype = DTYPES[name]
        for chunk in args.chunks:
            n, ctx = (int(x) for x in chunk.split("/"))
            g = torch.Generator().manual_seed(n + ctx)
            q = torch.randn(n, hq, dim, generator=g).to(dtype)
            k, v = torch.randn(2, ctx, hkv, dim, generator=g).to(dtype).unbind(0)
            out = torch.empty_like(q)
            if not supports(q, k, v, out):
                raise SystemExit("the C++ prefill attention does not serve this CPU")
            qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))
            mask = (
                None
                if n == ctx
                else torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
            )

            def sdpa(qh=qh, kh=kh, vh=vh, mask=mask) -> object:  # the path the op replaced
                return chunk_attention(qh, kh, vh, mask, dim**-0.5)

            def op(q=q, k=k, v=v, out=out) -> object:
                return prefill_attention(q, k, v, dim**-0.5, out)

            t = median_us({"op": op, "sdpa": sdpa}, args.reps, args.stat)
            flop = 4 * hq * dim * (n * (ctx - n) + n * (n + 1) / 2)
            print(
                f"{name:5s} {chunk:>10s} {t['op'] / 1e3:8.3f} {flop / t['op'] / 1e3:8.0f}"
                f" {t['sdpa'] / 1e3:9.3f} {flop / t['sdpa'] / 1e3:8.0f} {t['sdpa'] / t['op']:8.2f}x",
                flush=True,
            )


def sampling(args: argparse.Namespace) -> None:
    from daemon.loop.request import SamplingParams
    from daemon.loop.sampler import SamplingBatch, sample
    from kernels import sampling_cpu

    print(
        f"sample(), vocab {args.vocab}, C++ sampler vs torch path, {args.stat} of {args.reps}, "
        f"{machine()}"
    )
    print("batch  params                       kernel ms   torch ms  speed-up")
    cases = {
        "temperature 0.8": SamplingParams(temperature=0.8),
        "top_k 50": SamplingParams(temperature=0.8, top_k=50),
        "top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
        "top_k 40, top_p 0.95": SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
    }
    for b in args.batches:
        g = torch.Generator().manual_seed(b)
        logits = 3 * torch.randn(b, args.vocab, generator=g)
        greedy = {
            "kernel": lambda logits=logits: sampling_cpu.greedy_rows(logits),
            "torch": lambda logits=logits: logits.max(dim=-1).indices,
        }
        t = median_us(greedy, args.reps, args.stat)
        print(
            f"{b:5d}  {'greedy':26s} {t['kernel'] / 1e3:10.2f} {t['torch'] / 1e3:10.2f} "
            f"{t['torch'] / t['kernel']:8.2f}x",
            flush=True,
        )
        for name, params in cases.items():
            sb = SamplingBatch.build([params] * b, [0] * b, args.vocab)

            def run(on: bool, sb=sb, logits=logits, g=g) -> object:
                sampling_cpu.ENABLED = on
                return sample(logits, sb, g)

            fns = {"kernel": lambda: run(True), "torch": lambda: run(False)}
            t = median_us(fns, args.reps, args.stat)
            print(
                f"{b:5d}  {name:26s} {t['kernel'] / 1e3:10.2f} {t['torch'] / 1e3:10.2f} "
                f"{t['torch'] / t['kernel']:8.2f}x",
                flush=True,
            )
        sampling_cpu.ENABLED = True


def linear(args: argparse.Namespace) -> None:
    from kernels import cpu_build, packed_linear, small_linear

    cpu_build.load()
    bf16 = torch.bfloat16
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    weights = [torch.randn(shape, dtype=bf16) * 0.05 for shape in shapes]
    rows = packed_linear.PACK_ROWS
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    wide = [w.float() for w in weights]
    widened = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in wide]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    print(
        f"the linears of a decode step at SmolLM2-135M's shapes ({len(weights)} weights, "
        f"{nbytes / 1e6:.0f} MB in bf16), median of {args.reps}, {machine()}: small_linear "
        "(bf16, dpbf16 or fp32 FMAs), oneDNN packed bf16, oneDNN packed on the weights widened "
        "to fp32 (bf16 rows widened, the output rounded: the plan where the CPU has no bf16 "
        "arithmetic), MKL's fp32 F.linear"
    )
    print(
        "rows  small_linear ms   GB/s   oneDNN bf16 ms   widened ms   fp32 MKL ms  best other ÷ ours"
    )
    for m in args.rows:
        xs = {k: torch.randn(m, k, dtype=bf16) for k in (576, 1536)}
        x32 = {k: v.float() for k, v in xs.items()}

        def ours(xs=xs) -> object:
            return [small_linear.small_linear(xs[w.shape[1]], w) for w in weights]

        def onednn(xs=xs) -> object:
            return [
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(weights, packed, strict=True)
            ]

        def widen(xs=xs) -> object:
            return [
                torch.ops.mkldnn._linear_pointwise(
                    xs[w.shape[1]].float(), p, None, "none", [], ""
                ).to(bf16)
                for w, p in zip(weights, widened, strict=True)
            ]

        def mkl(x32=x32) -> object:
            return [torch.nn.functional.linear(x32[w.shape[1]], w) for w in wide]

        fns = {"ours": ours, "onednn": onednn, "widened": widen, "mkl": mkl}
        if m > small_linear.MAX_ROWS:
            del fns["ours"]
        ms = {k: v / 1e3 for k, v in median_us(fns, args.reps).items()}
        other = min(ms["onednn"], ms["widened"], ms["mkl"])
        mine = ms.get("ours")
        cell = f"{mine:15.2f} {nbytes / mine / 1e6:6.1f}" if mine else f"{'-':>15s} {'-':>6s}"
        ratio = f"{other / mine:10.2f}x" if mine else f"{'-':>11s}"
        print(
            f"{m:4d}  {cell} {ms['onednn']:16.2f} {ms['widened']:12.2f} {ms['mkl']:13.2f} {ratio}",
            flush=True,
        )


def decode_tok_s(run) -> float:
    """Tokens produced after every request had its first token, per second of that window."""
    start = max(t.token_times[0] for t in run.timings)
    end = max(t.token_times[-1] for t in run.timings)
    tokens = sum(sum(1 for x in t.token_times if x > start) for t in run.timings)
    return tokens / (end - start)


def layers(args: argparse.Namespace) -> None:
    from daemon.build.config import EngineConfig
    from daemon.build.engine import build_engine
    from daemon.models.attention import build_attention_batch
    from daemon.models.compiled import CompiledDecode

    cfg = EngineConfig(
        model=args.model,
        dtype={"bf16": "bfloat16", "fp32": "float32"}[args.dtype],
        kv_cache_memory_gb=args.kv_cache_gb,
        max_num_seqs=max(args.batches),
    )
    engine, _ = build_engine(cfg)
    runner = engine.runner
    fused, model, cache = runner.graphs, runner.model, runner.cache
    if not isinstance(fused, CompiledDecode) or fused.fused is None:
        raise SystemExit("the fused decode op does not serve this model here")
    compiled = CompiledDecode(model, cache, max(args.batches))  # the compiled layer's path
    compiled.warm_up()
    print(
        f"a decode step's {model.num_layers} layers, {args.model}, {args.dtype}, fused op vs "
        f"compiled layer, median of {args.reps}, {machine()}"
    )
    print(
        "batch  fused ms  compiled ms  speed-up  from eager: fused compiled  same token: fused compiled"
    )
    bs = cache.block_size
    gen = torch.Generator().manual_seed(0)
    for b in args.batches:
        contexts = [args.context + 3 * i for i in range(b)]
        per = -(-max(contexts) // bs)
        tables = [[i * per + j for j in range(-(-n // bs))] for i, n in enumerate(contexts)]
        slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, contexts)]
        batch = build_attention_batch(list(zip(tables, contexts)), [], slots, bs)
        ids = torch.randint(0, model.vocab_size, (b,), generator=gen)
        positions = torch.tensor([n - 1 for n in contexts])

        def run(path: CompiledDecode, ids=ids, positions=positions, batch=batch) -> object:
            with torch.inference_mode():
                return path.run(ids, positions, batch)

        with torch.inference_mode():
            ref = model(ids, positions, batch, cache)
            greedy = model.compute_logits(ref).argmax(-1)
        far, same = {}, {}
        for name, path in (("fused", fused), ("compiled", compiled)):
            out = run(path)
            far[name] = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            with torch.inference_mode():
                tokens = model.compute_logits(out).argmax(-1)
            same[name] = (tokens == greedy).float().mean().item()
        t = median_us({"fused": lambda: run(fused), "compiled": lambda: run(compiled)}, args.reps)
        print(
            f"{b:5d}  {t['fused'] / 1e3:8.2f}  {t['compiled'] / 1e3:11.2f}  "
            f"{t['compiled'] / t['fused']:7.2f}x  {far['fused']:17.2g} {far['compiled']:8.2g}  "
            f"{same['fused']:17.0%} {same['compiled']:8.0%}",
            flush=True,
        )


async def engine_runs(args: argparse.Namespace) -> None:
    from daemon.build.config import EngineConfig
    from daemon.build.engine import build_engine

    print(f"engine decode tok/s, {args.model}, {args.dtype}, kernel on / off, {machine()}")
    for conc in args.concurrency:
        cfg = EngineConfig(
            model=args.model,
            dtype={"bf16": "bfloat16", "fp32": "float32"}[args.dtype],
            kv_cache_memory_gb=args.kv_cache_gb,
            max_num_seqs=conc,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        engine, _ = build_engine(cfg)
        await engine.start()
        vocab = 49152
        workload = make_workload(conc, (args.prompt_len,) * 2, (args.output_len,) * 2, vocab, 0)
        # warm-up on the workload's own shapes (prefill chunks, batch), untimed: the first run
        # pays the GEMM primitives' set-up, and it would fall on the kernel-on side
        await run_ours(engine, [Request(r.prompt, r.max_tokens) for r in workload])
        rates: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(args.repeats):
            for on in (True, False) if rep % 2 == 0 else (False, True):
                paged_attention_cpu.ENABLED = on
                run = await run_ours(engine, [Request(r.prompt, r.max_tokens) for r in workload])
                rates[on].append(decode_tok_s(run))
                print(
                    f"  concurrency {conc} repeat {rep + 1} kernel {'on ' if on else 'off'}: "
                    f"decode {rates[on][-1]:7.1f} tok/s, all {run.tok_s:7.1f} tok/s",
                    flush=True,
                )
        paged_attention_cpu.ENABLED = True
        await engine.stop()
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        print(
            f"concurrency {conc}: decode tok/s kernel on {on:.1f}, off {off:.1f}: "
            f"{on / off:.2f}x (medians of {args.repeats})",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    a = sub.add_parser("attention")
    a.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    a.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    a.add_argument("--contexts", nargs="+", type=int, default=[256, 512, 1024])
    a.add_argument("--reps", type=int, default=15)
    a.add_argument("--stat", choices=list(STAT), default="median")
    sc = sub.add_parser("scatter")
    sc.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    sc.add_argument("--batch", type=int, default=64)
    sc.add_argument("--context", type=int, default=400)
    sc.add_argument("--layers", type=int, default=30)
    sc.add_argument("--block-sizes", nargs="+", type=int, default=[16, 64])
    sc.add_argument("--adjacency", nargs="+", type=float, default=[1.0, 0.95, 0.81, 0.6, 0.0])
    sc.add_argument("--reps", type=int, default=9)
    vf = sub.add_parser("verify")
    vf.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    vf.add_argument("--batch", type=int, default=64)
    vf.add_argument("--context", type=int, default=400)
    vf.add_argument("--layers", type=int, default=30)
    vf.add_argument("--adjacency", type=float, default=0.81)
    vf.add_argument("--drafts", nargs="+", type=int, default=[0, 1, 2, 4, 8])
    vf.add_argument("--reps", type=int, default=9)
    pf = sub.add_parser("prefill")
    pf.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    pf.add_argument("--chunks", nargs="+", default=["256/256", "2000/2000", "32/300", "256/1024"])
    pf.add_argument("--reps", type=int, default=11)
    pf.add_argument("--stat", choices=list(STAT), default="median")
    s = sub.add_parser("sampling")
    s.add_argument("--batches", nargs="+", type=int, default=[16, 64])
    s.add_argument("--vocab", type=int, default=49152)
    s.add_argument("--reps", type=int, default=9)
    s.add_argument("--stat", choices=list(STAT), default="median")
    li = sub.add_parser("linear")
    li.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 64])
    li.add_argument("--reps", type=int, default=9)
    ly = sub.add_parser("layers")
    ly.add_argument("--model", default="/tmp/smollm2-hf")
    ly.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ly.add_argument("--batches", nargs="+", type=int, default=[1, 2, 16, 64])
    ly.add_argument("--context", type=int, default=300)
    ly.add_argument("--kv-cache-gb", type=float, default=2.0)
    ly.add_argument("--reps", type=int, default=15)
    e = sub.add_parser("engine")
    e.add_argument("--model", default="/tmp/smollm2-hf")
    e.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    e.add_argument("--concurrency", nargs="+", type=int, default=[16, 64])
    e.add_argument("--prompt-len", type=int, default=384)
    e.add_argument("--output-len", type=int, default=64)
    e.add_argument("--repeats", type=int, default=2)
    e.add_argument("--kv-cache-gb", type=float, default=2.0)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    quiet_logs()
    if args.what == "attention":
        attention(args)
    elif args.what == "scatter":
        scatter(args)
    elif args.what == "verify":
        verify(args)
    elif args.what == "prefill":
        prefill(args)
    elif args.what == "sampling":
        sampling(args)
    elif args.what == "linear":
        linear(args)
    elif args.what == "layers":
        layers(args)
    else:
        asyncio.run(engine_runs(args))


if __name__ == "__main__":
    main()
