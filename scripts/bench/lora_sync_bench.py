"""A LoRA actor's two ways into the vLLM engine, side by side: merged weights (``lora_sync="merged"``: every
sync reloads all weights with the adapters' deltas added) against vLLM's LoRA adapters (``"adapter"``: the
adapter saved and loaded as a new ``LoRARequest`` per sync, generation through vLLM's LoRA kernels).

    .venv-vllm/bin/python scripts/bench/lora_sync_bench.py --assets .bench-assets [--repeats 3] [--rank 16]

The actor is W1's (``workloads``: Llama, hidden 256, 4 layers, 32k vocabulary, 20.6M parameters) with LoRA
on the attention and MLP projections. Each run (a fresh process per mode, the order alternating) does 6
rounds of: change the adapters (as an update would), sync, generate 8 prompts x K = 8 responses of up to 64
tokens. Printed: median sync and generation seconds of rounds 2-6 per run, as medians [min-max] over the
repeats, with the CPU model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULT_PREFIX, child_env, log  # noqa: E402
from engine_bench import cpu_model  # noqa: E402
from workloads import MAX_NEW_TOKENS, assets_dir, load_rows  # noqa: E402


def one_run(args) -> None:
    import time

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lit_rlhf.engines.vllm import VLLMEngine
    from lit_rlhf.models import load_tokenizer
    from lit_rlhf.rollout import GenerationSettings

    torch.set_num_threads(args.threads)
    folder = assets_dir(args.assets, "full") / "actor"
    tok = load_tokenizer(str(folder), padding_side="left")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    actor = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                           LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets))  # fmt: skip
    prompts = [p["ids"] for p in load_rows(args.assets, "full")["grpo_prompts"][:8]]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts]).repeat_interleave(8, 0)
    mask = (ids != tok.pad_token_id).long()
    settings = GenerationSettings(max_new_tokens=MAX_NEW_TOKENS, num_samples=8)
    engine = VLLMEngine(kv_cache_gib=1, lora_sync=args.mode)
    engine.setup(actor, tok)
    sync, gen = [], []
    for _ in range(6):
        with torch.no_grad():
            for name, p in actor.named_parameters():
                if "lora_B" in name:
                    p.add_(1e-3 * torch.randn_like(p))
        engine.sync_weights(actor)
        sync.append(engine.stats()["sync_s"])
        start = time.perf_counter()
        engine.generate(ids, mask, settings)
        gen.append(time.perf_counter() - start)
    print(RESULT_PREFIX + json.dumps({"sync_s": statistics.median(sync[1:]), "generate_s": statistics.median(gen[1:])}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", default=".bench-assets")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--mode", choices=["merged", "adapter"], help=argparse.SUPPRESS)  # one run (internal)
    args = parser.parse_args()
    if args.mode:
        return one_run(args)
    from compare import build_assets

    args.size = "full"
    build_assets(args, ["W1_grpo"])
    runs: dict[str, list[dict]] = {"merged": [], "adapter": []}
    for i in range(args.repeats):
        for mode in ("merged", "adapter") if i % 2 == 0 else ("adapter", "merged"):
            cmd = [sys.executable, __file__, "--assets", args.assets, "--threads", str(args.threads),
                   "--rank", str(args.rank), "--mode", mode]  # fmt: skip
            proc = subprocess.run(cmd, env={**child_env(args.threads), "VLLM_CPU_KVCACHE_SPACE": "1"},
                                  capture_output=True, text=True)  # fmt: skip
            lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
            if proc.returncode or not lines:
                raise SystemExit(proc.stderr[-3000:])
            runs[mode].append(json.loads(lines[-1][len(RESULT_PREFIX) :]))
            log(f"  {mode}: {runs[mode][-1]}")
    print(f"CPU: {cpu_model()}; threads {args.threads}; W1 actor with LoRA rank {args.rank}; {args.repeats} runs each")
    print("| mode | sync s | generation s (64 responses) |\n|---|---|---|")
    for mode, rows in runs.items():
        cells = [f"{statistics.median(v):.3g} [{min(v):.3g}-{max(v):.3g}]"
                 for v in ([r["sync_s"] for r in rows], [r["generate_s"] for r in rows])]  # fmt: skip
        print(f"| {mode} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
