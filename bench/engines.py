"""Native engine vs vLLM on the same generation job: tokens/s, time to the first finished group, time
to the last, and the time a weight update takes in each.

One process (a 1-rank gloo world, as a generator rank has), the engines' real entry points: the
generator's `engine.generate(requests, params, step=...)` streaming finished groups, and
`engine.load_weights(shards, specs)` after a push. Models: the embedded tiny Qwen3 (~1M) and a
random-init Qwen3 of ~100M parameters saved as an HF directory. Prompts are B prompts of P tokens;
random-init models rarely sample EOS, so nearly every sample runs to `max_new_tokens`. Each figure
is the median of REPEATS timed calls after one warm-up call; the ratio is vLLM / native, from the
same run. Run in the vLLM venv (it has both engines):

    .venv-vllm/bin/python bench/engines.py [--models tiny,100M] [--threads 2]

`--vs-hf DIR[,DIR]`: the native engine against HF `generate` (the loop TRL samples with) on real HF
model directories, in the main venv: tokens/s at each rows x threads, every row its own prompt (no
shared-prompt prefill, which only the native engine has), both writing exactly --tokens tokens a row
(EOS ignored) with plain sampling (temperature 1, no top-p/top-k); median of --repeats calls after a
warm-up, the ratio native / HF from the same run:

    .venv/bin/python bench/engines.py --vs-hf ../real/smollm2-135m-hf,../real/qwen2.5-coder-0.5b-hf
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [_ROOT] + [p for p in sys.path if Path(p or ".").resolve() != Path(_ROOT, "bench")
                         and p != _ROOT]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from tabulate import tabulate  # noqa: E402

from tidal.executors.generator.vllm_engine import VllmConfig  # noqa: E402
from tidal.executors.generator.contract import PromptRequest, SamplingParams  # noqa: E402
from tidal.executors.generator.native_engine import NativeEngine  # noqa: E402
from tidal.executors.generator.vllm_engine import VllmEngine, receive_buffers  # noqa: E402
from tidal.modeling.hf import load_model, load_tokenizer, save_hf  # noqa: E402
from tidal.common.spawn import free_port  # noqa: E402

REPEATS = 3
# name -> (B prompts, G samples, prompt tokens, new tokens, model config or None = embedded)
JOBS = {
    "tiny": (8, 16, 24, 32, None),
    "100M": (8, 8, 64, 32, dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                num_key_value_heads=4, head_dim=64, intermediate_size=2048, vocab_size=32768)),
}


def model_dir(name: str, tmp: str) -> str:
    cfg = JOBS[name][4]
    tok = load_tokenizer(None)
    if cfg is None:
        model = load_model(None, seed=0)
    else:
        config = transformers.Qwen3Config(**cfg, max_position_embeddings=1024, tie_word_embeddings=True,
                                          eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                                          pad_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    save_hf(model, tok, tmp)
    return tmp


def timed(engine, requests, params) -> dict:
    t0 = time.perf_counter()
    first, tokens = None, 0
    for g in engine.generate(requests, params, step=0):
        first = first or time.perf_counter() - t0
        tokens += sum(r.numel() for r in g.response_ids)
    last = time.perf_counter() - t0
    return {"tokens_per_s": tokens / last, "first_group_s": first, "last_group_s": last}


def bench(name: str) -> list[dict]:
    B, G, P, T, _ = JOBS[name]
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(name, tmp)
        vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
        gen = torch.Generator().manual_seed(1)
        requests = [PromptRequest(index=i, prompt_ids=torch.randint(1, vocab, (P,), generator=gen)) for i in range(B)]
        params = SamplingParams(n=G, max_new_tokens=T, seed=0, temperature=1.0)
        tok = load_tokenizer(None)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
        native = NativeEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        specs, shards = receive_buffers(path, dtype=torch.float32, tp=1, tp_rank=0, device=torch.device("cpu"))
        for n, p in model.named_parameters():
            shards[n].copy_(p.detach())
        t0 = time.perf_counter()
        vllm = VllmEngine(model_dir=path, ranks=(0,), tp=1, tp_rank=0, dtype="float32", eos_token_id=tok.eos_token_id,
                          max_model_len=P + T, config=VllmConfig(), seed=0, device_type="cpu")
        vllm_init = time.perf_counter() - t0
        rows = {"native": [], "vllm": []}
        for engine_name, engine in (("native", native), ("vllm", vllm)):
            timed(engine, requests, params)  # warm-up
        for _ in range(REPEATS):  # interleaved, so load on the machine hits both alike
            for engine_name, engine in (("native", native), ("vllm", vllm)):
                r = timed(engine, requests, params)
                t0 = time.perf_counter()
                engine.load_weights(shards, specs)
                r["load_weights_s"] = time.perf_counter() - t0
                rows[engine_name].append(r)
        vllm.close()
    med = {e: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for e, rs in rows.items()}
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    out = []
    for key in ("tokens_per_s", "first_group_s", "last_group_s", "load_weights_s"):
        out.append({"model": f"{name} ({params_m:.0f}M)", "job": f"B={B} G={G} P={P} T={T}", "figure": key,
                    "native": med["native"][key], "vllm": med["vllm"][key],
                    # the native engine's load is a no-op (the push lands in its parameters): no ratio
                    "vllm / native": med["vllm"][key] / med["native"][key] if key != "load_weights_s" else None})
    out.append({"model": f"{name} ({params_m:.0f}M)", "job": "", "figure": "vllm engine init_s",
                "native": None, "vllm": vllm_init, "vllm / native": None})
    return out


def vs_hf(model_dir: str, *, rows: list[int], threads: list[int], tokens: int, repeats: int) -> list[dict]:
    """Native engine vs HF generate on one model: tokens/s at each (threads, rows)."""
    model = load_model(model_dir, dtype=torch.float32)
    tok = load_tokenizer(model_dir)
    vocab = model.config.vocab_size
    texts = [f"def f{i}(x):\n    # return x plus {i}, then print it\n" for i in range(max(rows))]
    ids = [tok(t)["input_ids"] for t in texts]
    # EOS never matches: every row writes `tokens` tokens, as min_new_tokens makes HF do
    native = NativeEngine(model, eos_token_id=vocab + 1, pad_token_id=tok.pad_token_id or 0, max_batch_prompts=max(rows))
    out = []
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for n_rows in rows:
            requests = [PromptRequest(index=i, prompt_ids=ids[i]) for i in range(n_rows)]
            params = SamplingParams(n=1, max_new_tokens=tokens, seed=0, temperature=1.0)

            def run_native():
                for _ in native.generate(requests, params, step=0):
                    pass

            tok.padding_side = "left"
            batch = tok(texts[:n_rows], return_tensors="pt", padding=True)

            @torch.inference_mode()
            def run_hf():
                model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_new_tokens=tokens,
                               max_new_tokens=tokens, pad_token_id=tok.pad_token_id or 0)

            med = {}
            for name, fn in (("native", run_native), ("hf", run_hf)):
                fn()  # warm-up
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                med[name] = n_rows * tokens / statistics.median(times)
            out.append({"model": Path(model_dir).name, "threads": n_threads, "rows": n_rows,
                        "native tok/s": med["native"], "HF generate tok/s": med["hf"],
                        "native / HF": med["native"] / med["hf"]})
            print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,100M")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vs-hf", default=None, help="HF model directories (comma-separated): native vs HF generate")
    ap.add_argument("--rows", default="1,8,64", help="with --vs-hf")
    ap.add_argument("--thread-counts", default="1,2", help="with --vs-hf")
    ap.add_argument("--tokens", type=int, default=32, help="with --vs-hf: tokens written a row")
    ap.add_argument("--repeats", type=int, default=3, help="with --vs-hf")
    args = ap.parse_args()
    if args.vs_hf:
        table = []
        for model_dir in args.vs_hf.split(","):
            table += vs_hf(model_dir, rows=[int(r) for r in args.rows.split(",")],
                           threads=[int(t) for t in args.thread_counts.split(",")], tokens=args.tokens,
                           repeats=args.repeats)
        print(tabulate(table, headers="keys", floatfmt=".4g"))
        return
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rows = []
    for name in args.models.split(","):
        rows += bench(name)
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
