"""Plain decoding of four workload prompts (64 tokens, T = 0) one after another and then at once on one
parallel=4 engine, with and without repacked weights: are the answers at once their serial ones?

    python scripts/parallel_equal.py MODEL.gguf

Measured here on Qwen2.5-Coder-1.5B Q4_K_M: repack 3/4 equal (one parted at token 5), --no-repack 4/4.
"""
import sys
import threading
from edgespec.backend import LlamaBackend
from edgespec.engine import Engine
from edgespec.bench.workloads import default_workloads, load_workloads
path = sys.argv[1]
prompts = [it["prompt"] for it in load_workloads(str(default_workloads()), limit=1)][:4]
for repack in (False, True):
    eng = Engine(LlamaBackend(path, n_ctx=1024, n_seq=4, flash_attn="auto", repack=repack))
    serial = []
    for p in prompts:
        eng.reset()
        serial.append(eng.chat([{"role": "user", "content": p}], max_tokens=64).tokens)
    eng.reset()
    got = [None] * 4
    def work(i):
        got[i] = eng.chat([{"role": "user", "content": prompts[i]}], max_tokens=64).tokens
    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    same = [a == b for a, b in zip(serial, got)]
    first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(serial, got)]
    print("repack", repack, "equal", same, "first divergence", first)
    eng.close()
