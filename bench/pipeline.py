"""Pipeline parallel (trainer.pp, megatron backend): step time, train time and bubble at pp = 1, 2, 4,
and the 1F1B-across-groups schedule (trainer.pp_drain=step, the default) against a fill-and-drain per
group (pp_drain=group), in one invocation.

The model is a random-init Qwen3 over the embedded tokenizer, 8 layers (--layers) of hidden 256, so
pp=4 holds 2 layers a stage. Each config is a whole job (generator, reward, trainer: 2 + pp ranks);
step 0 (warm-up) is left out and medians are taken over steps and --repeats. The bubble is the
trainer's `pipeline_bubble`: the stages' time waiting on a neighbour over their time in the pipeline.
On a machine with fewer cores than ranks the stages share cores, so wall-clock ratios are what this
machine gives, not what separate devices would.

    .venv/bin/python bench/pipeline.py [--repeats 2] [--steps 5] [--layers 8]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tidal.launch import jobs  # noqa: E402
from megatron_vs_torch import med  # noqa: E402  (bench/ is this script's directory: the same median of medians)

CONFIGS = {  # name: (pp, pp_drain)
    "pp=1": (1, "step"),
    "pp=2, 1F1B across groups": (2, "step"),
    "pp=2, drain per group": (2, "group"),
    "pp=4, 1F1B across groups": (4, "step"),
    "pp=4, drain per group": (4, "group"),
}
JOB = ["data.prompts_per_step=8", "generator.samples_per_prompt=4", "generator.max_new_tokens=32",
       "trainer.backend=megatron", "logging.plots=false", "checkpoint_every=0", "checkpoint_minutes=0"]


def write_model(path: Path, *, layers: int) -> Path:
    """A random-init Qwen3 (seed 0) with the embedded tokenizer, as an HF directory."""
    import torch
    import transformers

    from tidal.modeling.hf import ATTN_IMPL, load_tokenizer, save_hf

    tok = load_tokenizer(None)
    config = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=256, intermediate_size=768,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                      head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True,
                                      bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.eos_token_id)
    config._attn_implementation = ATTN_IMPL
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
    save_hf(model, tok, path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "model", layers=args.layers)
        runs: dict[str, list[list[dict]]] = {name: [] for name in CONFIGS}
        for k in range(args.repeats):  # alternating, so drift hits every config alike
            for name, (pp, drain) in CONFIGS.items():
                out = Path(tmp) / f"run{k}-{pp}-{drain}"
                runs[name].append(jobs.run("grpo", output_dir=out, nproc=2 + pp, steps=args.steps, overrides=[
                    *JOB, f"model.path={model}", f"trainer.pp={pp}", f"trainer.pp_drain={drain}"]).metrics)
    digests = {name: [[r["trainer/rollout_digest"] for r in rows] for rows in rs] for name, rs in runs.items()}
    base = {key: med(runs["pp=1"], key) for key in ("step_s", "trainer/train_s")}
    table = []
    for name, (pp, drain) in CONFIGS.items():
        step, train = med(runs[name], "step_s"), med(runs[name], "trainer/train_s")
        bubble = med(runs[name], "trainer/pipeline_bubble") if pp > 1 else None
        row = [name, f"{step:.3f}", f"{step / base['step_s']:.2f}x", f"{train:.3f}",
               f"{train / base['trainer/train_s']:.2f}x", "-" if bubble is None else f"{bubble:.2f}"]
        if drain == "group":  # against the same pp's 1F1B across groups
            across = f"pp={pp}, 1F1B across groups"
            row.append(f"{train / med(runs[across], 'trainer/train_s'):.2f}x")
        else:
            row.append("-")
        row.append("yes" if digests[name] == digests["pp=1"] else "no")
        table.append(row)
    print(f"{args.layers}-layer random-init Qwen3 (hidden 256), B=8 x G=4, 32 new tokens, periodic, "
          f"{args.repeats} repeats x {args.steps} steps (step 0 left out); train_s: the trainer's streamed phase "
          f"and barrier")
    print(tabulate(table, headers=["config", "step_s", "vs pp=1", "train_s", "vs pp=1", "bubble",
                                   "train_s vs 1F1B", "same rollouts as pp=1"], disable_numparse=True))


if __name__ == "__main__":
    main()
