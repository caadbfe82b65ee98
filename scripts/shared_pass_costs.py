"""What a pass costs by its layout: one sequence's rows, several sequences' rows, and the
micro-batches llama.cpp cuts a pass into when each sequence has a KV stream of its own.

    python scripts/shared_pass_costs.py MODEL.gguf [--depth N] [--no-repack] [--flash-attn on|off|auto]

Prints each layout's median time over --trials passes as a multiple of one sequence's one-row pass
(T1), so that the figures the policy decides on (costs.Costs.split_cost) can be set beside what the
device does. Layouts are (sequence, tokens fed) with a row of logits on every token.
Measured on this project's 2-core AMD EPYC (Qwen2.5-Coder-1.5B Q4_K_M, 2 threads, depth ~300):
T1 39-45 ms; one sequence 2 / 4 rows 1.58-1.98 / 3.03-3.7; two sequences x 1 row 1.92-2.3; four
x 1 row 3.15-3.88 (batching four requests can gain at most ~1.1x here); sequence 0 with three drafts
beside three plain sequences 5.73-6.74 (two computations: T(4) + T(3)).
"""
import argparse
import statistics
import time

from edgespec.backend import LlamaBackend

LAYOUTS = {
    "1 seq x 2 rows": [(0, 2)],
    "1 seq x 3 rows": [(0, 3)],
    "1 seq x 4 rows": [(0, 4)],
    "1 seq x 8 rows": [(0, 8)],
    "1 seq x 16 rows": [(0, 16)],
    "2 seqs x 1 row": [(0, 1), (1, 1)],
    "seqs 0 and 2 x 1 row": [(0, 1), (2, 1)],
    "3 seqs x 1 row": [(0, 1), (1, 1), (2, 1)],
    "4 seqs x 1 row": [(s, 1) for s in range(4)],
    "4 seqs x 2 rows": [(s, 2) for s in range(4)],
    "seq 0 x 4 rows, 3 seqs x 1": [(0, 4), (1, 1), (2, 1), (3, 1)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--depth", type=int, default=300, help="tokens each sequence holds before the passes")
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--flash-attn", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    b = LlamaBackend(a.model, n_ctx=4 * max(1024, 2 * a.depth), n_seq=4, threads=a.threads,
                     flash_attn=a.flash_attn, repack=not a.no_repack)
    filler = b.tokenize("The keeper climbed the stairs of the lighthouse every night to light the lamp. " * 64)
    prompt = filler[:a.depth]
    for s in range(4):
        b.eval_batch([(s, prompt, [len(prompt) - 1])])
    tok = prompt[-1]

    def median_ms(layout) -> float:
        times = []
        for _ in range(a.trials):
            parts = [(s, [tok] * n, list(range(n))) for s, n in layout]
            t = time.perf_counter()
            b.eval_batch(parts)
            times.append(time.perf_counter() - t)
            for s, n in layout:
                b.truncate(len(prompt), s)
        return 1000 * statistics.median(times)

    t1 = median_ms([(0, 1)])
    print(f"T1 (1 seq x 1 row): {t1:.1f} ms, threads {b.threads}, depth {a.depth}")
    for name, layout in LAYOUTS.items():
        print(f"{name:<28} {median_ms(layout) / t1:5.2f} T1")
    b.close()


if __name__ == "__main__":
    main()
